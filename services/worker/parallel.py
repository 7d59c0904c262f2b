"""Tensor parallelism inside one worker (Megatron-LM, Shoeybi et al. 2019), over ``torch.distributed``.

With N ranks each rank holds 1/N of every large matrix: column-parallel layers (``qkv_proj``,
``gate_up_proj``, expert ``gate_up_proj``) keep a slice of the output rows of each part, so each rank
computes its own attention heads and its own slice of the MLP's intermediate features; row-parallel
layers (``o_proj``, ``down_proj``, expert ``down_proj``) keep the matching input columns and their
partial sums are added with one all-reduce (one after attention, one after the MLP). The embedding
and the LM head are split by vocabulary: each rank looks up (or scores) its own token range, then an
all-reduce (embedding) or all-gather (logits) completes the result. Norms and the MoE router are
replicated. KV heads split across ranks; with fewer KV heads than ranks each KV head is replicated on
``N / num_kv_heads`` ranks. Without an initialised process group everything is rank 0 of 1.

Sharded modules answer ``shard_source(param_name, part) -> (dim, start, length)``: the part of the
checkpoint tensor this rank holds, which is all the loader reads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def world() -> tuple[int, int]:
    """``(rank, size)`` of the tensor-parallel group: the default process group, else ``(0, 1)``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks (in place); identity on one rank."""
    if world()[1] > 1:
        dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate the ranks' ``x [..., n]`` along the last dimension → ``[..., N * n]``."""
    size = world()[1]
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def divide(n: int, size: int, what: str) -> int:
    """``n / size``; raises ``ValueError`` when ``size`` does not divide ``n``."""
    if n % size:
        raise ValueError(f"tensor parallel size {size} does not divide {what} ({n})")
    return n // size


def kv_heads_per_rank(num_kv_heads: int) -> int:
    """KV heads this rank holds: ``num_kv_heads / N``, at least 1 (replicated when fewer than N)."""
    size = world()[1]
    return divide(num_kv_heads, size, "the KV heads") if num_kv_heads >= size else 1


def kv_head_start(num_kv_heads: int) -> int:
    """Index of this rank's first KV head in the full model."""
    rank, size = world()
    if num_kv_heads >= size:
        return rank * (num_kv_heads // size)
    return rank // divide(size, num_kv_heads, "tensor parallel size by the KV heads")


def vocab_range(vocab_size: int) -> tuple[int, int]:
    """``[start, end)`` of the token ids this rank holds (embedding rows, LM-head rows)."""
    rank, size = world()
    per_rank = divide(vocab_size, size, "the vocabulary")
    return rank * per_rank, (rank + 1) * per_rank


class VocabParallelEmbedding(nn.Embedding):
    """Embedding whose rows (token ids) are split across ranks; ids of other ranks contribute zeros."""

    def __init__(self, vocab_size: int, dim: int):
        self.start, self.end = vocab_range(vocab_size)
        super().__init__(self.end - self.start, dim)

    def shard_source(self, param_name: str, part) -> tuple[int, int, int]:
        """``(dim, start, length)``: the part of the checkpoint tensor this rank holds."""
        return 0, self.start, self.end - self.start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [T]`` → ``[T, dim]``."""
        if world()[1] == 1:
            return super().forward(ids)
        mine = (ids >= self.start) & (ids < self.end)
        out = F.embedding(torch.where(mine, ids - self.start, 0), self.weight)
        return all_reduce(out * mine.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(nn.Linear):
    """Output projection split by vocabulary; logits are gathered so every rank has ``[S', vocab]``."""

    def __init__(self, dim: int, vocab_size: int):
        self.start, self.end = vocab_range(vocab_size)
        super().__init__(dim, self.end - self.start, bias=False)

    def shard_source(self, param_name: str, part) -> tuple[int, int, int]:
        return 0, self.start, self.end - self.start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [S', dim]`` → logits ``[S', vocab]``."""
        return all_gather_last(super().forward(x))


class RowParallelLinear(nn.Linear):
    """``y = x W^T + b`` with ``W``'s input columns split across ranks: each rank multiplies its slice
    of ``x``'s features, one all-reduce sums the partial products, the bias is added once after."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        rank, size = world()
        local = divide(in_features, size, "the row-parallel input features")
        super().__init__(local, out_features, bias=bias)
        self.start = rank * local

    def shard_source(self, param_name: str, part) -> tuple[int, int, int] | None:
        """The weight's input columns of this rank; the bias whole."""
        return None if param_name == "bias" else (1, self.start, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if world()[1] == 1:
            return super().forward(x)
        out = all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias
