"""The GPU check's INT4 step (``benchmarks/gpu_check.sh`` runs it): a 7B-shaped GPTQ 4-bit model.

    python -m benchmarks.gpu_check_quant OUT [llama2-7b | tiny]

The random-weight model of ``benchmarks/gpu_check.build_checkpoint`` (bf16, reused when the
``model`` step left it under ``$GPU_CHECK_MODELS``) is written as a GPTQ 4-bit checkpoint, groups of
128, symmetric, by ``tests/quant_checkpoints.write_quantized`` (round to nearest, on the CPU; it puts
the dequantized weights back into the ``transformers`` model, which is then the reference). fuseserve
serves it in bf16 (on CUDA the Triton W4A16 GEMM, ``kernels/triton_quant_linear.py``, where
``choose_kernel`` measures it fastest) and records to ``OUT/results.jsonl``:

- ``int4_parity``: greedy tokens against ``transformers`` on the dequantized weights, under
  ``gpu_check``'s near-tie rule (bf16), and the kernel each layer shape runs; once with the chosen
  attention backend and once with the torch reference attention (an H200 run had the 300- and
  700-token prompts off at their first token with Triton attention: this tells which part);
- ``int4_decode``: decode tokens/s at batch 1 and 16 (``benchmarks.quantized_decode.decode_rate``)
  of the INT4 checkpoint and of the bf16 float one, side by side, and their resident weight bytes.

``tiny`` runs the same on a 2-layer model (the CPU dry run: CPU kernels, not Triton).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from benchmarks import gpu_check as gc

TESTS = Path(__file__).resolve().parent.parent / "tests"


def quantized_checkpoint(shape: str, root: Path):
    """``(float path, int4 path, transformers model on the dequantized weights)``."""
    sys.path.insert(0, str(TESTS))  # imported here: transformers must first see GPU_CHECK_ABSENT
    from quant_checkpoints import write_quantized

    path, hf = gc.build_checkpoint(shape, root)
    qpath = root / f"{shape}-gptq-w4g128"
    t0 = time.perf_counter()
    hf = hf.to("cpu")  # the writer rounds on the CPU (each matrix in fp32); 7B: ~80 GB of RAM at peak
    write_quantized(hf, qpath, fmt="gptq", bits=4, group=128)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (path / name).exists():
            (qpath / name).write_bytes((path / name).read_bytes())
    gc.log(f"{shape}: GPTQ 4-bit written in {time.perf_counter() - t0:.1f} s")
    return path, qpath, hf.to(gc.device(), torch.bfloat16).eval()


def step_int4(out: Path, shape: str, root: Path) -> None:
    """Parity and decode speed of the INT4 checkpoint (see the module docstring)."""
    import fuseserve
    from benchmarks.quantized_decode import Prompts, decode_rate, layer_kernels
    from fuseserve.worker.attention import get_backend
    from fuseserve.worker.quantization import weight_bytes

    path, qpath, hf = quantized_checkpoint(shape, root)
    cfg = gc.SHAPES[shape]
    new_tokens = gc.new_tokens_for(shape)
    prompts = gc.prompts_for(shape, cfg["vocab_size"])
    ref = gc.hf_greedy(hf, prompts, new_tokens)
    del hf
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    kv = "8GiB" if gc.device().type == "cuda" else "64MiB"
    budget = gc.budget_for(shape)
    pipes = {}
    for label, source in (("int4", qpath), ("bf16", path)):
        t0 = time.perf_counter()
        pipes[label] = fuseserve.pipeline(
            str(source), dtype="bfloat16", token_budget=budget, kv_cache_memory=kv, prefix_caching=False,
            progress=False,
        )  # fmt: skip
        gc.log(f"{label}: loaded in {time.perf_counter() - t0:.1f} s")
    try:
        pipe = pipes["int4"]
        # the torch reference attention tells the GEMM apart from attention; auto last: the decode rates
        # below run on it (with its CUDA graphs), as the bf16 pipeline does
        for backend in ("torch", "auto"):
            pipe.runner.use_backend(get_backend(backend, pipe.runner.device, block_size=pipe.runner.block_size,
                                                dtype=torch.bfloat16))  # fmt: skip
            results, wall = gc.greedy_parity(pipe, prompts, ref, new_tokens)
            gc.record(out, step="int4_parity", shape=shape, attention=pipe.runner.backend.name,
                      ok=all(r["ok"] for r in results), seconds=wall,
                      kernels=layer_kernels(pipe), per_prompt=results)  # fmt: skip
        rates: dict[str, dict[int, float]] = {label: {} for label in pipes}
        gen = Prompts(cfg["vocab_size"], 8)
        for batch in (1, 16):
            for label, p in pipes.items():
                decode_rate(p, gen, batch, 2)  # warm-up: kernels compile on first use
                rates[label][batch] = decode_rate(p, gen, batch, 32 if shape != "tiny" else 8)
        gc.record(out, step="int4_decode", shape=shape, tokens_per_s=rates,
                  int4_over_bf16={b: rates["int4"][b] / rates["bf16"][b] for b in (1, 16)},
                  attention={k: p.runner.backend.name for k, p in pipes.items()},
                  cuda_graphs={k: p.runner.graphs is not None for k, p in pipes.items()},
                  weight_mib={k: weight_bytes(p.runner.model) / 2**20 for k, p in pipes.items()})  # fmt: skip
    finally:
        for p in pipes.values():
            p.close()


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    root = Path(os.environ.get("GPU_CHECK_MODELS", "/tmp/fuseserve-gpu-check"))
    step_int4(out, argv[1] if len(argv) > 1 else "llama2-7b", root)
    return 0


if __name__ == "__main__":
    for name in filter(None, os.environ.get("GPU_CHECK_ABSENT", "").split(",")):
        sys.modules[name] = None  # as gpu_check: prove the GPU machine's missing packages are not needed
    sys.exit(main(sys.argv[1:]))
