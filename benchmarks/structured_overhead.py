"""Pipeline decode throughput with and without a JSON schema, on the same requests in one run.

``python -m benchmarks.structured_overhead [--requests 16] [--max-tokens 48] [--rounds 2]``

The same ``--requests`` chat prompts (extraction questions) run as one concurrent batch, greedy,
alternately unconstrained and constrained by a small JSON schema, ``--rounds`` times each after one
warm-up round of each (the warm-up also compiles the schema once). Prints generated tokens / wall
seconds and tokens per process CPU second per round (the CPU figure is less sensitive to other
processes on a shared machine) and the constrained/unconstrained ratio of the medians, then the sampler's own
time per step for the same batch size with and without the schema (the part the grammar adds to). The constrained outputs end
when their document ends, so rates (not wall times) are compared.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 16},
        "tags": {"type": "array", "items": {"enum": ["friend", "colleague", "family"]}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "tags"],
}
PEOPLE = ["Alice", "Bob", "Carol", "Dan", "Eve", "Frank", "Grace", "Heidi"]
CITIES = ["Oslo", "Paris", "Rome", "Lima"]


def _round(pipe, prompts: list[list[int]], kwargs: dict) -> tuple[int, float, float]:
    """``(generated tokens, wall seconds, process CPU seconds)`` of one concurrent batch."""
    start, cpu = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(lambda ids: pipe(ids, **kwargs)[0], prompts))
    return sum(o.generated_tokens for o in outs), time.perf_counter() - start, time.process_time() - cpu


def sampler_step_ms(pipe, num_rows: int, steps: int = 40) -> dict[str, float]:
    """Median ms of one ``Sampler`` call on ``[num_rows, V]`` random logits, unconstrained vs schema.

    The constrained rows advance their matchers on the sampled tokens (as the worker does), so the
    mask fill sees a realistic grammar state; the forward pass is excluded.
    """
    import torch

    from fuseserve.sampling_params import SamplingParams
    from fuseserve.worker.sampler import SeqSamplingState

    sampler = pipe.runner.sampler
    out = {}
    for mode, params in (
        ("unconstrained", SamplingParams(temperature=0.0)),
        ("json_schema", SamplingParams(temperature=0.0, json_schema=SCHEMA)),
    ):
        states = [SeqSamplingState.create(params, []) for _ in range(num_rows)]
        times = []
        for _ in range(steps):
            logits = torch.randn(num_rows, pipe.runner.vocab_size)
            start = time.perf_counter()
            ids = sampler(logits, states).token_ids.tolist()
            times.append(time.perf_counter() - start)
            for st, t in zip(states, ids, strict=True):
                st.output_token_ids.append(t)
        out[mode] = 1e3 * statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sampler-only", action="store_true", help="only the sampler timing (no generation)")
    a = ap.parse_args()
    import fuseserve

    pipe = fuseserve.pipeline(a.model, dtype=a.dtype, progress=False)
    if not a.sampler_only:
        generation_rates(pipe, a)
    ms = sampler_step_ms(pipe, a.requests)
    print(
        f"sampler alone, {a.requests} rows x {pipe.runner.vocab_size}: unconstrained {ms['unconstrained']:.2f} ms,"
        f" json_schema {ms['json_schema']:.2f} ms per step (median of 40)"
    )
    pipe.close()


def generation_rates(pipe, a: argparse.Namespace) -> None:
    """Tokens/s of the same batch, unconstrained and with ``SCHEMA``, alternating (see the module doc)."""
    prompts = [
        pipe.chat_prompt_ids(
            [
                {
                    "role": "user",
                    "content": f"{PEOPLE[i % 8]} is {20 + i} and lives in {CITIES[i % 4]}. Describe them as JSON.",
                }
            ]
        )
        for i in range(a.requests)
    ]
    base = dict(temperature=0.0, max_new_tokens=a.max_tokens)
    modes = {"unconstrained": base, "json_schema": dict(base, json_schema=SCHEMA)}
    rates: dict[str, list[float]] = {m: [] for m in modes}
    cpu_rates: dict[str, list[float]] = {m: [] for m in modes}
    print(f"{a.requests} concurrent requests, greedy, max_tokens={a.max_tokens}, dtype={a.dtype}")
    for r in range(a.rounds + 1):
        for mode, kwargs in modes.items():
            tokens, seconds, cpu = _round(pipe, prompts, kwargs)
            label = "warm-up" if r == 0 else f"round {r}"
            print(
                f"{label:>8} {mode:>13}: {tokens:5d} tokens in {seconds:6.2f} s = {tokens / seconds:7.1f} tok/s"
                f" ({cpu:6.2f} CPU s = {tokens / cpu:6.1f} tok per CPU s)"
            )
            if r:
                rates[mode].append(tokens / seconds)
                cpu_rates[mode].append(tokens / cpu)
    for label, table in (("tok/s", rates), ("tok per CPU s", cpu_rates)):
        free, constrained = (statistics.median(table[m]) for m in modes)
        print(
            f"median {label}: unconstrained {free:.1f}, json_schema {constrained:.1f};"
            f" ratio {constrained / free:.3f}"
        )


if __name__ == "__main__":
    main()
