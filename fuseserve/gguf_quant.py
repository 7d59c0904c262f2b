"""GGUF kept quantized: a ``.gguf`` file repacked ONCE into fuseserve's quantized checkpoint.

``--quantization gguf`` (``pipeline(quantization="gguf")``) selects this conversion; without it a GGUF
file is dequantized to float32 (``fuseserve.gguf_cache.convert_gguf``), as before. The default stays
float32 so an existing cache, its speed and every existing output are unchanged; on a CPU whose
PyTorch has no fast int4 kernel the quantized model is smaller but not faster (README, "Quantized
models").

Each quantized GGUF tensor becomes the canonical form of ``fuseserve.kernels.quant_linear``:

    W[n, k] = q[n, k] * scale[n, k // G] + offset[n, k // G]

stored as ``<module>.qweight`` (uint8 ``[N, K]``), ``<module>.scales`` and ``<module>.offsets``
(float32 ``[N, K / G]``); ``config.json`` gains ``quantization_config = {"quant_method": "gguf",
"modules": {module: {"type", "bits", "group_size"}}}``. The block layouts decoded here are ggml's
(``ggml-quants.c``, ``dequantize_row_*``): the decoded values equal ``gguf.quants.dequantize``'s
(tested), so the weights are exactly those of the float32 conversion.

| GGUF type | block | bits | group | scale | offset |
|---|---|---|---|---|---|
| Q4_0 | 32 values: fp16 d, 16 bytes of nibbles | 4 | 32 | d | -8 d |
| Q4_1 | 32 values: fp16 d, fp16 m, 16 bytes of nibbles | 4 | 32 | d | m |
| Q8_0 | 32 values: fp16 d, 32 int8 | 8 | 32 | d | -128 d |
| Q4_K | 256 values: fp16 d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles | 4 | 32 | d sc | -dmin m |
| Q6_K | 256 values: 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, fp16 d | 6 | 16 | d sc | -32 d sc |

Only the LLaMA architecture's tensor names are mapped (q and k rows un-permuted as ``transformers``
does: GGUF stores them interleaved for rotary); another architecture is refused with
``ModelLoadError`` naming it. NumPy only: this module runs where the model is resolved.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import shutil
import sys
import tempfile
import time

import numpy as np

from fuseserve.errors import ModelLoadError

logger = logging.getLogger(__name__)

QUANT_METHOD = "gguf"
"""``quantization_config["quant_method"]`` of a checkpoint written here."""

_LLAMA_NAMES = {
    "token_embd": "model.embed_tokens",
    "output": "lm_head",
    "output_norm": "model.norm",
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


# --------------------------------------------------------------------------- block decoders


def _f16(raw: np.ndarray) -> np.ndarray:
    """``[..., 2]`` uint8 → ``[...]`` float32 (little-endian fp16)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[..., B]`` bytes → ``[..., 2B]``: the low nibbles of all bytes, then the high nibbles."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _q4_0(blocks: np.ndarray):
    d = _f16(blocks[..., 0:2])
    return _nibbles(blocks[..., 2:18]), d, -8 * d


def _q4_1(blocks: np.ndarray):
    return _nibbles(blocks[..., 4:20]), _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])


