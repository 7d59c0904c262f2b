"""CUDA graphs of the forward pass, one per token-count bucket (``--cuda-graphs``, on by default on CUDA).

A SplitFuse pass holds at most ``token budget`` tokens, so a few buckets cover every pass, each captured
once at start and replayed instead of launching the forward's kernels one by one (an eager SmolLM2-
shaped pass costs ~30 ms of launches on an H200 whatever its size, ``benchmarks/README.md``):

- decode buckets (every chunk one token): 1, 2, 4, 8, then steps of 8 up to ``max_num_seqs``;
- mixed buckets (any chunks, prefill included): 16, 32, 64, ... tokens up to the token budget.

A pass of ``n`` tokens runs the smallest bucket holding it. The graphs read their inputs from static
buffers (token ids, positions, slot mapping and the Triton attention metadata, ``triton_attention.
static_plan``) that ``run`` refills before each replay. Rows past ``n`` are padding: slot -1 (no KV
write), in no query block (attention leaves them), their hidden states unread; sequence slots past
the pass's hold no tokens and context 0. Only the Triton backend's metadata is captured this way; a
model whose forward syncs with the host (MoE routing counts its tokens per expert) fails to capture
and runs eagerly (logged). The LM head and the sampler stay outside the graph.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from fuseserve.worker.attention import (
    ForwardContext,
    TritonAttentionBackend,
    current_context,
    forward_context,
)
from fuseserve.worker.kv_cache import KVCache
from fuseserve.worker.ragged_batch import RaggedBatch

if TYPE_CHECKING:
    from fuseserve.kernels.triton_attention import TritonAttentionPlan

log = logging.getLogger(__name__)

Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]
"""``capture(fn)`` → ``replay``: records ``fn`` (which reads the static buffers) so that ``replay()``
runs it again on the buffers' current contents and returns its output ``[T, hidden]``."""


@dataclass(frozen=True)
class Bucket:
    """One captured pass shape: ``tokens`` rows, ``seqs`` sequence slots (one more, always empty, is
    where padding query blocks point), ``query_blocks`` attention programs per KV head, and whether
    every chunk is one token (``decode``: tiled for decodes)."""

    tokens: int
    seqs: int
    query_blocks: int
    decode: bool


def decode_sizes(max_seqs: int) -> list[int]:
    """Decode buckets: 1, 2, 4, 8, then every multiple of 8 up to ``max_seqs`` (and ``max_seqs``)."""
    sizes = [n for n in (1, 2, 4) if n < max_seqs] + list(range(8, max_seqs, 8))
    return sorted(set(sizes + [max_seqs]))


def mixed_sizes(max_tokens: int) -> list[int]:
    """Mixed buckets: 16, 32, 64, ... below ``max_tokens``, and ``max_tokens``."""
    sizes, n = [], 16
    while n < max_tokens:
        sizes.append(n)
        n *= 2
    return sizes + [max_tokens]


def cuda_capture(device: torch.device) -> Capture:
    """The CUDA capture: one eager run first (Triton compiles its kernels, the allocator settles), then
    ``torch.cuda.graph`` into one memory pool shared by every bucket (captured largest first)."""
    pool = torch.cuda.graph_pool_handle()

    def capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        fn()
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


