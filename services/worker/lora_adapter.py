"""PEFT LoRA adapters (``adapter_config.json`` + ``adapter_model.safetensors``) read for one base model.

A LoRA adapter (Hu et al. 2021) changes a linear layer ``y = x W^T`` into
``y = x W^T + scale * (x A^T) B^T`` with ``A [r, in]``, ``B [out, r]`` and ``scale = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with rsLoRA, Kalajdzievski 2023). PEFT names each tensor after the
Hugging Face module it adapts (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``);
the model's own checkpoint mapping (``loader.resolve_name``) turns that into fuseserve's module and
part (``model.layers.0.self_attn.qkv_proj``, part ``q``), so an adapter's ``B`` rows land in the
part's output rows of a stacked projection.

``read_adapter`` checks the config with ``fuseserve.lora_checkpoint.check_adapter`` (the one check
of the startup and the runtime paths) and then refuses, with ``LoRAAdapterError`` naming the adapter
and the fact: an unreadable weights file, a tensor that is not a LoRA weight of one of the decoder's
linear layers, and weights whose shapes are not the base model's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from fuseserve.errors import LoRAAdapterError
from fuseserve.lora_checkpoint import WEIGHTS_FILE, check_adapter, unserved_target
from fuseserve.worker.loader import resolve_name
from fuseserve.worker.lora_layers import LoRALinear
from fuseserve.worker.models.layers import MergedLinear
from fuseserve.worker.parallel import RowParallelLinear

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z_]\w*)?\.weight$")


def adaptable(module: nn.Module) -> bool:
    """Whether fuseserve adapts ``module``: a decoder's projection (stacked ``MergedLinear`` or
    ``RowParallelLinear``, float or quantized); not the LM head, embeddings, routers or experts."""
    return isinstance(module, MergedLinear | RowParallelLinear)


@dataclass
class LoRAAdapter:
    """One adapter, read for a model, on the CPU in fp32.

    name: the adapter's serving name. path: its directory. rank: the largest ``r`` of its tensors.
    scale: ``lora_alpha / r`` (rsLoRA: ``/ sqrt(r)``). weights: by fuseserve module name (e.g.
    ``model.layers.0.self_attn.qkv_proj``), by part (``"q"``; None: the whole module), the pair
    ``(A [r, in], B * scale [out_part, r])`` at full (unsplit) size.
    """

    name: str
    path: Path
    rank: int
    scale: float
    weights: dict[str, dict[Any, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)


def read_adapter(name: str, path: str | Path, model: nn.Module, max_rank: int) -> LoRAAdapter:
    """Read the PEFT adapter at ``path`` for ``model`` (built by ``loader.load_model``: its module
    names and full shapes). Raises ``LoRAAdapterError`` (see the module docstring)."""
    path = Path(path)
    config = check_adapter(name, path, max_rank)
    r = config["r"]
    alpha = float(config.get("lora_alpha", r))
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    tensors = _read_tensors(name, path / WEIGHTS_FILE)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAAdapterError(name, f"tensor {key!r} is not a LoRA A/B weight of a linear layer")
        pairs.setdefault(m["module"], {})[m["ab"]] = tensor
    if not pairs:
        raise LoRAAdapterError(name, f"{path / WEIGHTS_FILE} holds no LoRA weights")
    adapter = LoRAAdapter(name, path, 0, scale)
    for hf_module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(name, f"{hf_module}: lora_A or lora_B is missing")
        target, a, b = _place(name, model, hf_module, ab["A"].float(), ab["B"].float())
        module, part = target
        if part in adapter.weights.setdefault(module, {}):
            raise LoRAAdapterError(name, f"{hf_module}: adapted twice")
        if a.shape[0] > max_rank:
            raise LoRAAdapterError(name, f"{hf_module}: rank {a.shape[0]} is above max_lora_rank={max_rank}")
        adapter.rank = max(adapter.rank, a.shape[0])
        adapter.weights[module][part] = (a.contiguous(), (b * scale).contiguous())
    return adapter


def _read_tensors(name: str, file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except FileNotFoundError as e:
        raise LoRAAdapterError(name, f"{file} does not exist") from e
    except (OSError, SafetensorError) as e:
        raise LoRAAdapterError(name, f"cannot read {file}: {e}") from e


def _place(
    name: str, model: nn.Module, hf_module: str, a: torch.Tensor, b: torch.Tensor
) -> tuple[tuple[str, Any], torch.Tensor, torch.Tensor]:
    """``((our module, part), A, B)`` for PEFT's module ``hf_module``, shapes checked against the base
    model. Raises ``LoRAAdapterError``."""
    param, part = resolve_name(model, f"{hf_module}.weight")
    module_name = param.rpartition(".")[0]
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        module = None
    if isinstance(module, LoRALinear):  # a model already serving adapters
        module = module.base
    leaf = hf_module.rpartition(".")[2]
    if module is None or not adaptable(module) or param.rpartition(".")[2] != "weight":
        raise LoRAAdapterError(name, unserved_target(leaf) + f" ({hf_module})")
    full_in = _full_in(module)
    full_out = _full_out(module, part)
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise LoRAAdapterError(name, f"{hf_module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not pair")
    if a.shape[1] != full_in or b.shape[0] != full_out:
        raise LoRAAdapterError(
            name,
            f"{hf_module}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit the base model's "
            f"[{full_out}, {full_in}] weight (an adapter of another base model?)",
        )
    return (module_name, part), a, b


def _full_in(module: nn.Module) -> int:
    """The module's input features at full size (a row-parallel rank holds a slice)."""
    if isinstance(module, RowParallelLinear):
        from fuseserve.worker import parallel

        return module.in_features * parallel.world()[1]
    return module.in_features


def _full_out(module: nn.Module, part: Any) -> int:
    """Output rows of ``part`` (None: all parts) at full size."""
    if isinstance(module, MergedLinear):
        return module.full_sizes[part] if part is not None else sum(module.full_sizes.values())
    return module.out_features