def _q8_0(blocks: np.ndarray):
    d = _f16(blocks[..., 0:2])
    q = (blocks[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d, -128 * d


def _q4_k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes ``[..., 12]`` → 6-bit scales and mins ``[..., 8]`` each."""
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    m = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    m[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    m[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, m


def _q4_k(blocks: np.ndarray):
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, m = _q4_k_scales(blocks[..., 4:16])
    chunks = blocks[..., 16:144].reshape(blocks.shape[:-1] + (4, 32))  # 4 x 64 values
    q = _nibbles(chunks).reshape(blocks.shape[:-1] + (256,))  # sub-blocks 2c (low), 2c+1 (high)
    scale = d[..., None] * sc.astype(np.float32)
    offset = -(dmin[..., None] * m.astype(np.float32))
    return q, scale, offset


def _q6_k(blocks: np.ndarray):
    lead = blocks.shape[:-1]
    ql = blocks[..., 0:128].reshape(lead + (2, 64))
    qh = blocks[..., 128:192].reshape(lead + (2, 1, 32))
    sc = blocks[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks[..., 208:210])
    low = np.stack([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-2)
    high = (qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3  # [..., 2, 4, 32]
    q = (low | (high << 4)).reshape(lead + (256,))
    scale = d[..., None] * sc
    return q, scale, -32 * scale


#: GGUF type name → (values per block, bytes per block, bits, group size, decoder)
BLOCK_TYPES = {
    "Q4_0": (32, 18, 4, 32, _q4_0),
    "Q4_1": (32, 20, 4, 32, _q4_1),
    "Q8_0": (32, 34, 8, 32, _q8_0),
    "Q4_K": (256, 144, 4, 32, _q4_k),
    "Q6_K": (256, 210, 6, 16, _q6_k),
}


def decode(
    type_name: str, raw: np.ndarray, num_cols: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """Decode GGUF blocks into the canonical form.

    raw: ``[N, bytes per row]`` uint8 (``gguf.GGUFReader``'s ``data`` of a quantized tensor);
    num_cols: K, values per row. Returns ``(q [N, K] uint8, scale [N, K / G] float32,
    offset [N, K / G] float32, bits, G)``. Raises ``ModelLoadError`` for another type or a row whose
    size does not match.
    """
    if type_name not in BLOCK_TYPES:
        raise ModelLoadError(
            f"GGUF tensor type {type_name} cannot be kept quantized (supported: {', '.join(BLOCK_TYPES)})"
        )
    per_block, nbytes, bits, group, fn = BLOCK_TYPES[type_name]
    n = raw.shape[0]
    if num_cols % per_block or raw.shape[1] != num_cols // per_block * nbytes:
        raise ModelLoadError(f"GGUF {type_name} rows of {raw.shape[1]} bytes do not hold {num_cols} values")
    blocks = raw.reshape(n, num_cols // per_block, nbytes)
    q, scale, offset = fn(blocks)
    return (
        np.ascontiguousarray(q.reshape(n, num_cols)),
        np.ascontiguousarray(scale.reshape(n, -1), dtype=np.float32),
        np.ascontiguousarray(offset.reshape(n, -1), dtype=np.float32),
        bits,
        group,
    )


# --------------------------------------------------------------------------- conversion


def _unpermute_rows(a: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo GGUF's rotary row interleave of q / k (rows ``[heads, 2, dim/2]`` → ``[heads, dim/2, 2]``
    read back as ``transformers``' ``_reverse_permute_weights``)."""
    half = a.shape[0] // num_heads // 2
    return a.reshape(num_heads, half, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def hf_name(gguf_name: str) -> tuple[str, str]:
    """GGUF tensor name → (Hugging Face module name, leaf). Raises ``ModelLoadError`` when unmapped."""
    m = re.fullmatch(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)", gguf_name)
    if not m or m[2] not in _LLAMA_NAMES:
        raise ModelLoadError(f"GGUF tensor {gguf_name} has no LLaMA name for the quantized conversion")
    module = _LLAMA_NAMES[m[2]]
    return (f"model.layers.{m[1]}.{module}" if m[1] is not None else module), m[3]


def quantized_tensors(path: pathlib.Path, num_heads: int, num_kv_heads: int) -> tuple[dict, dict]:
    """Read the GGUF file ``path`` into ``(tensors, modules)``: safetensors-ready NumPy arrays by
    Hugging Face name, and per quantized module its ``{"type", "bits", "group_size"}``. A tied LM head
    (no ``output.weight``) gets its own copy of the embedding's tensors."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} cannot be kept quantized (only 'llama'); "
            f"load it without --quantization gguf"
        )
    tensors: dict[str, np.ndarray] = {}
    modules: dict[str, dict] = {}
    for t in reader.tensors:
        module, leaf = hf_name(t.name)
        heads = num_heads if ".q_proj" in module else num_kv_heads if ".k_proj" in module else None
        type_name = t.tensor_type.name
        if type_name in ("F32", "F16", "BF16") or leaf == "bias":
            a = _float_array(t, type_name)
            tensors[f"{module}.{leaf}"] = _unpermute_rows(a, heads) if heads else a
            continue
        q, scale, offset, bits, group = decode(type_name, np.asarray(t.data), int(t.shape[0]))
        if heads:
            q, scale, offset = (_unpermute_rows(a, heads) for a in (q, scale, offset))
        tensors.update({f"{module}.qweight": q, f"{module}.scales": scale, f"{module}.offsets": offset})
        modules[module] = {"type": type_name, "bits": bits, "group_size": group}
    if "lm_head" not in modules and "lm_head.weight" not in tensors:
        embed = "model.embed_tokens"
        for leaf in ("qweight", "scales", "offsets", "weight"):
            if f"{embed}.{leaf}" in tensors:
                tensors[f"lm_head.{leaf}"] = tensors[f"{embed}.{leaf}"].copy()
        if embed in modules:
            modules["lm_head"] = dict(modules[embed])
    return tensors, modules


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode()


def _float_array(t, type_name: str) -> np.ndarray:
    a = np.asarray(t.data)
    if type_name == "BF16":
        a = (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(a.astype(np.float32).reshape(tuple(int(s) for s in reversed(t.shape))))


def convert_gguf_quantized(path: pathlib.Path, target: pathlib.Path, digest: str, progress: bool) -> None:
    """Repack ``path`` into the quantized checkpoint directory ``target`` (config.json with its
    ``quantization_config``, model.safetensors, tokenizer files, generation_config.json), written to a
    temporary sibling and renamed into place. Raises ``ModelLoadError`` naming ``path``."""
    from safetensors.numpy import save_file
    from transformers import AutoConfig, GenerationConfig

    from fuseserve import gguf_cache

    start = time.perf_counter()
    if progress:
        print(f"fuseserve: repacking {path.name} (kept quantized) into {target}", file=sys.stderr)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        gguf_cache._check_gguf_tensors(path)
        gguf_cache._save_tokenizer(path, tmp)
        try:
            config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        except Exception as exc:
            raise ModelLoadError(
                f"cannot read the config of GGUF file {path} ({type(exc).__name__})"
            ) from exc
        tensors, modules = quantized_tensors(
            path,
            config.num_attention_heads,
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        )
        config.architectures = ["LlamaForCausalLM"]  # quantized_tensors refused any other
        config.quantization_config = {"quant_method": QUANT_METHOD, "source": path.name, "modules": modules}
        config.save_pretrained(str(tmp))
        GenerationConfig(
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=getattr(config, "pad_token_id", None),
        ).save_pretrained(str(tmp))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / gguf_cache._SOURCE_MARKER_FILE).write_text(
            json.dumps({"gguf": str(path), "sha256": digest, "quantized": True})
        )
        gguf_cache._make_readable(tmp)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("repacked %s in %.1f s into %s", path.name, time.perf_counter() - start, target)
