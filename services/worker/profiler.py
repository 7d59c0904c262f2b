"""Choose the token budget by measuring forward latency against tokens per pass (SplitFuse rule 4).

Throughput ``n / latency(n)`` rises with the pass size and saturates (paper §3.1: concave). The
budget is the knee: the smallest measured size whose throughput reaches ``KNEE_FRACTION`` of the
best. Results are cached per model + device + dtype + torch version + thread count.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from fuseserve.sampling_params import SamplingParams
from fuseserve.types import SeqChunk, StepPlan
from fuseserve.worker.latency_model import PROFILE_SIZES

log = logging.getLogger(__name__)

KNEE_FRACTION = 0.95
"""0.9 chose 64 tokens for SmolLM2 fp32 here (prefill-only curve 529/631/696/657/677 tok/s at
32..512): served, 16 clients, that gave 340 tok/s against 392 at 128, the size 0.95 chooses (the
curve is measured without decodes; a pass also carries the decodes that ride on its weight reads)."""
PROFILE_VERSION = 6  # bump when the forward path changes enough to move the curve (invalidates caches)
_PROFILE_SEQ_ID = -1  # -1, -2, ...: never handed out to requests (sequence ids are >= 0)
PROFILE_PROMPT_TOKENS = 128
"""The longest prompt in a profiled pass (a pass of ``n`` tokens holds ``n / 128`` prompts)."""


def measure_curve(runner, sizes=PROFILE_SIZES, repeats: int = 2) -> dict[int, float]:
    """Seconds per forward pass of ``n`` prompt tokens, best of ``repeats``, for each size that fits
    the cache: fresh prompts of at most ``PROFILE_PROMPT_TOKENS`` tokens each, so every size does the
    same attention work per token and the curve shows what the pass size itself changes (one
    ``n``-token prompt adds attention quadratic in ``n``, which a long prompt pays at any budget once
    chunked: SmolLM2 bf16 here, 1024 tokens ran at 5232 tok/s as one prompt, 6713 as eight).
    Writes its scratch prompts over KV blocks ``0..``: run it before a scheduler hands out blocks (at
    start), or on a pipeline without prefix caching, whose cached blocks it would otherwise overwrite.
    Raises ``ValueError`` when the cache cannot hold the smallest size."""
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_new_tokens=1)
    capacity = runner.info.num_blocks * runner.block_size
    fits = [n for n in sizes if sum(_prompt_blocks(n, runner.block_size)) <= runner.info.num_blocks]
    if not fits:
        raise ValueError(f"the KV cache holds {capacity} tokens, too few to profile a {sizes[0]}-token pass")
    sizes = fits
    curve = {}
    for n in (sizes[0], *sizes):  # the first run warms up
        prompts = [torch.randint(0, runner.vocab_size, (m,), generator=g).tolist() for m in _prompt_lens(n)]
        best = float("inf")
        for _ in range(repeats):
            chunks, first = [], 0
            for i, (tokens, used) in enumerate(
                zip(prompts, _prompt_blocks(n, runner.block_size), strict=True)
            ):
                blocks = list(range(first, first + used))  # scratch sequences, alone in the cache
                first += used
                sid = _PROFILE_SEQ_ID - i
                chunks.append(
                    SeqChunk(
                        sid,
                        0,
                        len(tokens),
                        tokens,
                        sample=True,
                        params=params,
                        prompt_len=len(tokens),
                        block_ids=blocks,
                    )
                )
            t0 = time.perf_counter()
            runner.run_pass(StepPlan(-1, chunks))
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            best = min(best, time.perf_counter() - t0)
            runner.free([c.seq_id for c in chunks])
        curve[n] = best
    return curve


def _prompt_lens(n: int) -> list[int]:
    """The prompt lengths of a profiled ``n``-token pass."""
    return [min(PROFILE_PROMPT_TOKENS, n - i) for i in range(0, n, PROFILE_PROMPT_TOKENS)]


def _prompt_blocks(n: int, block_size: int) -> list[int]:
    """KV blocks each prompt of a profiled ``n``-token pass takes."""
    return [-(-m // block_size) for m in _prompt_lens(n)]


def knee(curve: dict[int, float], fraction: float = KNEE_FRACTION) -> int:
    """Smallest pass size whose throughput (tokens/s) is at least ``fraction`` of the best."""
    tput = {n: n / s for n, s in curve.items()}
    best = max(tput.values())
    return min(n for n, t in tput.items() if t >= fraction * best)


def choose_token_budget(runner, model_key: str, cache_dir: Path | None = None) -> int:
    """Profile (or read the cached profile) and return the knee; logs the curve and the choice."""
    curve = profile_curve(runner, model_key, cache_dir)
    budget = knee(curve)
    log.info(
        "forward throughput by pass size: %s → token budget %d",
        ", ".join(f"{n}: {n / s:.0f} tok/s" for n, s in sorted(curve.items())),
        budget,
    )
    return budget


def profile_curve(runner, model_key: str, cache_dir: Path | None = None) -> dict[int, float]:
    """The start-up profile ``{tokens: seconds}`` (``measure_curve``), measured once per model +
    device + dtype (+ KV cache dtype when it differs, + whether the layers run as the C++ stack) +
    torch version + thread count and cached under ``cache_dir``."""
    key = f"v{PROFILE_VERSION}|{model_key}|{runner.device}|{runner.dtype}|torch{torch.__version__}|threads{torch.get_num_threads()}"
    kv_dtype = getattr(runner, "kv_dtype", runner.dtype)
    if kv_dtype != runner.dtype:  # an fp8 KV cache: attention reads other bytes (own curve)
        key += f"|kv{kv_dtype}"
    if getattr(runner, "layer_stack", None) is not None:  # layers in one C++ call: small passes cheaper
        key += "|stack"
    cache_dir = Path(cache_dir or os.environ.get("FUSESERVE_CACHE", Path.home() / ".cache" / "fuseserve"))
    path = cache_dir / "token_budget.json"
    table = json.loads(path.read_text()) if path.exists() else {}
    if key in table:
        curve = {int(k): v for k, v in table[key].items()}
    else:
        log.info("profiling forward latency to choose the token budget (cached afterwards)")
        curve = measure_curve(runner)
        table[key] = curve
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(path)
    return curve
