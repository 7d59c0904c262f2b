"""Test helper: PEFT LoRA adapters with random non-zero A and B for the tiny checkpoints of ``tiny_models``.

- ``adapter_specs(family)``: three adapters of ranks 4, 8 and 16 with different target modules
  (attention only for a mixture of experts, whose experts PEFT does not target as modules; Phi-3's
  fused ``qkv_proj`` / ``gate_up_proj``), one with rsLoRA.
- ``write_adapter(hf, path, r, targets, seed)``: a PEFT adapter of ``hf`` saved to ``path``
  (``adapter_config.json`` + ``adapter_model.safetensors``), every ``lora_A`` / ``lora_B`` drawn at
  random (PEFT starts B at zero, which would make the adapter a no-op).
- ``peft_model(hf, adapters)``: ``hf`` with the saved adapters loaded by PEFT, by name.
"""

from __future__ import annotations

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
TARGETS = {  # family prefix -> the target modules of a4, a8, a16
    "dense": (["q_proj", "v_proj"], ["k_proj", "o_proj", "gate_proj", "down_proj"], ATTENTION + MLP),
    "mixtral": (["q_proj", "v_proj"], ["k_proj", "o_proj"], ATTENTION),
    "phi3": (["qkv_proj"], ["o_proj", "gate_up_proj"], ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
}


def adapter_specs(family: str) -> dict[str, dict]:
    """name → ``{"r", "targets", "alpha", "rslora", "seed"}`` for a family of ``tiny_models.CONFIGS``."""
    kind = next((k for k in TARGETS if family.startswith(k)), "dense")
    t4, t8, t16 = TARGETS[kind]
    return {
        "a4": {"r": 4, "targets": t4, "alpha": 8, "rslora": False, "seed": 1},
        "a8": {"r": 8, "targets": t8, "alpha": 16, "rslora": False, "seed": 2},
        "a16": {"r": 16, "targets": t16, "alpha": 32, "rslora": True, "seed": 3},
    }


def write_adapter(hf, path, r: int, targets: list[str], seed: int, alpha: int = 16, rslora: bool = False):
    """Save a random LoRA adapter of ``hf`` (not changed) to ``path``; returns ``path``."""
    import copy

    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, use_rslora=rslora)
    model = get_peft_model(copy.deepcopy(hf), config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(path)
    return path


def write_adapters(hf, root, family: str = "llama") -> dict[str, str]:
    """Every adapter of ``adapter_specs(family)`` under ``root``; returns name → path."""
    paths = {}
    for name, spec in adapter_specs(family).items():
        paths[name] = str(
            write_adapter(
                hf, root / name, spec["r"], spec["targets"], spec["seed"], spec["alpha"], spec["rslora"]
            )
        )
    return paths


def peft_model(hf, adapters: dict[str, str]):
    """``hf`` (a copy) wrapped by PEFT with each adapter loaded under its name (select with
    ``set_adapter``; ``disable_adapter()`` gives the base)."""
    import copy

    from peft import PeftModel

    names = list(adapters)
    model = PeftModel.from_pretrained(copy.deepcopy(hf), adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()
