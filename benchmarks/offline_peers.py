"""Offline throughput: the fuseserve pipeline vs ``transformers`` continuous batching, per dtype.

The same 48 requests (prompts ~ Normal(200, 0.3 x 200) tokens sliced from the repository's text,
32 generated tokens each, greedy, EOS ignored) go to both systems at once as one batch:
``fuseserve.pipeline(...)(prompts)`` and ``model.generate_batch(prompts)`` (paged SDPA,
``max_batch_tokens`` = fuseserve's token budget). Each system x dtype runs in its own subprocess
(fresh memory, a wall-clock limit: transformers in bf16 has been seen to take over 10 minutes here),
one after the other in this one run. The matmul (GEMM) peak of each dtype is measured in this run too
(best of six 0.5-s samples of a 1024^3 matmul, before and after the systems), and MFU is
(prompt + generated tokens)/s x matmul FLOPs per token / that peak; ``mfu_vs_peak_after`` divides by
the best of four samples taken right after each system's timed run instead (on a shared machine the
load, and so the peak, moves from minute to minute).

``python -m benchmarks.offline_peers [--dtypes float32,bfloat16] [--out results/offline_peers.json]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.metrics import model_flops_per_token

SYSTEMS = ("fuseserve", "transformers-cb")


def gemm_flops(dtype: torch.dtype, seconds: float = 0.5, n: int = 1024) -> float:
    """Achievable ``[n, n] @ [n, n]`` FLOP/s in ``dtype`` over ``seconds``."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.matmul(a, b, out=out)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.matmul(a, b, out=out)
        reps += 1
    return 2.0 * n**3 * reps / (time.perf_counter() - t0)


def requests(model: str, num: int, prompt_mean: int, seed: int) -> tuple[list[list[int]], object]:
    from benchmarks.workload import make_requests
    from fuseserve.model_source import resolve_model

    src = resolve_model(model)
    reqs = make_requests(src.load_tokenizer(), num, prompt_mean, 32, seed)
    return [r.prompt_token_ids for r in reqs], src


def run_one(system: str, dtype: str, a: argparse.Namespace) -> dict:
    """One system in one dtype on the shared requests; returns its timing record."""
    prompts, src = requests(a.model, a.requests, a.prompt_mean, a.seed)
    warm = [p[:16] for p in prompts[:2]]
    if system == "fuseserve":
        import fuseserve

        pipe = fuseserve.pipeline(
            str(src.path), token_budget=a.token_budget, kv_cache_memory="1GiB", dtype=dtype, progress=False
        )
        kw = dict(max_new_tokens=a.output_len, temperature=0.0, ignore_eos=True)
        pipe(warm, **kw)
        t0 = time.perf_counter()
        outs = pipe(prompts, **kw)
        elapsed = time.perf_counter() - t0
        generated = sum(len(o.token_ids) for o in outs)
        extra = {"attention_backend": pipe.runner.backend.name}
        pipe.close()
    else:
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        model = AutoModelForCausalLM.from_pretrained(
            str(src.path), dtype=getattr(torch, dtype), attn_implementation="sdpa"
        ).eval()
        gen = GenerationConfig(do_sample=False, max_new_tokens=a.output_len, eos_token_id=-1, pad_token_id=0)
        cb = ContinuousBatchingConfig(page_size=256, num_blocks=64, max_batch_tokens=a.token_budget)
        with torch.inference_mode():
            model.generate_batch(warm, generation_config=gen, continuous_batching_config=cb)
            t0 = time.perf_counter()
            outs = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
            elapsed = time.perf_counter() - t0
        generated = sum(len(o.generated_tokens) for o in outs.values())
        extra = {"attn_implementation": "sdpa (paged)"}
    prompt_tokens = sum(len(p) for p in prompts)
    # the GEMM peak again, right after the timed run in the same process (the load moves by minutes)
    extra["gemm_peak_after_flops"] = max(gemm_flops(getattr(torch, dtype)) for _ in range(4))
    return {
        "system": system,
        "dtype": dtype,
        "requests": len(prompts),
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "elapsed_s": elapsed,
        "tokens_per_s": (prompt_tokens + generated) / elapsed,
        "generated_per_s": generated / elapsed,
        "threads": torch.get_num_threads(),
        **extra,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--prompt-mean", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--token-budget", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit-s", type=int, default=900, help="wall-clock limit per system x dtype")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "system:dtype", in a subprocess
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.one:
        system, dtype = a.one.split(":")
        print("RESULT " + json.dumps(run_one(system, dtype, a)), flush=True)
        return

    dtypes = a.dtypes.split(",")
    peaks = {d: [gemm_flops(getattr(torch, d)) for _ in range(6)] for d in dtypes}
    _, src = requests(a.model, 1, a.prompt_mean, a.seed)
    flops = model_flops_per_token(src.config)
    records = []
    for dtype in dtypes:
        for system in a.systems.split(","):
            cmd = [sys.executable, "-m", "benchmarks.offline_peers", "--one", f"{system}:{dtype}"]
            cmd += [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in ("model", "requests", "prompt_mean")]
            cmd += [f"--output-len={a.output_len}", f"--token-budget={a.token_budget}", f"--seed={a.seed}"]
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.limit_s)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if not lines:
                    rec = {"system": system, "dtype": dtype, "error": proc.stderr[-2000:]}
                else:
                    rec = json.loads(lines[-1][len("RESULT ") :])
            except subprocess.TimeoutExpired:
                rec = {"system": system, "dtype": dtype, "error": f"did not finish within {a.limit_s} s"}
            rec["wall_with_load_s"] = time.perf_counter() - t0
            records.append(rec)
            print(json.dumps(rec), flush=True)
    for d in dtypes:
        peaks[d] += [gemm_flops(getattr(torch, d)) for _ in range(6)]
    summary = {"gemm_peak_flops": {d: max(v) for d, v in peaks.items()}, "gemm_samples": peaks}
    summary["flops_per_token"] = flops
    for rec in records:
        if "tokens_per_s" in rec:
            rec["mfu"] = rec["tokens_per_s"] * flops / summary["gemm_peak_flops"][rec["dtype"]]
            rec["mfu_vs_peak_after"] = rec["tokens_per_s"] * flops / rec["gemm_peak_after_flops"]
    for d in dtypes:
        ours = next((r for r in records if r["dtype"] == d and r["system"] == "fuseserve"), {})
        theirs = next((r for r in records if r["dtype"] == d and r["system"] == "transformers-cb"), {})
        if "tokens_per_s" in ours and "tokens_per_s" in theirs:
            summary[f"speedup_{d}"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
    print(json.dumps(summary), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"summary": summary, "records": records}, indent=1))


if __name__ == "__main__":
    main()
