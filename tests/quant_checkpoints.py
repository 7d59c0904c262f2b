"""Test helper: tiny quantized checkpoints written in each format's on-disk layout, from its spec.

``write_quantized(hf, path, fmt, **options)`` rounds every linear layer of the decoder blocks of the
``transformers`` model ``hf`` to the nearest grid point (groups along the input features), writes
the checkpoint in format ``fmt`` (``gptq``, ``awq``, ``ct-int``, ``ct-fp8``) and puts the dequantized
weights back into ``hf``, which is then the reference: ``transformers`` running exactly the weights
the checkpoint encodes. It starts from the tensors ``save_pretrained`` writes, so mixture-of-experts
weights are quantized per expert under the names quantized hub checkpoints use
(``block_sparse_moe.experts.{e}.w1`` for Mixtral, ``mlp.experts.{e}.gate_proj`` for Qwen3-MoE; the
router stays float), and the reference gets them back through ``from_pretrained``. The layouts are
those ``services/worker/quant_formats.py`` documents; the packing here is written independently of
its unpacking (shifts into words, not the reverse of it).
"""

from __future__ import annotations

import json
import pathlib
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds column ORDER[i]


def pack_int32(vals: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned ``vals`` → int32 words, ``32 / bits`` consecutive values along ``dim`` per word, the
    first in the lowest bits."""
    per = 32 // bits
    v = vals.to(torch.int64)
    if dim == 0:
        v = v.T
    r, c = v.shape
    v = v.view(r, c // per, per)
    words = torch.zeros(r, c // per, dtype=torch.int64)
    for j in range(per):
        words |= v[:, :, j] << (bits * j)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.T.contiguous() if dim == 0 else words


def rtn(w: torch.Tensor, bits: int, group: int, sym: bool, g_idx: torch.Tensor | None = None):
    """Round-to-nearest quantization of ``w [N, K]`` in groups of ``group`` input features (by
    ``g_idx`` when given). Returns ``(q [N, K] uint8, scale [N, K/G] fp16-exact, zero [N, K/G] int)``
    with ``w ≈ scale * (q - zero)``."""
    n, k = w.shape
    g_idx = torch.arange(k) // group if g_idx is None else g_idx
    num_groups = int(g_idx.max()) + 1
    scale = torch.empty(n, num_groups)
    zero = torch.empty(n, num_groups)
    top = 2**bits - 1
    for g in range(num_groups):
        cols = w[:, g_idx == g]
        if sym:
            s = cols.abs().amax(1).clamp(min=1e-5) / (2 ** (bits - 1) - 1)
            z = torch.full((n,), float(2 ** (bits - 1)))
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = ((hi - lo) / top).clamp(min=1e-5)
            z = torch.round(-lo / s.half().float()).clamp(0, top)
        scale[:, g], zero[:, g] = s.half().float(), z
    q = torch.clamp(torch.round(w / scale[:, g_idx]) + zero[:, g_idx], 0, top).to(torch.uint8)
    return q, scale, zero


def dequantize(q, scale, zero, g_idx):
    return scale[:, g_idx] * (q.float() - zero[:, g_idx])


def _on_disk_state(hf) -> dict[str, torch.Tensor]:
    """The tensors ``hf.save_pretrained`` writes, by their on-disk names."""
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        return {
            k: v for f in sorted(pathlib.Path(tmp).glob("*.safetensors")) for k, v in load_file(f).items()
        }


def _quantized_linears(state: dict[str, torch.Tensor]) -> list[str]:
    """The linear layers of the decoder blocks, by on-disk name (routers, ``....gate``, stay float)."""
    return [
        k.removesuffix(".weight")
        for k, v in state.items()
        if ".layers." in k and k.endswith(".weight") and v.dim() == 2 and not k.endswith(".gate.weight")
    ]


def _load_reference(hf, state: dict[str, torch.Tensor]) -> None:
    """Put the float ``state`` (on-disk names) into ``hf`` through ``from_pretrained``'s own conversion."""
    with tempfile.TemporaryDirectory() as tmp:
        hf.config.save_pretrained(tmp)
        save_file(state, f"{tmp}/model.safetensors", {"format": "pt"})
        ref = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    hf.load_state_dict(ref.state_dict())


def write_quantized(hf, path, fmt: str, bits: int = 4, group: int = 32, sym: bool = True, **opt) -> dict:
    """Write ``hf`` quantized in ``fmt`` to ``path`` and load the dequantized weights into ``hf``.

    gptq: ``desc_act`` (random act-order ``g_idx``), ``v2`` (gptq_v2 zeros); ``group=-1`` per channel.
    awq: 4-bit, zero point. ct-int: pack-quantized, ``actorder`` (``weight_g_idx``). ct-fp8: FP8
    e4m3 per channel (``strategy="tensor"`` for one scale). Returns the ``quantization_config``.
    """
    path = pathlib.Path(path)
    state = _on_disk_state(hf)
    reference = dict(state)  # the float weights the checkpoint encodes, by on-disk name
    act_orders: dict[tuple, torch.Tensor] = {}  # one order per input: GPTQ's comes from the input's Hessian
    for name in _quantized_linears(state):
        w = state.pop(f"{name}.weight").float()
        n, k = w.shape
        g = k if group == -1 else group
        if fmt == "ct-fp8":
            per_tensor = opt.get("strategy") == "tensor"
            amax = w.abs().amax() if per_tensor else w.abs().amax(1, keepdim=True)
            s = (amax / 448.0).float()
            w8 = (w / s).to(torch.float8_e4m3fn)
            state[f"{name}.weight"] = w8
            state[f"{name}.weight_scale"] = s.reshape(1) if per_tensor else s.reshape(n, 1)
            deq = w8.float() * s
        else:
            g_idx = None
            if opt.get("desc_act") or opt.get("actorder"):
                key = (name.rsplit(".", 1)[0], name.endswith(("o_proj", "down_proj", "w2")), k)
                if key not in act_orders:
                    perm = torch.randperm(k, generator=torch.Generator().manual_seed(len(act_orders)))
                    act_orders[key] = torch.empty(k, dtype=torch.long)
                    act_orders[key][perm] = torch.arange(k) // g
                g_idx = act_orders[key]
            q, scale, zero = rtn(w, bits, g, sym, g_idx)
            gi = torch.arange(k) // g if g_idx is None else g_idx
            deq = dequantize(q, scale, zero, gi)
            state.update(_format_tensors(fmt, name, q, scale, zero, bits, gi, g_idx is not None, sym, opt))
        reference[f"{name}.weight"] = deq
    _load_reference(hf, reference)
    qc = _config(fmt, bits, group, sym, opt)
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"), {"format": "pt"}
    )
    config = hf.config.to_dict()
    config["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return qc


def _format_tensors(fmt, name, q, scale, zero, bits, g_idx, act_order, sym, opt) -> dict:
    if fmt == "gptq":
        stored_zero = zero if opt.get("v2") else zero - 1
        out = {
            f"{name}.qweight": pack_int32(q.T.contiguous(), bits, dim=0),
            f"{name}.qzeros": pack_int32(
                stored_zero.T.contiguous().to(torch.int64) & (2**bits - 1), bits, dim=1
            ),
            f"{name}.scales": scale.T.contiguous().half(),
            f"{name}.g_idx": g_idx.to(torch.int32),
        }
        return out
    if fmt == "awq":

        def awq_pack(v):  # [R, C] → [R, C / 8], columns in AutoAWQ's nibble order
            r, c = v.shape
            return pack_int32(v.view(r, c // 8, 8)[:, :, AWQ_PACK_ORDER].reshape(r, c), 4, dim=1)

        return {
            f"{name}.qweight": awq_pack(q.T.contiguous()),
            f"{name}.qzeros": awq_pack(zero.T.contiguous().to(torch.uint8)),
            f"{name}.scales": scale.T.contiguous().half(),
        }
    if fmt == "ct-int":
        out = {
            f"{name}.weight_packed": pack_int32(q, bits, dim=1),
            f"{name}.weight_scale": scale.to(torch.bfloat16) if opt.get("bf16_scales") else scale.half(),
            f"{name}.weight_shape": torch.tensor(list(q.shape), dtype=torch.int64),
        }
        if act_order:
            out[f"{name}.weight_g_idx"] = g_idx.to(torch.int32)
        if not sym:
            out[f"{name}.weight_zero_point"] = pack_int32(zero.to(torch.uint8), bits, dim=0)
        return out
    raise ValueError(fmt)


def _config(fmt, bits, group, sym, opt) -> dict:
    if fmt == "gptq":
        return {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group,
            "desc_act": bool(opt.get("desc_act")),
            "sym": sym,
            "checkpoint_format": "gptq_v2" if opt.get("v2") else "gptq",
        }
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    weights = (
        {"num_bits": 8, "type": "float", "symmetric": True, "strategy": opt.get("strategy", "channel")}
        if fmt == "ct-fp8"
        else {
            "num_bits": bits,
            "type": "int",
            "symmetric": sym,
            "strategy": "channel" if group == -1 else "group",
            "group_size": None if group == -1 else group,
            "actorder": "group" if opt.get("actorder") else None,
        }
    )
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized" if fmt == "ct-fp8" else "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
        "ignore": [
            "lm_head",
            r"re:.*mlp\.gate$",
            r"re:.*block_sparse_moe\.gate$",
        ],  # llm-compressor's MoE recipes
        "quantization_status": "compressed",
    }
