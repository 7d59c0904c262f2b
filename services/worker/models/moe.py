"""Sparse mixture-of-experts MLP shared by Mixtral and Qwen3-MoE (Shazeer et al. 2017; Jiang et al. 2024).

A router scores every token against every expert; each token goes to its ``top_k`` experts and the
expert outputs are summed, weighted by the router's softmax probabilities (renormalised over the
chosen ``top_k`` when ``norm_topk_prob``). The computation is grouped by expert: the (token, expert)
assignments are sorted by expert, each expert that received tokens runs one gated-MLP GEMM pair over
its contiguous slice, and the weighted outputs are scattered back with one ``index_add_``. Experts that
received no token cost nothing. Under tensor parallelism every rank routes alike (the router is
replicated) and holds a slice of every expert's intermediate features; one all-reduce sums them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from fuseserve.worker import parallel
from fuseserve.worker.model_args import ModelArgs


class Experts(nn.Module):
    """``num_experts`` gated MLPs stored as 3-D tensors (``transformers``' fused layout).

    gate_up_proj: ``[E, 2 * inter, hidden]`` (gate rows, then up rows); down_proj: ``[E, hidden, inter]``.
    Checkpoints store one tensor per expert and part (``experts.{e}.gate_proj.weight``, ...);
    ``checkpoint_parts`` tells the loader which fused tensor each part fills. A quantized checkpoint's
    experts become ``QuantizedExperts`` (``fuseserve.worker.quantization``): the same ``forward``, with
    ``gate_up`` and ``down`` running each expert's packed weights.
    """

    checkpoint_parts = {
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
        "down_proj": ("down_proj", "down"),
    }

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str):
        super().__init__()
        rank, size = parallel.world()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.inter = parallel.divide(intermediate_size, size, "the experts' intermediate size")
        self.source_start = rank * self.inter  # this rank's intermediate features in the checkpoint
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter))
        self.act = ACT2FN[act]

    def shard_index(self, param_name: str, shard: tuple[int, str]) -> tuple[int | slice, ...]:
        """Where checkpoint part ``shard = (expert, "gate" | "up" | "down")`` goes in ``param_name``."""
        expert, part = shard
        if part == "down":
            return (expert,)
        return (expert, slice(0, self.inter) if part == "gate" else slice(self.inter, 2 * self.inter))

    def shard_source(self, param_name: str, shard: tuple[int, str] | None) -> tuple[int, int, int] | None:
        """``(dim, start, length)`` of this rank's slice of a per-expert checkpoint tensor (None for an
        already fused 3-D one, which then fails the shape check: not split for tensor parallelism)."""
        if shard is None:
            return None
        return (1 if shard[1] == "down" else 0), self.source_start, self.inter

    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """``x [n, hidden]`` → ``[n, 2 * inter]``: expert ``expert``'s gate features, then its up ones."""
        return F.linear(x, self.gate_up_proj[expert])

    def down(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        """``h [n, inter]`` → ``[n, hidden]``: expert ``expert``'s down projection (this rank's part)."""
        return F.linear(h, self.down_proj[expert])

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]``, ``expert_ids [T, k]``, ``weights [T, k]`` → ``[T, hidden]``."""
        top_k = expert_ids.shape[1]
        order = expert_ids.flatten().argsort(stable=True)  # assignments grouped by expert
        token_of = order // top_k
        counts = torch.bincount(expert_ids.flatten(), minlength=self.num_experts).tolist()
        xs = x[token_of]
        out = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            gate, up = self.gate_up(e, xs[start : start + n]).chunk(2, dim=-1)
            out[start : start + n] = self.down(e, self.act(gate) * up)
            start += n
        out = out * weights.flatten()[order].unsqueeze(-1).to(out.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, out)


class SparseMoE(nn.Module):
    """Router (``gate``) + ``Experts``; ``args.num_experts_per_tok`` experts per token.

    ``float_modules``: the router stays float in quantized checkpoints (GPTQ, AWQ and llm-compressor
    leave it unquantized, as vLLM's Mixtral and Qwen3-MoE load it), whatever the scheme's targets say.
    """

    float_modules = ("gate",)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.experts = Experts(
            args.num_experts, args.hidden_size, args.moe_intermediate_size, args.hidden_act
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` → ``[T, hidden]``."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, expert_ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return parallel.all_reduce(self.experts(x, expert_ids, weights))
