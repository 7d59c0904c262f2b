"""Offline throughput: the fuseserve pipeline vs ``transformers`` continuous batching and vLLM, per dtype.

The same 48 requests (prompts ~ Normal(200, 0.3 x 200) tokens sliced from the repository's text,
32 generated tokens each, greedy, EOS ignored) go to both systems at once as one batch:
``fuseserve.pipeline(...)(prompts)`` and ``model.generate_batch(prompts)`` (paged SDPA,
``max_batch_tokens`` = ``--token-budget``, 256 when it is 0, the default, which leaves fuseserve its
own budget: the knee of its start-up profile). Each system x dtype runs in its own subprocess
(fresh memory, a wall-clock limit: transformers in bf16 has been seen to take over 10 minutes here),
one after the other in this one run. The matmul (GEMM) peak of each dtype is measured in this run too
(best of six 0.5-s samples of a 1024^3 matmul, before and after the systems), and MFU is
(prompt + generated tokens)/s x matmul FLOPs per token / that peak; ``mfu_vs_peak_after`` divides by
the best of four samples taken right after each system's timed run instead (on a shared machine the
load, and so the peak, moves from minute to minute).

``vllm``: vLLM's CPU build, ``LLM.generate`` on the same prompts (token ids) in its own venv
(``benchmarks/peers.py``, ``VllmPeer``; skipped with the reason when the venv is missing); the
generated ids of both sides are compared (``greedy_equal_vs_fuseserve``: the number of requests
whose greedy continuations are identical). ``--rounds N`` repeats the systems N times, alternating.

``python -m benchmarks.offline_peers [--dtypes float32,bfloat16] [--out results/offline_peers.json]``
``python -m benchmarks.offline_peers --systems fuseserve,vllm --dtypes float32 --requests 64 --output-len 64``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.metrics import model_flops_per_token

SYSTEMS = ("fuseserve", "transformers-cb")  # vllm: on request (--systems), from its own venv


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
            str(src.path),
            token_budget=a.token_budget or None,  # None: the pipeline's own (its profile's knee)
            kv_cache_memory="1GiB",
            dtype=dtype,
            progress=False,
            compile=a.compile,
        )
        kw = dict(max_new_tokens=a.output_len, temperature=0.0, ignore_eos=True)
        pipe(warm, **kw)
        t0 = time.perf_counter()
        outs = pipe(prompts, **kw)
        elapsed = time.perf_counter() - t0
        generated = sum(len(o.token_ids) for o in outs)
        extra = {"attention_backend": pipe.runner.backend.name, "token_budget": pipe.token_budget}
        extra["compile_s"] = getattr(pipe.runner, "compile_s", None)
        extra["token_ids"] = [list(o.token_ids) for o in outs]
        pipe.close()
    else:
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        model = AutoModelForCausalLM.from_pretrained(
            str(src.path), dtype=getattr(torch, dtype), attn_implementation="sdpa"
        ).eval()
        gen = GenerationConfig(do_sample=False, max_new_tokens=a.output_len, eos_token_id=-1, pad_token_id=0)
        cb = ContinuousBatchingConfig(page_size=256, num_blocks=64, max_batch_tokens=a.token_budget or 256)
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
    ap.add_argument(
        "--token-budget",
        type=int,
        default=0,
        help="fuseserve's token budget and transformers' max_batch_tokens (0: the pipeline's own, the "
        "knee of its start-up profile, and 256 for transformers)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit-s", type=int, default=900, help="wall-clock limit per system x dtype")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the systems, alternating")
    ap.add_argument("--compile", action="store_true", help="fuseserve with compile=True")
    ap.add_argument(
        "--vllm-budget", type=int, default=0, help="vLLM's max_num_batched_tokens (0: its default)"
    )
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "system:dtype", in a subprocess
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.one:
        system, dtype = a.one.split(":")
        print("RESULT " + json.dumps(run_one(system, dtype, a)), flush=True)
        return

    dtypes = a.dtypes.split(",")
    peaks = {d: [gemm_flops(getattr(torch, d)) for _ in range(6)] for d in dtypes}
    prompts, src = requests(a.model, a.requests, a.prompt_mean, a.seed)
    flops = model_flops_per_token(src.config)
    records = []
    for round_ in range(a.rounds):
        for dtype in dtypes:
            for system in a.systems.split(","):
                rec = run_system(system, dtype, a, prompts, src)
                rec["round"] = round_
                records.append(rec)
                print(json.dumps({k: v for k, v in rec.items() if k != "token_ids"}), flush=True)
    for d in dtypes:
        peaks[d] += [gemm_flops(getattr(torch, d)) for _ in range(6)]
    summary = {"gemm_peak_flops": {d: max(v) for d, v in peaks.items()}, "gemm_samples": peaks}
    summary["flops_per_token"] = flops
    summary["cpu_flags"] = cpu_flags()
    for rec in records:
        if "tokens_per_s" in rec:
            rec["mfu"] = rec["tokens_per_s"] * flops / summary["gemm_peak_flops"][rec["dtype"]]
            if "gemm_peak_after_flops" in rec:
                rec["mfu_vs_peak_after"] = rec["tokens_per_s"] * flops / rec["gemm_peak_after_flops"]
    compare_outputs(records)
    for d in dtypes:
        ours = [
            r["tokens_per_s"]
            for r in records
            if r["dtype"] == d and r["system"] == "fuseserve" and "tokens_per_s" in r
        ]
        for peer in [s for s in a.systems.split(",") if s != "fuseserve"]:
            theirs = [
                r["tokens_per_s"]
                for r in records
                if r["dtype"] == d and r["system"] == peer and "tokens_per_s" in r
            ]
            if ours and theirs:
                summary[f"speedup_{d}_vs_{peer}"] = [o / t for o, t in zip(ours, theirs, strict=False)]
    print(json.dumps(summary), flush=True)
    for rec in records:
        if "tokens_per_s" in rec:
            print(
                f"round {rec['round']} {rec['system']:>15} {rec['dtype']}: {rec['tokens_per_s']:.1f} tok/s "
                f"({rec['generated_tokens']} generated, {rec['elapsed_s']:.1f} s), MFU {rec['mfu']:.1%}, "
                f"load {rec.get('loadavg', '?')}, greedy equal {rec.get('greedy_equal_vs_fuseserve', '-')}"
            )
        else:
            print(
                f"round {rec['round']} {rec['system']:>15} {rec['dtype']}: {rec.get('skipped') or rec.get('error', '')[-300:]}"
            )
    if a.out:
        Path(a.out).write_text(json.dumps({"summary": summary, "records": records}, indent=1))


def cpu_flags() -> str:
    """The CPU's model name and the SIMD flags that matter here (avx2, avx512f, avx512_bf16, amx)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    model = next(
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?"
    )
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    simd = sorted({f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma")})
    return f"{model}; {' '.join(simd)}"


def compare_outputs(records: list[dict]) -> None:
    """Each peer record gets ``greedy_equal_vs_fuseserve``: requests whose generated ids equal
    fuseserve's (same round and dtype), as "n/N"."""
    for rec in records:
        if rec["system"] == "fuseserve" or "token_ids" not in rec:
            continue
        ours = next(
            (
                r
                for r in records
                if r["system"] == "fuseserve" and r["dtype"] == rec["dtype"] and "token_ids" in r
            ),
            None,
        )
        if ours:
            same = sum(x == y for x, y in zip(ours["token_ids"], rec["token_ids"], strict=True))
            rec["greedy_equal_vs_fuseserve"] = f"{same}/{len(rec['token_ids'])}"


def run_system(system: str, dtype: str, a: argparse.Namespace, prompts: list[list[int]], src) -> dict:
    """One system x dtype in a subprocess of its own (vLLM: its venv's interpreter); its record."""
    load = open("/proc/loadavg").read().split()[0]
    if system == "vllm":
        from benchmarks.peers import VllmPeer

        peer = VllmPeer()
        reason = peer.unavailable_reason()
        if reason:
            return {"system": system, "dtype": dtype, "skipped": reason}
        req_file = Path(tempfile.mkdtemp()) / "requests.json"
        req_file.write_text(
            json.dumps([{"prompt_token_ids": p, "max_new_tokens": a.output_len} for p in prompts])
        )
        cmd, env = peer.offline_cmd(req_file, peer.model_dir(src.path), dtype, a.vllm_budget), peer.env()
    else:
        cmd = [sys.executable, "-m", "benchmarks.offline_peers", "--one", f"{system}:{dtype}"]
        cmd += [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in ("model", "requests", "prompt_mean")]
        cmd += [f"--output-len={a.output_len}", f"--token-budget={a.token_budget}", f"--seed={a.seed}"]
        if a.compile:
            cmd.append("--compile")
        env = None
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.limit_s, env=env)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            rec = {"system": system, "dtype": dtype, "error": proc.stderr[-2000:]}
        else:
            rec = json.loads(lines[-1][len("RESULT ") :])
    except subprocess.TimeoutExpired:
        rec = {"system": system, "dtype": dtype, "error": f"did not finish within {a.limit_s} s"}
    rec["wall_with_load_s"] = time.perf_counter() - t0
    rec["loadavg"] = f"{load}-{open('/proc/loadavg').read().split()[0]}"
    return rec


if __name__ == "__main__":
    main()