class CudaGraphs:
    """The forward ``forward(input_ids [T], positions [T]) → hidden [T, hidden]`` captured per bucket.

    ``shape``: the model's (query heads, head dim). ``max_tokens``: the largest pass (the token budget);
    ``max_seqs``: sequences per pass; ``max_context``: the longest sequence (tokens), which sizes the
    static block table. ``capture`` defaults to ``cuda_capture`` (tests pass one that runs ``fn``
    again). Raises what capturing raises (``build_cuda_graphs`` logs it and runs eagerly).
    """

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        backend: TritonAttentionBackend,
        kv_cache: KVCache,
        shape: tuple[int, int],
        max_tokens: int,
        max_seqs: int,
        max_context: int,
        capture: Capture | None = None,
        progress: bool = False,
    ):
        from fuseserve.kernels import triton_attention  # imports Triton: CPU-only installs may lack it

        self._kernels = triton_attention
        num_heads, head_dim = shape
        dev = kv_cache.k[0].device
        max_seqs = min(max_seqs, max_tokens)
        kv_heads, page = kv_cache.k[0].shape[2], kv_cache.k[0].shape[1]
        self._kv_heads = kv_heads
        self.tiling = {
            decode: triton_attention.choose_tiling(num_heads, head_dim, kv_heads, page, 1 if decode else 2)
            for decode in (True, False)
        }
        self.buckets = [Bucket(n, n, n, True) for n in decode_sizes(max_seqs)] + [
            self._mixed(n, max_seqs) for n in mixed_sizes(max_tokens)
        ]
        tokens = max(b.tokens for b in self.buckets)
        seqs = max(b.seqs for b in self.buckets) + 1
        blocks = max(b.query_blocks for b in self.buckets)
        i32 = dict(dtype=torch.int32, device=dev)
        self.input_ids = torch.zeros(tokens, dtype=torch.long, device=dev)
        self.positions = torch.zeros(tokens, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.long, device=dev)
        self.cu_seqlens_q = torch.zeros(seqs + 1, **i32)
        self.context_lens = torch.zeros(seqs, **i32)
        self.block_tables = torch.zeros(seqs, -(-max_context // kv_cache.block_size), **i32)
        self.query_blocks = torch.zeros(2, blocks, **i32)  # (qb_seq, qb_start)
        t0 = time.perf_counter()
        self._replay = self._capture_all(
            forward, backend, kv_cache, max_context, capture or cuda_capture(dev), progress
        )
        self.capture_s = time.perf_counter() - t0
        log.info(
            "CUDA graphs: %d buckets (decode up to %d sequences, passes up to %d tokens) in %.1f s",
            len(self.buckets),
            max_seqs,
            max_tokens,
            self.capture_s,
        )

    def _capture_all(self, forward, backend, kv_cache, max_context, capture, progress):
        """Every bucket's replay, largest first (one memory pool: the smaller ones reuse its blocks)."""
        replay: dict[Bucket, Callable[[], torch.Tensor]] = {}
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(self.buckets), desc="capturing CUDA graphs", unit="graph")
        for b in sorted(self.buckets, key=lambda b: -b.tokens):
            plan = self._plan(b, kv_cache.block_size, max_context)
            self._pad(b, [])

            def fn(b=b, plan=plan) -> torch.Tensor:  # a fresh context: its memo (rotary cos/sin) captured too
                with torch.inference_mode(), forward_context(ForwardContext(backend, plan, kv_cache)):
                    return forward(self.input_ids[: b.tokens], self.positions[: b.tokens])

            replay[b] = capture(fn)
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return replay

    def _mixed(self, tokens: int, max_seqs: int) -> Bucket:
        """A mixed bucket of ``tokens`` rows: ``S = min(tokens, max_seqs)`` sequences cut into at most
        ``S + ceil(tokens / block_q)`` query blocks (chunk i of q_i tokens: ceil(q_i / block_q) ≤
        (q_i - 1) / block_q + 1), and never more than one per token."""
        seqs = min(tokens, max_seqs)
        block_q = self.tiling[False].block_q
        return Bucket(tokens, seqs, min(tokens, seqs + -(-tokens // block_q)), False)

    def _plan(self, b: Bucket, block_size: int, max_context: int) -> TritonAttentionPlan:
        """Bucket ``b``'s attention plan over the static buffers, split-KV parts fixed for its grid and
        the longest context."""
        tiling = self.tiling[b.decode]
        splits = self._kernels.choose_num_splits(
            b.query_blocks * self._kv_heads, max_context, tiling.block_n, self.input_ids.device
        )
        return self._kernels.static_plan(
            self.slot_mapping[: b.tokens],
            self.cu_seqlens_q[: b.seqs + 2],
            self.context_lens[: b.seqs + 1],
            self.block_tables[: b.seqs + 1],
            self.query_blocks[0, : b.query_blocks],
            self.query_blocks[1, : b.query_blocks],
            tiling,
            block_size,
            splits,
            1 if b.decode else 2,
        )

    def bucket_for(self, batch: RaggedBatch) -> Bucket | None:
        """The smallest bucket holding ``batch`` (a decode one when every chunk is one token); None
        when none does, or the pass has LoRA adapters (it then runs eagerly)."""
        if batch.lora is not None or batch.block_tables.shape[1] > self.block_tables.shape[1]:
            return None
        n, s = batch.num_tokens, len(batch.query_lens)
        decode = max(batch.query_lens, default=0) <= 1
        for b in self.buckets:  # decode buckets first, each kind smallest first
            if (decode or not b.decode) and b.tokens >= n and b.seqs >= s:
                return b
        return None

    def run(self, batch: RaggedBatch) -> torch.Tensor | None:
        """Hidden states ``[T, hidden]`` of ``batch`` by replaying its bucket's graph (a view of the
        graph's output: read it before the next ``run``); None when no bucket holds the batch."""
        b = self.bucket_for(batch)
        if b is None:
            return None
        n, s = batch.num_tokens, len(batch.query_lens)
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.cu_seqlens_q[: s + 1].copy_(batch.cu_seqlens_q)
        self.context_lens[:s].copy_(batch.seq_lens)
        self.block_tables[:s, : batch.block_tables.shape[1]].copy_(batch.block_tables)
        self._pad(b, batch.query_lens)
        return self._replay[b]()[:n]

    def _pad(self, b: Bucket, query_lens: list[int]) -> None:
        """Bucket ``b``'s buffers past a pass of chunks ``query_lens``: slots -1, sequence slots with no
        tokens and context 0, the pass's query blocks then padding ones on the empty slot ``b.seqs``."""
        n, s = sum(query_lens), len(query_lens)
        self.slot_mapping[n : b.tokens].fill_(-1)
        self.cu_seqlens_q[s + 1 : b.seqs + 2].fill_(n)
        self.context_lens[s : b.seqs + 1].fill_(0)
        qb_seq, qb_start = self._kernels.query_blocks(query_lens, self.tiling[b.decode].block_q)
        blocks = np.zeros((2, b.query_blocks), dtype=np.int32)
        blocks[0] = b.seqs
        blocks[0, : len(qb_seq)], blocks[1, : len(qb_start)] = qb_seq, qb_start
        self.query_blocks[:, : b.query_blocks].copy_(torch.from_numpy(blocks))


def build_cuda_graphs(runner, progress: bool) -> CudaGraphs | None:
    """``runner``'s graphs (of its compiled forward where it has one, else its model's) over its KV
    cache, captured for passes up to its token budget (512 tokens when it has none yet) and
    ``max_num_seqs`` sequences; None off CUDA, with ``cuda_graphs`` off, and where they do not apply
    (another attention backend than Triton, LoRA adapters, tensor parallelism) or capture fails
    (logged: the passes then run eagerly)."""
    from fuseserve.worker import parallel
    from fuseserve.worker.model_runner import DEFAULT_WARM_UP_TOKENS

    c = runner.config
    if runner.device.type != "cuda" or not c.cuda_graphs:
        return None
    why = None
    if not isinstance(runner.backend, TritonAttentionBackend):
        why = f"the {runner.backend.name} attention backend"
    elif runner.lora is not None:
        why = "LoRA adapters"
    elif parallel.world()[1] > 1:
        why = "tensor parallelism"
    if why is not None:
        log.info("CUDA graphs: off with %s; passes run eagerly", why)
        return None
    args = runner.model.args
    budget = min(c.token_budget or DEFAULT_WARM_UP_TOKENS, args.max_position_embeddings)

    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if runner.compiled is not None:
            return runner.compiled(input_ids, positions, current_context())
        return runner.model(input_ids, positions)

    try:
        return CudaGraphs(
            forward,
            runner.backend,
            runner.kv_cache,
            (args.num_heads, args.head_dim),
            budget,
            c.max_num_seqs,
            args.max_position_embeddings,
            progress=progress,
        )
    except Exception as e:  # noqa: BLE001 - a forward that cannot be captured runs eagerly, correctly
        log.warning("CUDA graph capture failed, passes run eagerly: %s", str(e).splitlines()[0][:300])
        return None
