"""SmolLM2 from its GGUF file: float32 conversion vs weights kept quantized (``quantization="gguf"``).

Prints each model's resident weight bytes and its decode tokens/s at batch 1 and 16: a batch of
short prompts (8 tokens), ``--new-tokens`` greedy tokens each (EOS ignored), generated tokens / wall
seconds, the two pipelines taking turns round by round in one process (the machine is shared and
noisy: compare only within one run). Median over ``--rounds``. Also prints which kernel each
quantized layer shape runs (``fuseserve.kernels.quant_linear.choose_kernel``, measured at load).

``python -m benchmarks.quantized_decode [--rounds 3] [--new-tokens 32] [--batches 1,16]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import fuseserve
from fuseserve.model_source import resolve_model
from fuseserve.worker.quantization import weight_bytes


def _pipe(quantization: str | None):
    return fuseserve.pipeline(
        "smollm2-135m-instruct",
        quantization=quantization,
        dtype="float32",
        token_budget=256,
        kv_cache_memory="128MiB",
        progress=False,
    )


def _decode_rate(pipe, batch: int, new_tokens: int) -> float:
    prompts = [[1 + i, 504, 3458, 282, 4649, 314, 216, 30 + i] for i in range(batch)]
    start = time.perf_counter()
    outs = pipe(prompts, max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batches", default="1,16")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    resolve_model("smollm2-135m-instruct", quantization="gguf")  # convert outside the timings
    pipes = {"fp32": _pipe(None), "gguf-q": _pipe("gguf")}
    for name, pipe in pipes.items():
        kernels = sorted(
            {
                f"{m.packed.out_features}x{m.packed.in_features}:{m.packed.name}"
                for m in pipe.runner.model.modules()
                if hasattr(m, "packed")
            }
        )
        print(
            f"{name}: resident weights {weight_bytes(pipe.runner.model) / 2**20:.1f} MiB; kernels {kernels}"
        )
    rates: dict[tuple[str, int], list[float]] = {(n, b): [] for n in pipes for b in batches}
    for pipe in pipes.values():  # warm-up
        _decode_rate(pipe, 1, 4)
    for r in range(args.rounds):
        for b in batches:
            for name, pipe in pipes.items():
                rates[name, b].append(_decode_rate(pipe, b, args.new_tokens))
        print(f"round {r + 1}: " + ", ".join(f"{n} b{b} {v[-1]:.1f}" for (n, b), v in rates.items()))
    for b in batches:
        fp32 = statistics.median(rates["fp32", b])
        q = statistics.median(rates["gguf-q", b])
        print(f"batch {b}: fp32 {fp32:.1f} tok/s, gguf kept quantized {q:.1f} tok/s, ratio {q / fp32:.2f}")
    for pipe in pipes.values():
        pipe.close()


if __name__ == "__main__":
    main()
