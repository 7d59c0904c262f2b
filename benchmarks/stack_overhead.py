"""The server stack's cost over the in-process pipeline.

1. ``--part overhead``: with a tiny random LLaMA (the forward pass is negligible) and requests put
   straight into Redis: the time the worker sits idle between passes (the worker reports it with
   every result), p50 / p99, and the scheduler's CPU time per worker-step, p50 / p99.
2. ``--part throughput``: the same greedy requests through the in-process pipeline and through the
   local stack (gateway + scheduler + 1 worker, driven by the ``openai`` client with N concurrent
   clients); prints tokens/s of each, the ratio (target >= 0.95), and the stack worker's idle time
   between passes and the scheduler CPU per worker-step (from the scheduler's stats in Redis).

``python -m benchmarks.stack_overhead [--part overhead|throughput|both] [--no-overlap]``
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time


def tiny_llama(path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=0,
        architectures=["LlamaForCausalLM"],
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path, safe_serialization=True)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def overhead(num_requests: int, new_tokens: int, overlap: bool) -> None:
    import redis

    from fuseserve import messages
    from fuseserve.config import EngineConfig
    from fuseserve.redis_launcher import launch_redis
    from fuseserve.sampling_params import SamplingParams
    from fuseserve.scheduler.service.scheduler_service import SchedulerService

    with tempfile.TemporaryDirectory() as tmp, launch_redis() as rs:
        tiny_llama(tmp)
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fuseserve.cli",
                "worker",
                "--redis-url",
                rs.url,
                "--model",
                tmp,
                "--port",
                "0",
                "--token-budget",
                "64",
                "--threads",
                "1",
                "--kv-cache-memory",
                "64MiB",
                "--device",
                "cpu",
            ]
        )
        try:
            service = SchedulerService(rs.url, EngineConfig(token_budget=64, overlap=overlap))
            stop = threading.Event()
            t = threading.Thread(target=service.run, args=(stop,), daemon=True)
            t.start()
            r = redis.Redis.from_url(rs.url, decode_responses=True)
            while not service.core.workers:
                time.sleep(0.2)
            params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True).to_dict()
            for i in range(num_requests):
                msg = messages.RequestMessage(i, f"r{i}", "bench", list(range(1, 33)), params)
                r.xadd(messages.REQUESTS, msg.encode())
            done, last = 0, "0-0"
            while done < num_requests:
                for _, entries in r.xread({messages.responses_stream("bench"): last}, block=5000) or []:
                    for eid, fields in entries:
                        last = eid
                        done += sum(1 for e in messages.decode_events(fields) if e.finish_reason)
            stop.set()
            t.join(timeout=5)
            stats = service.core.stats
            idle50, idle99 = stats.idle_ms()
            cpu50, cpu99 = stats.cpu_per_step_ms()
            print(
                f"tiny model, {num_requests} requests x {new_tokens} tokens, overlap={overlap}, "
                f"{stats.num_worker_steps} worker-steps: worker idle between passes p50 {idle50:.2f} ms, "
                f"p99 {idle99:.2f} ms; scheduler CPU per worker-step p50 {cpu50:.3f} ms, p99 {cpu99:.3f} ms"
            )
        finally:
            worker.terminate()
            worker.wait()


def throughput(num_requests: int, new_tokens: int, clients: int, overlap: bool) -> None:
    import openai

    import fuseserve
    from fuseserve.cli import serve_args
    from fuseserve.launcher import start_stack
    from fuseserve.redis_launcher import free_port

    prompts = [f"Write a short note about the number {i}." for i in range(num_requests)]
    kw = dict(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    pipe = fuseserve.pipeline(
        "smollm2-135m-instruct", token_budget=256, kv_cache_memory="512MiB", progress=False
    )
    pipe(prompts[:2], max_new_tokens=2)  # warm-up
    t0 = time.perf_counter()
    outs = pipe(prompts, **kw)
    t_pipe = time.perf_counter() - t0
    tokens = sum(o.generated_tokens + o.prompt_tokens for o in outs)
    pipe.close()

    args = serve_args(
        workers=1, port=free_port(), token_budget=256, kv_cache_memory="512MiB", device="cpu", overlap=overlap
    )
    stack, base = start_stack(args)
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=600)
        client.completions.create(model=args.model, prompt="hi", max_tokens=2)  # warm-up

        def one(p):
            r = client.completions.create(
                model=args.model,
                prompt=p,
                max_tokens=new_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return r.usage.total_tokens

        from concurrent.futures import ThreadPoolExecutor

        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as ex:
            stack_tokens = sum(ex.map(one, prompts))
        t_stack = time.perf_counter() - t0
        time.sleep(1.5)  # the scheduler writes its stats once a second
        sched = scheduler_stats(stack.redis.url)
    finally:
        stack.stop()
    print(
        f"pipeline: {tokens / t_pipe:.1f} tok/s ({t_pipe:.1f} s); stack: {stack_tokens / t_stack:.1f} tok/s "
        f"({t_stack:.1f} s, {clients} clients, overlap={overlap}); "
        f"stack / pipeline = {(stack_tokens / t_stack) / (tokens / t_pipe):.2f}"
    )
    if sched:
        print(
            f"stack: worker idle between passes p50 {sched['worker_idle_ms']['p50']:.2f} ms, "
            f"p99 {sched['worker_idle_ms']['p99']:.2f} ms; scheduler CPU per worker-step "
            f"p50 {sched['cpu_ms_per_worker_step']['p50']:.3f} ms, "
            f"p99 {sched['cpu_ms_per_worker_step']['p99']:.3f} ms ({sched['worker_steps']} worker-steps)"
        )


def scheduler_stats(redis_url: str) -> dict | None:
    """The scheduler's own stats record (``fuseserve.messages.scheduler_stats_key``), if it wrote one."""
    import json

    import redis

    from fuseserve import messages

    r = redis.Redis.from_url(redis_url, decode_responses=True)
    for key in r.scan_iter(match=messages.SCHEDULER_STATS_PATTERN):
        stats = json.loads(r.get(key) or "null")
        if stats and "worker_idle_ms" in stats:
            return stats
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="both", choices=["overhead", "throughput", "both"])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--no-overlap", dest="overlap", action="store_false")
    a = ap.parse_args()
    if a.part in ("overhead", "both"):
        overhead(a.requests, a.new_tokens, a.overlap)
    if a.part in ("throughput", "both"):
        throughput(a.requests, a.new_tokens, a.clients, a.overlap)


if __name__ == "__main__":
    main()
