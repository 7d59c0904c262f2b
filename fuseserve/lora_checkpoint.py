"""A PEFT LoRA checkpoint's config checked without loading it: the one check every path runs.

A PEFT LoRA checkpoint is a directory holding ``adapter_config.json`` and
``adapter_model.safetensors``. ``check_adapter`` reads the config and refuses, with
``LoRAAdapterError`` naming the adapter and the fact, what fuseserve cannot serve: a missing or
unreadable file, a rank above ``max_lora_rank``, a PEFT feature not served (DoRA, LoRA biases,
``modules_to_save``, per-module rank/alpha patterns, parameter targets) and a target module that is
not one of the decoder's projections. It imports no torch: the gateway runs it when an adapter is
loaded at runtime (``services/gateway/lora_admin.py``), the worker when it reads the weights
(``services/worker/lora_adapter.py``, which also checks the tensors' shapes against the model), and
the pipeline's ``load_lora``.
"""

from __future__ import annotations

import json
from pathlib import Path

from fuseserve.errors import InvalidRequestError, LoRAAdapterError

SERVED_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
)
"""Checkpoint module names an adapter may target (``qkv_proj`` / ``gate_up_proj``: checkpoints that
store them fused, Phi-3); whether the model has them is checked tensor by tensor."""
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT options that change the computation beyond x A^T B^T (refused when set)
_REFUSED = {
    "use_dora": "DoRA",
    "modules_to_save": "modules_to_save",
    "trainable_token_indices": "trainable tokens",
    "target_parameters": "parameter targets (target_parameters)",
    "alpha_pattern": "per-module alpha (alpha_pattern)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "lora_bias": "LoRA biases (lora_bias)",
    "fan_in_fan_out": "fan_in_fan_out weights",
}


def check_adapter(name: str, path: str | Path, max_rank: int) -> dict:
    """The config of the PEFT LoRA checkpoint ``path`` served as ``name``, checked: a plain LoRA of
    rank <= ``max_rank`` on served targets, with its weights file present. Raises
    ``LoRAAdapterError`` (an ``InvalidRequestError``: HTTP 400) saying what is wrong."""
    path = Path(path)
    if not path.is_dir():
        raise LoRAAdapterError(
            name, f"{path} is not a directory (a PEFT checkpoint: {CONFIG_FILE} + {WEIGHTS_FILE})"
        )
    config = read_config(name, path)
    if config["r"] > max_rank:
        raise LoRAAdapterError(name, f"rank {config['r']} is above max_lora_rank={max_rank}")
    if not (path / WEIGHTS_FILE).is_file():
        raise LoRAAdapterError(name, f"{path / WEIGHTS_FILE} does not exist")
    return config


def check_runtime_load(
    name: object, path: object, max_rank: int, base_names: list[str], loaded: list[str]
) -> dict:
    """``check_adapter`` for an adapter loaded at runtime (``/v1/load_lora_adapter``,
    ``pipeline.load_lora``), its name first: a non-empty string that is none of ``base_names`` (the
    base model's) and ``loaded`` (the adapters served). Raises ``InvalidRequestError`` /
    ``LoRAAdapterError`` (400) saying what is wrong; returns the adapter's config."""
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise InvalidRequestError(
            f"lora_name must be a non-empty name without spaces around, got {name!r}", "lora_name"
        )
    if not isinstance(path, str) or not path:
        raise InvalidRequestError(f"lora_path must be a PEFT checkpoint directory, got {path!r}", "lora_path")
    if name in base_names:
        raise InvalidRequestError(f"lora_name {name!r} is the base model's name", "lora_name")
    if name in loaded:
        raise InvalidRequestError(f"LoRA adapter {name!r} is already loaded; unload it first", "lora_name")
    return check_adapter(name, path, max_rank)


def read_config(name: str, path: Path) -> dict:
    """The adapter's ``adapter_config.json``, checked to be a plain LoRA on served targets (the rank
    is not compared with a limit here: ``check_adapter``). Raises ``LoRAAdapterError``."""
    file = path / CONFIG_FILE
    try:
        config = json.loads(file.read_text())
    except OSError as e:
        raise LoRAAdapterError(name, f"cannot read {file}: {e.strerror or e}") from e
    except ValueError as e:
        raise LoRAAdapterError(name, f"{file} is not JSON: {e}") from e
    if not isinstance(config, dict):
        raise LoRAAdapterError(name, f"{file} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(name, f"peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(name, f"bias={config['bias']!r} is not served (only 'none')")
    for key, what in _REFUSED.items():
        if config.get(key):
            raise LoRAAdapterError(name, f"{what} is not served ({key}={config[key]!r})")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise LoRAAdapterError(name, f"{file}: r={config.get('r')!r} is not a rank >= 1")
    targets = config.get("target_modules")
    if isinstance(targets, list):  # a regex (a string) is checked through the tensors it matched
        for target in targets:
            if target.rpartition(".")[2] not in SERVED_TARGETS:
                raise LoRAAdapterError(name, unserved_target(target))
    return config


def unserved_target(target: str) -> str:
    """The message for an adapter target fuseserve does not adapt."""
    return (
        f"target module {target!r} is not served: LoRA applies to the decoder's projections "
        f"({', '.join(SERVED_TARGETS)})"
    )
