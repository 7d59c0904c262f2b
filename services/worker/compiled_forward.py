"""The model's forward pass compiled with ``torch.compile`` (inductor), attention left as one operator.

Every SplitFuse pass holds at most ``token budget`` tokens, so one compiled graph over a token count
``T`` in ``[2, budget]`` covers every pass: the graph is compiled with ``T`` symbolic (``dynamic=True``)
and a 1-token pass is padded to 2 (dynamo specialises sizes 0 and 1). Inside the graph, inductor fuses
the element-wise work (RMSNorm, rotary, SwiGLU, residual adds) into C++ loops between the matmuls;
the paged attention stays the backend's own kernel, reached through the opaque operator
``fuseserve::attention`` (``attention.py``), which reads the KV cache and metadata from the pass's
``ForwardContext`` and leaves padding rows out.

Warm-up runs the compiled forward once per shape bucket (``warm_up_sizes``) at start, with a progress
bar, so no request waits for a compilation. Inductor's cache lives in
``~/.cache/fuseserve/inductor`` (``$TORCHINDUCTOR_CACHE_DIR`` overrides), so a restart compiles from
cache. Off by default: ``compile=True`` (``--compile``) turns it on.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from torch import nn

from fuseserve.worker.attention import AttentionBackend, ForwardContext, forward_context
from fuseserve.worker.kv_cache import KVCache
from fuseserve.worker.ragged_batch import RaggedBatch

log = logging.getLogger(__name__)

ENV_SWITCH = "FUSESERVE_COMPILE"
"""``FUSESERVE_COMPILE=0`` turns compilation off, ``=1`` on, for every runner of the process and its
children, whatever ``compile`` says (the test suite sets 0; tests of compilation set 1)."""

MIN_TOKENS = 2
"""Passes below this many tokens are padded to it (dynamo specialises sizes 0 and 1)."""

RECOMPILE_LIMIT = 64
"""Compiled entries dynamo keeps per forward code object, for all the runners of one process."""


def wanted(compile_option: bool) -> bool:
    """Whether to compile: ``$FUSESERVE_COMPILE`` when it is ``0`` or ``1``, else the ``compile`` option."""
    forced = os.environ.get(ENV_SWITCH)
    return forced == "1" if forced in ("0", "1") else compile_option


def cache_dir() -> Path:
    """Inductor's on-disk cache: ``$TORCHINDUCTOR_CACHE_DIR`` or ``~/.cache/fuseserve/inductor``."""
    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", Path.home() / ".cache" / "fuseserve" / "inductor"))


def warm_up_sizes(max_tokens: int) -> list[int]:
    """Token counts run once at start: the smallest pass, powers of two, and the budget."""
    sizes, n = [MIN_TOKENS], 8
    while n < max_tokens:
        sizes.append(n)
        n *= 4
    return sorted(set(sizes + [max(MIN_TOKENS, max_tokens)]))


os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir()))  # before inductor first reads it


class CompiledForward:
    """``model(input_ids [T], positions [T]) → hidden [T, hidden]``, compiled once for every ``T``.

    The caller opens the ``ForwardContext`` as for the eager model; ``__call__`` pads a 1-token pass
    and sets the context's ``num_tokens`` so attention skips the padding.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        # Dynamo keeps its compiled graphs per code object: every runner built in one process (a test
        # session, a pipeline per model) compiles the same family forward again, guarded on its own
        # parameters, and the default limit of 8 entries then sends the later ones back to eager.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self._compiled = torch.compile(model, dynamic=True, fullgraph=True)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        n = input_ids.shape[0]
        if n >= MIN_TOKENS:
            if not input_ids.is_inference():  # one kind of input, one guard: padding makes inference tensors
                input_ids, positions = input_ids.clone(), positions.clone()
            return self._compiled(input_ids, positions)
        pad = MIN_TOKENS - n
        ctx.num_tokens = n
        input_ids = torch.nn.functional.pad(input_ids, (0, pad))
        positions = torch.nn.functional.pad(positions, (0, pad))
        return self._compiled(input_ids, positions)[:n]

    def warm_up(
        self,
        backend: AttentionBackend,
        kv_cache: KVCache,
        block_size: int,
        max_tokens: int,
        progress: bool = True,
    ) -> float:
        """Compile (or load from cache) by running one pass per ``warm_up_sizes`` bucket; returns seconds.

        Each warm-up pass is one sequence of ``n`` tokens written into the first blocks of the cache,
        which hold nothing yet.
        """
        sizes = [n for n in warm_up_sizes(max_tokens) if n <= kv_cache.num_blocks * block_size]
        t0 = time.perf_counter()
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(sizes), desc="compiling passes", unit="shape")
        for n in sizes:
            batch = _warm_up_batch(n, block_size, kv_cache.k[0].device)
            ctx = ForwardContext(backend, backend.prepare(batch, block_size), kv_cache)
            with torch.inference_mode(), forward_context(ctx):
                self(batch.input_ids, batch.positions, ctx)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(tokens=n)
        if bar is not None:
            bar.close()
        elapsed = time.perf_counter() - t0
        log.info(
            "compiled forward: %d shapes up to %d tokens in %.1f s (cache %s)",
            len(sizes),
            max_tokens,
            elapsed,
            cache_dir(),
        )
        return elapsed


def _warm_up_batch(n: int, block_size: int, device: torch.device) -> RaggedBatch:
    """One sequence's first ``n`` tokens (id 0) in blocks ``0, 1, ...``."""
    num_blocks = -(-n // block_size)
    return RaggedBatch(
        input_ids=torch.zeros(n, dtype=torch.long, device=device),
        positions=torch.arange(n, device=device),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device).unsqueeze(0),
        slot_mapping=torch.arange(n, device=device),
        logits_indices=torch.tensor([n - 1], device=device),
        query_lens=[n],
        context_lens=[n],
    )
