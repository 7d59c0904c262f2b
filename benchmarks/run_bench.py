"""The paper's benchmark (DeepSpeed-FastGen, Holmes et al. 2024, performance evaluation), on this machine.

Closed-loop clients replay the paper's workload (normal prompt/output lengths, std 0.3 x mean)
against fuseserve with each scheduling policy (splitfuse, prefill_first, whole_prompt: same engine,
same requests) and against peers (``transformers`` continuous batching; naive ``generate``), all
greedy with EOS ignored. Writes JSON lines and PNG plots to ``benchmarks/results/``.

    python -m benchmarks.run_bench --quick      # a few minutes on 2 CPU cores
    python -m benchmarks.run_bench --full       # clients 1..32, the paper's two shapes (scaled): hours on CPU
    python -m benchmarks.run_bench --url http://127.0.0.1:8000/v1 --clients 1,4,16   # a running server

Service level scaling (printed and stored in every record): the paper's thresholds (TTFT <= prompt
/ 512 s; EMA token rate >= 2/4/6 tok/s) are for Llama-2 7B on an A100. Unless ``--sla-factor`` is
given, two factors are measured here on the loaded engine:
  token factor  = latency of a 1-token pass here / modelled A100 Llama-2-7B 1-token pass (weights-bound,
                  `benchmarks.simulate` preset, ~9 ms); divides the token-rate thresholds;
  prompt factor = modelled A100 prefill throughput at the token budget / prefill throughput measured
                  here at the token budget; divides the 512 prompt tokens/s.

Latency targets (``--target-itl 0.25 --target-prefill-rate 512``, the paper's scale) add a
``splitfuse+slo`` system: SplitFuse with each pass sized from the targets, scaled like the SLA
(ITL x token factor, prefill rate / prompt factor). Its records carry the mean and max budget chosen
per pass (``mean_chosen_budget``, ``max_chosen_budget``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.metrics import (
    PAPER_EMA_SPAN,
    PAPER_PROMPT_RATE,
    PAPER_TOKEN_RATES,
    SLA,
    measure_gemm_flops,
    mfu,
    model_flops_per_token,
    scale_sla,
    summarize,
    write_jsonl,
)
from benchmarks.plots import plot_effective_throughput, plot_throughput_latency, plot_token_latency
from benchmarks.workload import BenchRequest, SendFn, closed_loop, make_requests, send_from_blocking

RESULTS = Path(__file__).parent / "results"
POLICIES = ("splitfuse", "prefill_first", "whole_prompt")
SLO_SYSTEM = "splitfuse+slo"  # SplitFuse with passes sized from --target-itl / --target-prefill-rate
PEERS = ("transformers-cb", "transformers-generate")

MODES: dict[str, dict[str, Any]] = {
    # prompt:output 8:1 (between the paper's 43:1 and 9:1), small enough for a few minutes on 2 cores
    "quick": {"clients": [1, 4, 16], "workloads": [(256, 32)], "requests_per_client": 2, "min_requests": 4,
              "systems": [*POLICIES, "transformers-cb"]},
    # the paper's two shapes (2600/60 and 1200/128) divided by 4
    "full": {"clients": [1, 2, 4, 8, 16, 32], "workloads": [(650, 15), (300, 32)], "requests_per_client": 4,
             "min_requests": 8, "systems": [*POLICIES, *PEERS]},
}  # fmt: skip


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def with_progress(send: SendFn, total: int, every_s: float = 15.0) -> SendFn:
    """Wrap ``send`` to print a progress line (requests done / total) at most every ``every_s`` seconds."""
    state = {"done": 0, "t0": time.perf_counter(), "last": time.perf_counter()}

    async def wrapped(request: BenchRequest) -> AsyncIterator[tuple[float, int]]:
        async for item in send(request):
            yield item
        state["done"] += 1
        now = time.perf_counter()
        if now - state["last"] >= every_s or state["done"] == total:
            state["last"] = now
            log(f"    {state['done']}/{total} requests done ({now - state['t0']:.0f} s)")

    return wrapped


def measure_sla(pipe, token_budget: int) -> tuple[SLA, dict[str, float]]:
    """Measured SLA scaling (see module docstring): the token and prompt factors on this machine."""
    from benchmarks.simulate import PRESETS
    from fuseserve.worker.profiler import measure_curve

    a100 = PRESETS["a100-llama2-7b"]
    curve = measure_curve(pipe.runner, sizes=(1, token_budget), repeats=3)
    token_factor = curve[1] / a100.latency(1)
    here_prefill = token_budget / curve[token_budget]
    a100_prefill = token_budget / a100.latency(token_budget)
    prompt_factor = a100_prefill / here_prefill
    sla = SLA(PAPER_PROMPT_RATE / prompt_factor, tuple(r / token_factor for r in PAPER_TOKEN_RATES),
              PAPER_EMA_SPAN, token_factor)  # fmt: skip
    info = {"token_factor": token_factor, "prompt_factor": prompt_factor, "one_token_pass_s": curve[1],
            "budget_pass_s": curve[token_budget], "a100_one_token_pass_s": a100.latency(1),
            "a100_prefill_tok_s": a100_prefill, "here_prefill_tok_s": here_prefill}  # fmt: skip
    return sla, info


def run_cell(requests: Sequence[BenchRequest], send: SendFn, clients: int, sla: SLA) -> dict[str, Any]:
    """One closed-loop run; `summarize` record plus load average before/after (machine noise)."""
    load0 = os.getloadavg()[0]
    res = asyncio.run(closed_loop(requests, with_progress(send, len(requests)), clients))
    rec = summarize(res.traces, res.wall_seconds, sla)
    rec["loadavg_1m"] = [load0, os.getloadavg()[0]]
    return rec


def warm_up(send: SendFn, requests: Sequence[BenchRequest]) -> None:
    """One short request (first 32 prompt tokens, 4 new tokens) so lazy initialisation is not timed."""
    r = requests[0]
    short = BenchRequest(r.prompt_token_ids[:32], "", 4)
    asyncio.run(closed_loop([short], send, 1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="clients 1,4,16; prompt/output 256/32 (default)")
    mode.add_argument("--full", action="store_true", help="clients 1..32; the paper's shapes / 4")
    ap.add_argument("--url", help="drive an OpenAI-compatible server instead (e.g. http://127.0.0.1:8000/v1)")
    ap.add_argument("--served-model", default="smollm2-135m-instruct", help="model name sent to --url")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--clients", help="comma-separated client counts (overrides the mode)")
    ap.add_argument("--workload", help="PROMPT/OUTPUT means in tokens, e.g. 512/64 (overrides the mode)")
    ap.add_argument("--systems", help=f"comma-separated subset of {','.join((*POLICIES, *PEERS))}")
    ap.add_argument("--requests-per-client", type=int)
    ap.add_argument("--token-budget", type=int, default=None, help="default: profiled knee (cached)")
    ap.add_argument(
        "--target-itl",
        type=float,
        metavar="SECONDS",
        help=f"add {SLO_SYSTEM}: passes sized to keep this inter-token latency (paper scale, e.g. 0.25; "
        "scaled like the SLA)",
    )
    ap.add_argument(
        "--target-prefill-rate",
        type=float,
        metavar="TOKENS_PER_S",
        help=f"add {SLO_SYSTEM}: TTFT target = prompt / this rate (paper scale, e.g. 512; scaled like the SLA)",
    )
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument(
        "--sla-factor", type=float, help="divide all paper thresholds by this (default: measured)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out",
        default=None,
        help="results file stem; a bare name goes under benchmarks/results/ (default: <mode>)",
    )
    args = ap.parse_args(argv)

    name = "full" if args.full else "quick"
    cfg = dict(MODES[name])
    if args.clients:
        cfg["clients"] = [int(c) for c in args.clients.split(",")]
    if args.workload:
        p, o = args.workload.split("/")
        cfg["workloads"] = [(int(p), int(o))]
    if args.systems:
        cfg["systems"] = args.systems.split(",")
    targeted = args.target_itl is not None or args.target_prefill_rate is not None
    if targeted and SLO_SYSTEM not in cfg["systems"]:
        cfg["systems"] = [*cfg["systems"], SLO_SYSTEM]
    if args.requests_per_client:
        cfg["requests_per_client"] = args.requests_per_client
    if args.url:
        cfg["systems"] = ["openai"]
        name = "url"
    stem = (
        (RESULTS / args.out if Path(args.out).parent == Path(".") else Path(args.out))
        if args.out
        else RESULTS / name
    )
    jsonl = stem.with_suffix(".jsonl")
    jsonl.unlink(missing_ok=True)

    import torch

    import fuseserve
    from fuseserve.model_source import resolve_model

    t_start = time.perf_counter()
    source = resolve_model(args.model, progress=False)
    tokenizer = source.load_tokenizer()
    log(f"measuring fp32 GEMM FLOP/s (best of 6 x 0.5 s, {torch.get_num_threads()} threads) ...")
    gemm_samples = [measure_gemm_flops(0.5) for _ in range(6)]
    peak = max(gemm_samples)  # the best sample: an average under other load understates the peak
    flops_per_token = model_flops_per_token(source.config)
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
               "torch": torch.__version__, "python": sys.version.split()[0], "gemm_flops": peak,
               "gemm_flops_samples": gemm_samples}  # fmt: skip
    log(f"GEMM peak {peak / 1e9:.1f} GFLOP/s; model {flops_per_token / 1e9:.3f} GFLOP/token (matmuls); "
        f"load avg {os.getloadavg()[0]:.2f}")  # fmt: skip

    workloads = {wl: {} for wl in cfg["workloads"]}  # (prompt, output) -> {clients: requests}
    for wl in workloads:
        for n in cfg["clients"]:
            num = max(cfg["min_requests"], cfg["requests_per_client"] * n)
            workloads[wl][n] = make_requests(tokenizer, num, wl[0], wl[1], seed=args.seed + n)

    records: list[dict[str, Any]] = []
    sla: SLA | None = scale_sla(factor=args.sla_factor) if args.sla_factor else None
    sla_info: dict[str, float] = {"factor": args.sla_factor} if args.sla_factor else {}
    budget = args.token_budget

    def sweep(
        system: str, policy: str | None, send: SendFn, extra: dict[str, Any], budgets: list[int] | None = None
    ) -> None:
        for wl, by_clients in workloads.items():
            warm_up(send, by_clients[cfg["clients"][0]])
            for n, reqs in by_clients.items():
                label = system + (f"/{policy}" if policy else "")
                log(f"  {label}: {n} clients, {len(reqs)} requests, prompt/output means {wl[0]}/{wl[1]}")
                if budgets is not None:
                    budgets.clear()
                rec = run_cell(reqs, send, n, sla)
                if budgets:
                    rec |= {
                        "mean_chosen_budget": sum(budgets) / len(budgets),
                        "max_chosen_budget": max(budgets),
                    }
                rec |= {"system": system, "policy": policy, "clients": n, "workload": f"{wl[0]}/{wl[1]}",
                        "token_budget": budget, "flops_per_token": flops_per_token,
                        "mfu": mfu(rec["total_tokens_per_s"], flops_per_token, peak), "machine": machine,
                        "sla_scaling": sla_info, "time": datetime.now(UTC).isoformat(timespec="seconds"),
                        "mode": name} | extra  # fmt: skip
                log(f"    {rec['total_tokens_per_s']:.1f} tok/s total, {rec['generated_tokens_per_s']:.1f} "
                    f"generated tok/s, P95 token latency {rec['token_latency_p95_s']:.3f} s, "
                    f"mean TTFT {rec['mean_ttft_s']:.2f} s, MFU {rec['mfu']:.1%}")  # fmt: skip
                records.append(rec)
                write_jsonl(jsonl, rec)

    if args.url:
        from benchmarks.peers import openai_send

        if sla is None:
            sla, sla_info = scale_sla(factor=16.0), {"factor": 16.0, "note": "default for --url"}
        sweep("openai@" + args.url, None, openai_send(args.url, args.served_model), {})
    for policy in [s for s in cfg["systems"] if s in (*POLICIES, SLO_SYSTEM)]:
        targets: dict[str, float | None] = {}
        if policy == SLO_SYSTEM:
            if sla is None:  # the SLA (and so the targets) are scaled on a loaded engine: load one
                probe = fuseserve.pipeline(args.model, token_budget=budget, kv_cache_memory=args.kv_cache_memory,
                                           progress=False)  # fmt: skip
                budget = probe.token_budget
                sla, sla_info = measure_sla(probe, budget)
                probe.close()
            targets = scaled_targets(args.target_itl, args.target_prefill_rate, sla_info)
            log(f"{SLO_SYSTEM}: targets scaled like the SLA: {targets}")
        log(f"fuseserve policy={policy}: loading the pipeline")
        pipe = fuseserve.pipeline(args.model, token_budget=budget, kv_cache_memory=args.kv_cache_memory,
                                  policy=policy.split("+")[0], progress=False, **targets)  # fmt: skip
        budget = pipe.token_budget
        budgets: list[int] = []
        pipe.scheduler.pass_observers.append(lambda _w, b, _n, into=budgets: into.append(b))
        if sla is None:
            sla, sla_info = measure_sla(pipe, budget)
            log(f"token budget {budget}; SLA scaled: token factor {sla_info['token_factor']:.1f} "
                f"(1-token pass {sla_info['one_token_pass_s'] * 1e3:.0f} ms here vs "
                f"{sla_info['a100_one_token_pass_s'] * 1e3:.1f} ms A100), prompt factor "
                f"{sla_info['prompt_factor']:.1f} (prefill {sla_info['here_prefill_tok_s']:.0f} vs "
                f"{sla_info['a100_prefill_tok_s']:.0f} tok/s) -> TTFT <= prompt/{sla.prompt_rate:.1f} s, "
                f"token rates {', '.join(f'{r:.2f}' for r in sla.token_rates)} tok/s")  # fmt: skip
        from benchmarks.token_stream import stream_tokens

        send = send_from_blocking(lambda r, p=pipe: stream_tokens(p, r.prompt_token_ids, r.max_new_tokens))
        try:
            sweep("fuseserve", policy, send, {"targets": targets} if targets else {}, budgets)
        finally:
            pipe.close()
    peers = [s for s in cfg["systems"] if s in PEERS]
    if peers:
        from benchmarks.peers import HFContinuousBatching, HFGenerate, load_hf_model

        if sla is None:
            sla, sla_info = scale_sla(factor=16.0), {"factor": 16.0, "note": "no fuseserve run to measure"}
        budget = budget or 256
        model = load_hf_model(source.path)
        kv_tokens = _kv_tokens(args.kv_cache_memory, source.config)
        for peer_name in peers:
            log(f"peer {peer_name}: starting")
            if peer_name == "transformers-cb":
                peer = HFContinuousBatching(
                    model, max_batch_tokens=budget, num_blocks=max(8, kv_tokens // 256)
                )
            else:
                peer = HFGenerate(model)
            try:
                sweep(peer_name, None, peer.send(), {})
            finally:
                peer.close()

    report(records)
    if records:
        plot_throughput_latency(records, stem.parent / f"{stem.name}_throughput_latency.png",
                                throughput_key="total_tokens_per_s")  # fmt: skip
        plot_effective_throughput(records, stem.parent / f"{stem.name}_effective_throughput.png")
        plot_token_latency(records, stem.parent / f"{stem.name}_token_latency.png")
        log(f"wrote {jsonl} and {stem.name}_*.png in {(time.perf_counter() - t_start) / 60:.1f} min")
    return 0


def scaled_targets(itl: float | None, prefill_rate: float | None, sla_info: dict[str, float]) -> dict:
    """Paper-scale targets scaled like the SLA: ITL x token factor, prefill rate / prompt factor (or
    both by ``factor`` when the SLA factor was given)."""
    token_factor = sla_info.get("token_factor", sla_info.get("factor", 1.0))
    prompt_factor = sla_info.get("prompt_factor", sla_info.get("factor", 1.0))
    return {
        "target_itl": None if itl is None else itl * token_factor,
        "target_prefill_rate": None if prefill_rate is None else prefill_rate / prompt_factor,
    }


def _kv_tokens(memory: str, config: Any) -> int:
    """Tokens of fp32 KV cache that ``memory`` holds for this model (to size the peer's cache alike)."""
    from fuseserve.device import parse_memory

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * 4
    return parse_memory(memory) // per_token


def _ratio(a: float | None, b: float | None) -> float:
    return float("nan") if not a or not b else a / b


def report(records: list[dict[str, Any]]) -> None:
    """Print the table and the ratios the issue asks for."""
    if not records:
        return
    rates = list(records[0]["effective_requests_per_s"])
    mid = rates[len(rates) // 2]
    print()
    print(f"{'workload':>9} {'clients':>7} {'system':>30} {'tok/s':>7} {'gen/s':>6} {'req/s':>6} "
          f"{'eff@' + format(float(mid), '.2f'):>9} {'TTFT s':>7} {'P50 tok':>8} {'P95 tok':>8} {'MFU':>6}")  # fmt: skip
    for r in records:
        label = r["system"] + (f"/{r['policy']}" if r.get("policy") else "")
        print(f"{r['workload']:>9} {r['clients']:>7} {label:>30} {r['total_tokens_per_s']:>7.1f} "
              f"{r['generated_tokens_per_s']:>6.1f} {r['requests_per_s']:>6.3f} "
              f"{r['effective_requests_per_s'][mid]:>9.3f} {r['mean_ttft_s']:>7.2f} "
              f"{r['token_latency_p50_s']:>8.3f} {r['token_latency_p95_s']:>8.3f} {r['mfu']:>6.1%}")  # fmt: skip
    sla = records[0]["sla"]
    print(f"\nSLA: TTFT <= prompt / {sla['prompt_rate']:.2f} s; EMA(span {sla['ema_span']}) token rate >= "
          f"{', '.join(f'{x:.3g}' for x in sla['token_rates'])} tok/s (eff@ uses {float(mid):.3g} tok/s); "
          f"scaling {records[0]['sla_scaling']}")  # fmt: skip
    by = {(r["workload"], r["clients"], r["system"], r.get("policy")): r for r in records}
    print("\nRatios (same requests, same machine):")
    for wl, n, system, policy in by:
        if system != "fuseserve" or policy not in ("splitfuse", SLO_SYSTEM):
            continue
        sf = by[(wl, n, system, policy)]
        pf = by.get((wl, n, "fuseserve", "prefill_first"))
        cb = by.get((wl, n, "transformers-cb", None))
        parts = []
        if pf:
            parts.append(f"SplitFuse/prefill_first effective throughput x"
                         f"{_ratio(sf['effective_requests_per_s'][mid], pf['effective_requests_per_s'][mid]):.2f}, "
                         f"P95 token latency {_ratio(pf['token_latency_p95_s'], sf['token_latency_p95_s']):.2f}x lower")  # fmt: skip
        if cb:
            parts.append(f"fuseserve/transformers-CB tokens/s x"
                         f"{_ratio(sf['total_tokens_per_s'], cb['total_tokens_per_s']):.2f} (generated x"
                         f"{_ratio(sf['generated_tokens_per_s'], cb['generated_tokens_per_s']):.2f})")  # fmt: skip
        parts.append(f"MFU {sf['mfu']:.1%}")
        if "mean_chosen_budget" in sf:
            parts.append(
                f"budget per pass mean {sf['mean_chosen_budget']:.0f}, max {sf['max_chosen_budget']}"
            )
        print(f"  {wl} clients={n:>2} {policy}: " + "; ".join(parts))
    print("\nCaveat: wall-clock measurements on a shared machine; see loadavg_1m in each record.")


if __name__ == "__main__":
    raise SystemExit(main())
