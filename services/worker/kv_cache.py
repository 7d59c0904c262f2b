"""Paged KV cache: per-layer block tensors. Block ids come from the scheduler's allocator
(``services/scheduler/block_accounting.py``); the block tables are in ``seq_table.py``.

Layout per layer (``docs/architecture.md``, "Vocabulary"): K and V are ``[num_blocks, block_size, num_kv_heads,
head_dim]``. Token ``pos`` of a sequence lives in slot ``block_table[pos // block_size] * block_size
+ pos % block_size`` of the flattened ``[num_blocks * block_size, num_kv_heads, head_dim]`` view.

The storage dtype is the model's, or float8 e4m3 (``--kv-cache-dtype fp8``) with one scale per
tensor, K and V of each layer (``k_scale`` / ``v_scale``; ``fuseserve.kernels.kv_quant``): one byte
per value, so the same memory holds twice the blocks of a bf16 cache.
"""

from __future__ import annotations

import torch

from fuseserve.errors import KVCacheTooSmallError
from fuseserve.kernels import kv_quant


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block costs over all layers, K and V together."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


class KVCache:
    """K and V block tensors of every layer, each ``[num_blocks, block_size, num_kv_heads, head_dim]``
    in ``dtype`` (the storage dtype: the model's, or ``torch.float8_e4m3fn``).

    k_scale, v_scale: per layer, the value one stored unit stands for (``kv_quant``; 1.0 unless fp8
    is calibrated otherwise; unused for a float cache).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        if num_blocks < 1:
            raise KVCacheTooSmallError("KV cache has no blocks")
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.k_scale = [kv_quant.DEFAULT_SCALE] * num_layers
        self.v_scale = [kv_quant.DEFAULT_SCALE] * num_layers

    @staticmethod
    def num_blocks_for(
        memory_bytes: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """Blocks that fit in ``memory_bytes``."""
        return memory_bytes // bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
