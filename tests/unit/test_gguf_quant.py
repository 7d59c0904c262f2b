"""fuseserve/gguf_quant.py: GGUF blocks decoded into the canonical quantized form, against the
``gguf`` package's own dequantizer (``gguf.quants.dequantize``)."""

from __future__ import annotations

import numpy as np
import pytest

from fuseserve import gguf_quant as gq
from fuseserve.errors import ModelLoadError

gguf = pytest.importorskip("gguf")


def _random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes with finite fp16 scale fields, ``[rows, bytes per row]``."""
    rng = np.random.default_rng(seed)
    per_block, nbytes, *_ = gq.BLOCK_TYPES[type_name]
    raw = rng.integers(0, 256, (rows, cols // per_block, nbytes), dtype=np.uint8)
    fp16_fields = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}[type_name]
    for off in fp16_fields:
        d = (rng.random(raw.shape[:2]) * 0.01 + 1e-4).astype(np.float16)
        raw[..., off : off + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", list(gq.BLOCK_TYPES))
def test_decode_equals_gguf_dequantize(type_name):
    raw = _random_blocks(type_name, 6, 512)
    q, scale, offset, bits, group = gq.decode(type_name, raw, 512)
    assert q.shape == (6, 512) and q.dtype == np.uint8 and q.max() < 2**bits
    assert scale.shape == offset.shape == (6, 512 // group)
    mine = (q.reshape(6, -1, group) * scale[..., None] + offset[..., None]).reshape(6, 512)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    np.testing.assert_array_equal(mine, want)


def test_unsupported_type_is_named():
    with pytest.raises(ModelLoadError, match="Q5_K"):
        gq.decode("Q5_K", np.zeros((1, 176), np.uint8), 256)


def test_row_size_mismatch():
    with pytest.raises(ModelLoadError, match="do not hold"):
        gq.decode("Q4_0", np.zeros((2, 17), np.uint8), 32)


def test_unpermute_rows_matches_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    a = np.arange(24 * 5, dtype=np.float32).reshape(24, 5)
    want = LlamaTensorProcessor()._reverse_permute_weights(a, 3, 3)
    np.testing.assert_array_equal(gq._unpermute_rows(a, 3), want)


def test_names():
    assert gq.hf_name("blk.3.attn_q.weight") == ("model.layers.3.self_attn.q_proj", "weight")
    assert gq.hf_name("token_embd.weight") == ("model.embed_tokens", "weight")
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        gq.hf_name("rope_freqs.weight")
