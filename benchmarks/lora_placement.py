"""LoRA placement by residency against a residency-blind placement, side by side in one run.

Two local stacks (``fuseserve.serve``) on SmolLM2 in fp32, each with 2 CPU workers (1 thread), a small
budget and KV pool (``tests/stack_harness.py``'s ``recovery_stack``), 4 random PEFT adapters
(``tests/lora_checkpoints.py``, made as ``tests/stack/test_stack_lora.py`` makes them) and
``max_loras=2``: one with ``lora_aware_placement`` (the default), one with
``--no-lora-aware-placement``. Both are up at once; rounds alternate between them so the noise of a
shared machine falls on both alike. Each round: ``--clients`` closed-loop clients send
``--requests`` requests in all, request ``i`` naming adapter ``i % 4`` (round-robin) and a short
prompt, ``--max-tokens`` greedy tokens (EOS ignored).

Checked: every response equals its adapter's pipeline output (``fuseserve.pipeline(...,
lora_modules=...)`` with the stack's settings, once per distinct prompt x adapter). Reported per
mode: adapter loads per 100 requests (the sum of the workers' ``num_lora_loads`` from their gRPC
``Health``, after minus before each round), generated tokens per second (wall, within its rounds),
and the mismatches. Appends the record, with the load average, to ``results/lora_placement.jsonl``.

``python -m benchmarks.lora_placement [--requests 96 --clients 16 --max-tokens 16 --rounds 2]``
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import grpc
import redis

from fuseserve import messages
from fuseserve.proto import worker_pb2 as pb
from fuseserve.proto import worker_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from stack_harness import MODEL, openai_client, recovery_stack  # noqa: E402

RESULTS = Path(__file__).parent / "results"
ADAPTERS = {  # name → (rank, target modules, seed)
    "sql-lora": (8, ["q_proj", "v_proj"], 11),
    "tone-lora": (4, ["o_proj", "down_proj"], 12),
    "math-lora": (8, ["k_proj", "up_proj"], 13),
    "code-lora": (4, ["q_proj", "gate_proj"], 14),
}
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "The best way to learn is",
    "Water boils at",
    "My favourite colour is",
    "In the year 2050,",
]


def write_adapters(model_path: str, root: Path) -> dict[str, str]:
    """The 4 adapters' PEFT directories under ``root``, name → path."""
    import torch
    from lora_checkpoints import write_adapter
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    return {
        name: str(write_adapter(hf, root / name, r, targets, seed, alpha=1))
        for name, (r, targets, seed) in ADAPTERS.items()
    }


def references(model_path: str, adapters: dict[str, str], max_tokens: int) -> dict[tuple[str, str], str]:
    """(prompt, adapter) → the pipeline's greedy text with the stacks' settings."""
    import fuseserve

    pairs = [(p, a) for p in PROMPTS for a in adapters]
    with fuseserve.pipeline(
        model_path,
        token_budget=32,
        kv_cache_memory="64MiB",
        dtype="float32",
        lora_modules=adapters,
        max_loras=2,
        progress=False,
    ) as pipe:
        out = pipe(
            [p for p, _ in pairs],
            lora=[a for _, a in pairs],
            max_new_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
        )
    return {pair: r.text for pair, r in zip(pairs, out, strict=True)}


def lora_loads(redis_url: str) -> tuple[int, dict[str, list[str]]]:
    """The sum of the workers' ``num_lora_loads`` (gRPC ``Health``) and each worker's reported
    adapters (its Redis record), of the workers registered at ``redis_url``."""
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    recs = [messages.WorkerRecord.decode(r.get(k)) for k in r.scan_iter(f"{messages.WORKER_PREFIX}*")]
    total = 0
    for rec in recs:
        with grpc.insecure_channel(rec.address) as channel:
            total += pb_grpc.WorkerStub(channel).Health(pb.HealthRequest(), timeout=30).num_lora_loads
    return total, {rec.worker_id: rec.lora_adapters for rec in recs}


def run_round(url: str, requests: list[tuple[str, str]], clients: int, max_tokens: int) -> tuple[list, float]:
    """Send ``requests`` ((prompt, adapter)) from ``clients`` closed-loop clients; returns the texts
    (request order) and the wall seconds."""
    client = openai_client(url, max_retries=0)
    texts: list[str | None] = [None] * len(requests)
    nxt = iter(range(len(requests)))

    def loop() -> None:
        for i in nxt:  # one shared iterator: each client takes the next request when it is done
            prompt, adapter = requests[i]
            out = client.completions.create(
                model=adapter,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            texts[i] = out.choices[0].text

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as ex:
        for f in [ex.submit(loop) for _ in range(clients)]:
            f.result()
    return texts, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=96, help="requests per mode (all rounds)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per mode")
    a = ap.parse_args()
    from fuseserve.model_source import resolve_model

    cache = os.environ.get("FUSESERVE_CACHE") or Path.home() / ".cache" / "fuseserve"
    model_path = str(resolve_model("smollm2-135m-instruct", cache_dir=cache).path)
    names = list(ADAPTERS)
    requests = [(PROMPTS[(i // len(names)) % len(PROMPTS)], names[i % len(names)]) for i in range(a.requests)]
    per_round = -(-a.requests // a.rounds)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_adapters(model_path, Path(tmp))
        t0 = time.perf_counter()
        expected = references(model_path, adapters, a.max_tokens)
        ref_s = time.perf_counter() - t0
        assert len({expected[PROMPTS[0], n] for n in names}) == len(names), "the adapters must differ"
        modes = {"residency-aware": True, "residency-blind": False}
        stats = {m: {"loads": 0, "seconds": 0.0, "requests": 0, "mismatches": 0} for m in modes}
        with (
            recovery_stack(lora_modules=adapters, max_loras=2, lora_aware_placement=True) as aware,
            recovery_stack(lora_modules=adapters, max_loras=2, lora_aware_placement=False) as blind,
        ):
            stacks = {"residency-aware": aware, "residency-blind": blind}
            reported = {m: lora_loads(s[0].redis.url)[1] for m, s in stacks.items()}
            for rnd in range(a.rounds):
                chunk = requests[rnd * per_round : (rnd + 1) * per_round]
                for mode, (stack, url) in stacks.items():
                    before = lora_loads(stack.redis.url)[0]
                    texts, seconds = run_round(url, chunk, a.clients, a.max_tokens)
                    s = stats[mode]
                    s["loads"] += lora_loads(stack.redis.url)[0] - before
                    s["seconds"] += seconds
                    s["requests"] += len(chunk)
                    s["mismatches"] += sum(t != expected[req] for t, req in zip(texts, chunk, strict=True))
                    print(f"round {rnd} {mode}: {len(chunk)} requests in {seconds:.1f} s", flush=True)
    rows = {}
    for mode, s in stats.items():
        rows[mode] = {
            "requests": s["requests"],
            "mismatches": s["mismatches"],
            "loads": s["loads"],
            "loads_per_100": round(100 * s["loads"] / s["requests"], 1),
            "tokens_per_s": round(s["requests"] * a.max_tokens / s["seconds"], 1),
        }
        print(f"{mode:16s} {rows[mode]}")
    record = {
        "bench": "lora_placement",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "loadavg": os.getloadavg(),
        "model": MODEL,
        "clients": a.clients,
        "max_tokens": a.max_tokens,
        "rounds": a.rounds,
        "reference_seconds": round(ref_s, 1),
        "reported_adapters": reported,
        "modes": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "lora_placement.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
