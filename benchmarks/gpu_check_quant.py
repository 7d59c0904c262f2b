"""The GPU check's INT4 step (``benchmarks/gpu_check.sh`` runs it): a 7B-shaped GPTQ 4-bit model.

    python -m benchmarks.gpu_check_quant OUT [llama2-7b | tiny]

The random-weight model of ``benchmarks/gpu_check.build_checkpoint`` (bf16, reused when the
``model`` step left it under ``$GPU_CHECK_MODELS``) is written as a GPTQ 4-bit checkpoint, groups of
128, symmetric, by ``tests/quant_checkpoints.write_quantized`` (round to nearest, on the CPU; it puts
the dequantized weights back into the ``transformers`` model, kept in fp32 so they stay exact: the
references). fuseserve serves it in bf16 and in fp32 (on CUDA the Triton W4A16 GEMM,
``kernels/triton_quant_linear.py``, where ``choose_kernel`` measures it fastest) and records to
``OUT/results.jsonl``:

- ``int4_kernel_rows``: before any model is built, each kernel ``choose_kernel`` allows for the
  model's layer shapes against the fp32 reference at 1 to 2048 rows (relative error; ``choose_kernel``
  checks 1 and 16 rows only, a prefill chunk has up to the token budget);
- ``int4_parity``: bf16 greedy tokens against ``transformers`` in bf16 on the dequantized weights
  rounded to bf16, under ``gpu_check``'s near-tie rule (``within_near_tie``, informative: not a
  verdict), and the kernel each layer shape runs; once with the torch reference attention and once
  with the chosen backend;
- ``int4_parity_fp32``, the verdict (``ok``): fuseserve in fp32 against ``transformers`` in fp32 on the
  exact dequantized weights. On the H200 (benchmarks/README.md) the bf16 reference's rounding of the
  dequantized weights moved the first token of the 300- and 700-token prompts of the random 7B (its
  picks 0.6 and 2.3 below the top of the exact fp32 logits), so the bf16 parity cannot judge the
  kernels there; fp32 matched 16/16 tokens on every prompt;
- ``int4_first_token``: each prompt's first token from transformers in bf16 and in fp32, from
  fuseserve in bf16 with the prompts together and alone, and in fp32, with both references' logits
  for each pick (who moved);
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


def quantized_checkpoint(shape: str, root: Path, prompts, new_tokens: int):
    """Write the GPTQ copy; returns ``(float path, int4 path, ref16, ref32)``: transformers' greedy
    reference (``gc.hf_greedy``) on the dequantized weights, in bf16 (the weights rounded to bf16, as
    a bf16 run of them would load) and in fp32 (the weights exact: what the INT4 kernels compute)."""
    sys.path.insert(0, str(TESTS))  # imported here: transformers must first see GPU_CHECK_ABSENT
    from quant_checkpoints import write_quantized

    path, hf = gc.build_checkpoint(shape, root)
    qpath = root / f"{shape}-gptq-w4g128"
    t0 = time.perf_counter()
    # fp32 on the device: the writer (which rounds on the CPU, each matrix in fp32) loads the exact
    # dequantized weights back into it; 7B: ~27 GB on the GPU, ~60 GB of RAM and ~45 GB of disk at peak
    hf = hf.float()
    write_quantized(hf, qpath, fmt="gptq", bits=4, group=128)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (path / name).exists():
            (qpath / name).write_bytes((path / name).read_bytes())
    gc.log(f"{shape}: GPTQ 4-bit written in {time.perf_counter() - t0:.1f} s")
    ref32 = gc.hf_greedy(hf.eval(), prompts, new_tokens)
    ref16 = gc.hf_greedy(hf.to(torch.bfloat16), prompts, new_tokens)
    del hf
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return path, qpath, ref16, ref32


def kernel_rows(out: Path, shape: str) -> None:
    """``int4_kernel_rows`` (see the module docstring): random GPTQ-like weights of the shape's layer
    sizes, 4-bit, groups of 128, bf16 activations."""
    from fuseserve.kernels import quant_linear as ql

    cfg = gc.SHAPES[shape]
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    dev = gc.device()
    gen = torch.Generator().manual_seed(0)
    for n, k in ((hidden, hidden), (inter, hidden), (hidden, inter)):
        w = ql._probe_weight((n, k), 4, 128, gen)
        ref = ql.Dequant(w, torch.float32).to(dev)
        errors: dict[str, dict[int, float]] = {}
        for name in ql.candidates(w, dev):
            kernel = ql.pack(w, torch.bfloat16, dev, kernel=name)
            errors[name] = {}
            for m in (1, 16, 40, 256, 300, 700, 2048):
                x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(dev)
                want = ref(x.float())
                got = kernel(x).float()
                errors[name][m] = ((got - want).norm() / want.norm()).item()
        gc.record(out, step="int4_kernel_rows", shape=shape, n=n, k=k, relative_error=errors)


def first_tokens(out: Path, shape: str, prompts, ref16, ref32, pipe, p32) -> None:
    """``int4_first_token`` (see the module docstring): each prompt's first token by each side, and
    the logits both references give it."""
    one = dict(max_new_tokens=1, min_new_tokens=1, temperature=0.0)
    together = [r.token_ids[0] for r in pipe(prompts, **one)]
    alone = [pipe([p], **one)[0].token_ids[0] for p in prompts]
    ours32 = [r.token_ids[0] for r in p32(prompts, **one)]
    for i, ids in enumerate(prompts):
        l16, l32 = ref16[i][1][0], ref32[i][1][0]
        picks = {"transformers_bf16": ref16[i][0][0], "transformers_fp32": ref32[i][0][0],
                 "ours_bf16_together": together[i], "ours_bf16_alone": alone[i], "ours_fp32": ours32[i]}  # fmt: skip
        gc.record(out, step="int4_first_token", shape=shape, prompt_len=len(ids), picks=picks,
                  logit_bf16={k: l16[t].item() for k, t in picks.items()},
                  logit_fp32={k: l32[t].item() for k, t in picks.items()})  # fmt: skip


def step_int4(out: Path, shape: str, root: Path) -> None:
    """Parity and decode speed of the INT4 checkpoint (see the module docstring)."""
    import fuseserve
    from benchmarks.quantized_decode import Prompts, decode_rate, layer_kernels
    from fuseserve.worker.attention import get_backend
    from fuseserve.worker.quantization import weight_bytes

    kernel_rows(out, shape)
    cfg = gc.SHAPES[shape]
    new_tokens = gc.new_tokens_for(shape)
    prompts = gc.prompts_for(shape, cfg["vocab_size"])
    path, qpath, ref, ref32 = quantized_checkpoint(shape, root, prompts, new_tokens)
    kv = "8GiB" if gc.device().type == "cuda" else "64MiB"
    budget = gc.budget_for(shape)
    pipes = {}
    for label, source, dtype in (
        ("int4", qpath, "bfloat16"),
        ("bf16", path, "bfloat16"),
        ("int4-fp32", qpath, "float32"),
    ):
        t0 = time.perf_counter()
        pipes[label] = fuseserve.pipeline(
            str(source), dtype=dtype, token_budget=budget, kv_cache_memory=kv, prefix_caching=False,
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
                      within_near_tie=all(r["ok"] for r in results), seconds=wall,
                      kernels=layer_kernels(pipe), per_prompt=results)  # fmt: skip
        p32 = pipes.pop("int4-fp32")
        results, wall = gc.greedy_parity(p32, prompts, ref32, new_tokens)
        gc.record(out, step="int4_parity_fp32", shape=shape, attention=p32.runner.backend.name,
                  ok=all(r["ok"] for r in results), seconds=wall, per_prompt=results)  # fmt: skip
        first_tokens(out, shape, prompts, ref, ref32, pipe, p32)
        p32.close()
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
