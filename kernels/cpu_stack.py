"""The decoder layers of a LLaMA-shaped model in one C++ call per pass (``cpu_stack.cpp``): the CPU's
counterpart of replaying a captured CUDA graph.

An eager CPU pass spent about as long in Python and the dispatcher between the operators as in the
operators themselves (a 16-sequence bf16 decode pass of SmolLM2: 41 ms through the Python layers, 27 ms
through this call, same output bit for bit; ``benchmarks/README.md``). ``decoder_layers`` runs the same
operators in the same order as ``DecoderLayer.forward`` does on its CPU path, from C++.
``services/worker/layer_stack.py`` decides which models and passes take it.

Build: at first use, by ``cpu_build`` (as ``cpu_fused``). Without a compiler ``available`` is False and
the Python layers run.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

from fuseserve.kernels import cpu_attention, cpu_build, cpu_fused, cpu_linear

SOURCE = Path(__file__).with_name("cpu_stack.cpp")
ENABLED = os.environ.get("FUSESERVE_LAYER_STACK", "1") != "0"
"""``FUSESERVE_LAYER_STACK=0`` keeps every pass in the Python layers, as does setting this to False
(``benchmarks.pass_profile``'s ``python`` variant)."""


@functools.cache
def load() -> Any:
    """``torch.ops.fuseserve_stack`` with the operators it calls loaded (``cpu_fused``,
    ``cpu_attention``), building what is not built yet. Raises ``cpu_build.CpuKernelUnavailable``."""
    cpu_fused.load()
    cpu_attention.load()  # with the prefill-chunk library where it is used
    if cpu_linear.available():  # the small-pass bf16 linears (AMX), where prepack makes their copies
        cpu_linear.load()
    return cpu_build.load(SOURCE, "fuseserve_stack")


@functools.cache
def available() -> bool:
    """Whether the operator and the ones it calls build and load here (the first call may compile)."""
    return cpu_build.loads(load, "the C++ decoder-layer stack (the Python layers run)")


def decoder_layers(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    weights: list[torch.Tensor],
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    metadata: cpu_attention.CpuAttentionMetadata,
    windows: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    scale: float,
) -> torch.Tensor:
    """The layers over ``x [T, hidden]`` (the embeddings) → the last layer's output ``[T, hidden]``.

    ``positions [T]`` int64; ``cos`` / ``sin`` the rotary tables ``[max_positions, R]``; ``weights``
    fourteen per layer: input norm, qkv (packed, bias, small-pass copy), o (the same three),
    post-attention norm, gate_up (three), down (three), an empty tensor for a missing bias or copy
    (``layer_stack._linear``); one K and one
    V cache ``[num_blocks, block_size, KVH, D]`` per layer, written at ``metadata.slot_mapping``;
    ``windows`` each layer's sliding window (0: none). Raises ``RuntimeError`` on inconsistent sizes.
    """
    split_ints, split_tensors = _split_args(metadata.split)
    return load().decoder_layers(
        x,
        positions,
        cos,
        sin,
        weights,
        k_caches,
        v_caches,
        metadata.slot_mapping,
        metadata.block_tables,
        metadata.cu_seqlens_q,
        metadata.seq_lens,
        split_ints,
        split_tensors,
        windows,
        num_heads,
        num_kv_heads,
        head_dim,
        eps,
        scale,
    )


def _split_args(split) -> tuple[list[int], list[torch.Tensor]]:
    """``cpu_attention.PrefillSplit`` as the operator's ``split_ints`` / ``split_tensors`` (``cpu_stack.cpp``,
    ``attend``): ``[0]`` and none without a split."""
    if split is None:
        return [0], []
    rest = split.rest
    ints = [1, 0 if rest is None else 1 if split.prefix else 2, len(split.prefills)]
    tensors = [] if rest is None else [rest.block_tables, rest.cu_seqlens_q, rest.seq_lens, split.token_idx]
    for chunk in split.prefills:
        ints += [chunk.start, chunk.end, chunk.context_len]
        tensors.append(chunk.blocks)
    return ints, tensors
