"""bf16 linears alone: oneDNN's packed matmul against ``kernels/cpu_linear.cpp``'s 64-column blocks.

For each of SmolLM2's products (qkv, o, gate_up, down, and the LM head up to 64 rows) and each row
count, ms per call and GB/s of weight read, the two alternated three times; the weights are cycled
through ~300 MB of random copies so they come from memory, as in a pass. Then the 30 layers' sum
(+ the LM head). Needs an AMX CPU (oneDNN's bf16 brgemm) and a C++ compiler.

    python -m benchmarks.linear_micro [--rows 1,16,32,256] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

from fuseserve.kernels import cpu_linear

SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
LAYERS = 30


def _onednn(x, w):
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def measure(rows: int, rounds: int = 3) -> dict[str, dict[str, float]]:
    """{product: {"onednn": ms, "blocks": ms}} at ``rows`` rows, each the mean over ``rounds``."""
    out = {}
    for name, (n, k) in SHAPES.items():
        if name == "lm_head" and rows > 64:
            continue  # a pass's LM head takes only the rows it samples
        copies = max(2, 300_000_000 // (n * k * 2))
        ws = [torch.randn(n, k, dtype=torch.bfloat16) / 8 for _ in range(copies)]
        variants = {
            "onednn": ([torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in ws], _onednn),
            "blocks": ([cpu_linear.pack(w) for w in ws], cpu_linear.linear),
        }
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        times = {key: 0.0 for key in variants}
        for _ in range(rounds):
            for key, (packed, fn) in variants.items():
                t = time.perf_counter()
                for w in packed:
                    fn(x, w)
                times[key] += (time.perf_counter() - t) / copies * 1e3 / rounds
        out[name] = times
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,32,256")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not cpu_linear.available():
        raise SystemExit("no oneDNN bf16 brgemm (AMX) or no C++ compiler here: nothing to compare")
    torch.set_num_threads(args.threads)
    for rows in tqdm([int(r) for r in args.rows.split(",")], desc="row counts"):
        res = measure(rows)
        for name, times in res.items():
            n, k = SHAPES[name]
            cells = ", ".join(
                f"{key} {ms:.3f} ms ({n * k * 2 / ms / 1e6:.1f} GB/s)" for key, ms in times.items()
            )
            tqdm.write(f"{rows:5d} rows {name:8s} {cells}")
        total = {
            key: sum(t[key] * (1 if name == "lm_head" else LAYERS) for name, t in res.items())
            for key in ("onednn", "blocks")
        }
        tqdm.write(
            f"{rows:5d} rows, {LAYERS} layers + LM head: "
            + ", ".join(f"{k} {v:.2f} ms" for k, v in total.items())
        )


if __name__ == "__main__":
    main()
