"""Fit the ``cpu-smollm2`` latency preset to the real SmolLM2-135M runner on this machine.

Measures the real ``ModelRunner`` (fp32, CPU, ``--threads`` torch threads) on three kinds of pass
and fits the roofline of ``fuseserve.worker.latency_model.LatencyModel`` to them:

1. one prompt chunk of ``n`` tokens, no context, n = 1 .. 512;
2. one 128-token chunk after 0 / 512 / 1024 cached tokens;
3. a decode pass of 16 sequences at context 64 and 512.

The fastest pass of <= 4 tokens is the weights floor: ``bandwidth = weight_bytes / t``. The passes of
>= 16 tokens give, by least squares, ``t = overhead_s + b x tokens + c x attn_pairs + d x seqs``:
``flops_per_token / b`` is the achieved FLOP rate (stated as ``mfu`` of ``CPU_PEAK_FLOPS``),
``c`` the attention cost per (query, key) pair and ``d`` = ``seq_overhead_s``, the time per sequence
in a pass (the CPU path's reference attention runs per sequence). Weights, FLOPs per token and KV
bytes per token are counted from the loaded model, not fitted.

Each time is the best of ``--repeats`` runs (the machine is shared; best-of removes most noise).
``python -m benchmarks.fit_latency [--threads 1]`` prints the measurements against the fitted model
and the fitted preset (copied into ``services/worker/latency_model.py``), and saves both to
``results/fit_latency.json``; ``--refit FILE`` fits saved measurements again without measuring.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from fuseserve.config import EngineConfig
from fuseserve.model_source import resolve_model
from fuseserve.sampling_params import SamplingParams
from fuseserve.scheduler.block_accounting import BlockAccount, assign_block_ids
from fuseserve.types import SeqChunk, StepPlan
from fuseserve.worker.latency_model import CPU_PEAK_FLOPS, LatencyModel
from fuseserve.worker.model_runner import ModelRunner

PROMPT_SIZES = (1, 4, 16, 32, 64, 128, 256, 512)
CONTEXTS = (0, 512, 1024)


def timed(runner: ModelRunner, plan: StepPlan, repeats: int, setup=None) -> float:
    """Best wall seconds of ``runner.step(plan)`` over ``repeats`` runs; ``setup()`` runs before each."""
    best = float("inf")
    for _ in range(repeats):
        free_all(runner)
        if setup is not None:
            setup()
        assign_block_ids(_blocks(runner), plan)
        t0 = time.perf_counter()
        runner.step(plan)
        best = min(best, time.perf_counter() - t0)
    free_all(runner)
    return best


_ACCOUNTS: dict[int, BlockAccount] = {}


def _blocks(runner: ModelRunner) -> BlockAccount:
    """The block ids of plans sent straight to ``runner`` (the scheduler's allocator, no sharing)."""
    if id(runner) not in _ACCOUNTS:
        _ACCOUNTS[id(runner)] = BlockAccount(runner.info.num_blocks, runner.info.block_size, False)
    return _ACCOUNTS[id(runner)]


def step(runner: ModelRunner, plan: StepPlan) -> None:
    """Run ``plan`` on ``runner`` with block ids assigned."""
    assign_block_ids(_blocks(runner), plan)
    runner.step(plan)


def free_all(runner: ModelRunner) -> None:
    for sid in list(runner.seqs):
        _blocks(runner).release(sid)
    runner.free(list(runner.seqs))


def prefill(seq_id: int, start: int, n: int) -> SeqChunk:
    params = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    ids = [(seq_id * 7919 + i) % 40000 + 100 for i in range(start, start + n)]
    return SeqChunk(
        seq_id, start, n, ids, sample=True, params=params if start == 0 else None, prompt_len=start + n
    )


def measure(threads: int, repeats: int) -> dict:
    """Time the real runner; returns ``{"constants": {...}, "points": [...]}`` (seconds per pass)."""
    torch.set_num_threads(threads)
    src = resolve_model("smollm2-135m-instruct")
    config = EngineConfig(device="cpu", dtype="float32", kv_cache_memory="1GiB")
    runner = ModelRunner(src.path, src.config, src.eos_token_ids(), config)
    cfg = src.config
    layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    kv_heads, head_dim = cfg.num_key_value_heads, hidden // cfg.num_attention_heads
    # matmul FLOPs per token of the layers; the embedding is a lookup and the LM head runs on sampled rows
    layer_params = sum(
        p.numel() for p in runner.model.parameters() if p.dim() == 2 and cfg.vocab_size not in p.shape
    )
    constants = {
        "threads": threads,
        "repeats": repeats,
        "weight_bytes": sum(p.numel() * p.element_size() for p in runner.model.parameters()),
        "flops_per_token": 2.0 * layer_params,
        "kv_bytes_per_token": 2 * layers * kv_heads * head_dim * 4,
        "max_model_len": int(cfg.max_position_embeddings),
    }
    points = []

    def point(kind: str, plan: StepPlan, seconds: float) -> None:
        kv = sum(c.start_pos + c.num_tokens for c in plan.chunks)
        pairs = sum(c.num_tokens * (c.start_pos + (c.num_tokens + 1) / 2) for c in plan.chunks)
        points.append(
            {
                "kind": kind,
                "num_tokens": plan.num_tokens,
                "num_seqs": len(plan.chunks),
                "kv_tokens": kv,
                "attn_pairs": pairs,
                "seconds": seconds,
            }
        )
        print(f"  {kind}: {seconds * 1e3:8.1f} ms", flush=True)

    timed(runner, StepPlan(0, [prefill(0, 0, 64)]), 2)  # warm-up
    for n in PROMPT_SIZES:
        plan = StepPlan(0, [prefill(0, 0, n)])
        point(f"prompt n={n}", plan, timed(runner, plan, repeats))
    for c in CONTEXTS:

        def fill(c=c):
            if c:
                step(runner, StepPlan(0, [prefill(0, 0, c)]))

        plan = StepPlan(1, [prefill(0, c, 128)])
        point(f"chunk 128 @ ctx {c}", plan, timed(runner, plan, max(2, repeats // 2), setup=fill))
    for c in (64, 512):
        seqs = list(range(16))

        def fill_all(c=c, seqs=seqs):
            step(runner, StepPlan(0, [prefill(s, 0, c) for s in seqs]))

        plan = StepPlan(1, [SeqChunk(s, c, 1, [], sample=True) for s in seqs])
        point(f"decode 16 seqs @ ctx {c}", plan, timed(runner, plan, max(2, repeats // 2), setup=fill_all))
    return {"constants": constants, "points": points}


def fit(data: dict) -> LatencyModel:
    """The roofline through ``data``'s points (see the module docstring).

    Weights floor: ``bandwidth = weight_bytes / (fastest pass of <= 4 tokens)``. Compute side: least
    squares of ``t = overhead + b x tokens + c x attn_pairs + d x seqs`` over the passes of >= 16
    tokens, dropping any term whose coefficient comes out negative (noise) and refitting.
    """
    k, pts = data["constants"], data["points"]
    floor = min(p["seconds"] for p in pts if p["num_tokens"] <= 4)
    rows = [p for p in pts if p["num_tokens"] >= 16]
    names = ["overhead", "tokens", "attn_pairs", "seqs"]
    x = np.array([[1.0, p["num_tokens"], p["attn_pairs"], p["num_seqs"]] for p in rows])
    y = np.array([p["seconds"] for p in rows])
    keep = list(range(len(names)))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (coef >= 0).all():
            break
        keep.pop(int(np.argmin(coef)))
    c = dict.fromkeys(names, 0.0) | {names[i]: float(v) for i, v in zip(keep, coef, strict=True)}
    achieved = k["flops_per_token"] / c["tokens"]  # FLOP/s in compute-bound passes
    return LatencyModel(
        name=f"CPU {k['threads']} thread(s) / SmolLM2-135M fp32 (fitted)",
        weight_bytes=float(k["weight_bytes"]),
        bandwidth=float(k["weight_bytes"] / floor),
        flops_per_token=float(k["flops_per_token"]),
        attn_flops_per_pair=c["attn_pairs"] * achieved,
        kv_bytes_per_token=float(k["kv_bytes_per_token"]),
        peak_flops=CPU_PEAK_FLOPS,
        mfu=achieved / CPU_PEAK_FLOPS,
        overhead_s=c["overhead"],
        kv_capacity_tokens=int((1 << 30) // k["kv_bytes_per_token"]),  # the CPU worker's default 1 GiB
        max_model_len=k["max_model_len"],
        seq_overhead_s=c["seqs"],
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: a worker of serve --workers 2)"
    )
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results/fit_latency.json", help="measurements + fit")
    ap.add_argument("--refit", default=None, help="fit the measurements saved in this file, measure nothing")
    args = ap.parse_args(argv)
    data = json.loads(Path(args.refit).read_text()) if args.refit else measure(args.threads, args.repeats)
    model = fit(data)
    k = data["constants"]
    print(f"measured (best of {k['repeats']}, {k['threads']} thread(s)) vs the fitted model:")
    for p in data["points"]:
        m = model.pass_seconds(p["num_tokens"], p["kv_tokens"], p["attn_pairs"], p["num_seqs"])
        print(f"  {p['kind']:>24}: {p['seconds'] * 1e3:8.1f} ms   model {m * 1e3:8.1f} ms")
    data["fitted"] = asdict(model)
    print("fitted preset:", json.dumps(data["fitted"], indent=1))
    print("knee (90% of best throughput, <= 1024 tokens):", model.knee(max_tokens=1024))
    if not args.refit:
        Path(args.out).write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
