"""The GPU check's Python steps (``benchmarks/gpu_check.sh`` runs them, each with its own time limit).

    python -m benchmarks.gpu_check env        OUT                # versions, GPU, which backends can run
    python -m benchmarks.gpu_check model      OUT SHAPE [workload]  # parity with transformers, pass times
                                                                  # per backend [, the paper's workload]
    python -m benchmarks.gpu_check graphs     OUT SHAPE [workload]  # CUDA graphs: capture, parity, pass
                                                                  # times replayed vs eager [, workload]
    python -m benchmarks.gpu_check attention  OUT [tiny]         # attention-only timings and errors

SHAPE is ``smollm2`` (LLaMA, 30 layers, hidden 576, 9 heads / 3 KV heads, vocab 49152) or ``llama2-7b``
(32 layers, hidden 4096, 32 heads, vocab 32000), or ``tiny`` (2 layers, for a CPU dry run). Models get
random weights (seed 0) on the device, are saved once as a Hugging Face directory (safetensors and a
word-level tokenizer) under ``$GPU_CHECK_MODELS`` (default ``/tmp/fuseserve-gpu-check``, outside OUT)
and loaded by fuseserve from there; ``transformers`` runs the same weights (the in-memory model).

Greedy parity rule (bf16): fuseserve's tokens must equal ``transformers``' until the first divergence,
and a divergence is accepted only at a near-tie, where transformers' logits of its token and ours
differ by less than ``NEAR_TIE_ULPS`` bf16 steps at the larger logit's magnitude (the repository's
fp32 rule, ``tests/pipeline/test_smollm2_greedy.py``, uses 1e-3; bf16 keeps 8 significant bits). Logprobs of the
tokens both chose are compared as well (max absolute difference, reported).

Every step appends JSON lines to ``OUT/results.jsonl`` and prints a readable line per result. Nothing
here imports fastapi, uvicorn, redis or gguf.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

SHAPES = {
    "smollm2": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    "llama2-7b": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
}
NEAR_TIE_ULPS = 4
BF16_MANTISSA_BITS = 7


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def record(out: Path, **fields) -> None:
    """Append one result to ``out/results.jsonl`` and print it."""
    fields = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **fields}
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(fields, default=str) + "\n")
    log("RESULT " + json.dumps(fields, default=str))


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def backends_here(block_size: int = 16) -> dict[str, str | None]:
    """Attention backend name → None if it can run on this device, else why not."""
    from fuseserve.kernels import flash_attn
    from fuseserve.worker.attention import triton_unavailable_reason

    dev = device()
    return {
        "torch": None,
        "triton": triton_unavailable_reason(dev) if dev.type == "cuda" else None,  # CPU: interpreted
        "flash-attn": flash_attn.unsupported_reason(dev, flash_attn.PAGE_MULTIPLE, torch.bfloat16),
    }


# ------------------------------------------------------------------------------------------ env


def step_env(out: Path) -> None:
    import transformers

    info = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "capability": torch.cuda.get_device_capability() if torch.cuda.is_available() else None,
        "backends": backends_here(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError as e:
        info["triton"] = f"absent ({e})"
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401

        info["flex_attention"] = "available"
    except ImportError as e:
        info["flex_attention"] = f"absent ({e})"
    for name in ("fastapi", "uvicorn", "redis", "gguf", "pytest"):
        try:
            __import__(name)
            info[name] = "present"
        except ImportError:
            info[name] = "absent"
    record(out, step="env", **info)


# ------------------------------------------------------------------------------------------ models


def build_checkpoint(shape: str, root: Path):
    """A random-weight LLaMA of ``shape`` saved under ``root/shape`` (bf16 safetensors + tokenizer).

    Returns ``(path, model)``: the ``transformers`` model on the device in bf16 (loaded back when the
    directory was already there)."""
    from transformers import AutoModelForCausalLM

    path = root / shape
    if (path / "config.json").exists():
        return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device()).eval()
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    cfg = LlamaConfig(**SHAPES[shape], rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device()):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    fast.save_pretrained(tmp)
    tmp.rename(path)
    log(f"built and saved {shape} ({sum(f.stat().st_size for f in path.iterdir()) / 2**30:.2f} GiB) "
        f"in {time.perf_counter() - t0:.1f} s")  # fmt: skip
    return path, model.eval()


def prompts_for(shape: str, vocab: int) -> list[list[int]]:
    """Seeded random prompts: short, medium, and one longer than the token budget (chunked)."""
    g = torch.Generator().manual_seed(1)
    lens = [5, 40, 300, 700] if shape != "tiny" else [5, 40, 100]
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def hf_greedy(hf, prompts: list[list[int]], new_tokens: int):
    """transformers' greedy tokens and per-step raw logits (float32) for each prompt, run alone."""
    outs = []
    with torch.no_grad():
        for ids in prompts:
            g = hf.generate(
                torch.tensor([ids], device=device()),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device()),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            outs.append((g.sequences[0, len(ids) :].tolist(), [s[0].float().cpu() for s in g.logits]))
    return outs


def near_tie(logits: torch.Tensor, a: int, b: int) -> tuple[bool, float, float]:
    """(is a near-tie, gap, threshold) between tokens ``a`` and ``b`` of one step's logits."""
    gap = (logits[a] - logits[b]).abs().item()
    mag = max(abs(logits[a].item()), abs(logits[b].item()), 1e-6)
    ulp = 2.0 ** (math.floor(math.log2(mag)) - BF16_MANTISSA_BITS)
    return gap < NEAR_TIE_ULPS * ulp, gap, NEAR_TIE_ULPS * ulp


def compare(ours, ours_logprobs, ref_tokens, ref_logits) -> dict:
    """Parity of one prompt under the near-tie rule, plus logprob agreement on the common prefix."""
    res = {"tokens": len(ours), "matched": 0, "ok": True, "divergence": None, "max_logprob_diff": 0.0}
    for i, (a, b) in enumerate(zip(ours, ref_tokens, strict=False)):
        lp_ref = torch.log_softmax(ref_logits[i], -1)
        if a != b:
            tie, gap, thr = near_tie(ref_logits[i], a, b)
            res["divergence"] = {"step": i, "ours": a, "transformers": b, "gap": gap, "threshold": thr}
            res["ok"] = tie
            return res
        res["matched"] = i + 1
        if ours_logprobs:
            res["max_logprob_diff"] = max(res["max_logprob_diff"], abs(ours_logprobs[i] - lp_ref[a].item()))
    res["ok"] = len(ours) == len(ref_tokens)
    return res


def open_pipeline(
    path: Path,
    *,
    block_size: int,
    token_budget: int,
    kv_memory: str,
    backend: str = "auto",
    compile: bool = False,
):
    import fuseserve

    return fuseserve.pipeline(
        str(path),
        token_budget=token_budget,
        kv_cache_memory=kv_memory,
        block_size=block_size,
        dtype="bfloat16",
        attention_backend=backend,
        compile=compile,
        # measure_curve writes its scratch prompts over blocks 0.. (profiler.py): with prefix caching on,
        # the next backend's parity would read those blocks as the cached prompts' K/V (seen on an H200)
        prefix_caching=False,
        progress=False,
    )


def new_tokens_for(shape: str) -> int:
    """Greedy tokens per prompt in a parity check."""
    return 16 if shape != "tiny" else 6


def budget_for(shape: str) -> int:
    """The token budget of the check's pipelines."""
    return 256 if shape != "tiny" else 32


def reference(shape: str, root: Path) -> tuple[Path, list[list[int]], list]:
    """The ``shape`` checkpoint (``build_checkpoint``), its prompts and transformers' greedy reference
    (``hf_greedy``); the transformers model is freed."""
    path, hf = build_checkpoint(shape, root)
    prompts = prompts_for(shape, SHAPES[shape]["vocab_size"])
    t0 = time.perf_counter()
    ref = hf_greedy(hf, prompts, new_tokens_for(shape))
    log(f"{shape}: transformers greedy in {time.perf_counter() - t0:.1f} s")
    del hf
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return path, prompts, ref


def greedy_parity(pipe, prompts: list[list[int]], ref: list, new_tokens: int) -> tuple[list[dict], float]:
    """``pipe``'s greedy tokens for ``prompts`` against transformers' ``ref`` (``compare``, per prompt),
    and the seconds the generation took."""
    t0 = time.perf_counter()
    resps = pipe(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, temperature=0.0, logprobs=0)
    wall = time.perf_counter() - t0
    return [compare(r.token_ids, r.logprobs, *ref[i]) for i, r in enumerate(resps)], wall


def step_model(out: Path, shape: str, root: Path, workload: bool = False) -> None:
    """Greedy parity with transformers (bf16, same weights) and forward-pass times, per backend; then,
    with ``workload``, the paper's workload through the pipeline (auto backend, block size 16)."""
    from fuseserve.worker.attention import get_backend
    from fuseserve.worker.profiler import measure_curve

    path, prompts, ref = reference(shape, root)
    kv_memory = "40GiB" if shape == "llama2-7b" else "2GiB" if device().type == "cuda" else "64MiB"
    budget = budget_for(shape)
    here = backends_here()
    # flash-attn first (it needs 256-token pages); the 16-token pipeline then serves the workload
    for block_size in (256, 16):
        names = [n for n, why in here.items() if why is None and (n == "flash-attn") == (block_size == 256)]
        if not names:
            continue
        pipe = open_pipeline(path, block_size=block_size, token_budget=budget, kv_memory=kv_memory)
        try:
            for name in names:
                pipe.runner.use_backend(
                    get_backend(name, pipe.runner.device, block_size=block_size, dtype=torch.bfloat16)
                )
                results, wall = greedy_parity(pipe, prompts, ref, new_tokens_for(shape))
                record(out, step="parity", shape=shape, backend=name, block_size=block_size,
                       ok=all(r["ok"] for r in results), seconds=wall, prompts=[len(p) for p in prompts],
                       per_prompt=results)  # fmt: skip
                sizes = (1, 256, 2048) if shape != "tiny" else (1, 32)
                curve = measure_curve(pipe.runner, sizes=sizes, repeats=3)
                record(out, step="forward_pass", shape=shape, backend=name, block_size=block_size,
                       seconds_per_pass={n: s for n, s in curve.items()},
                       tokens_per_s={n: n / s for n, s in curve.items()})  # fmt: skip
            if workload and block_size == 16:
                pipe.runner.use_backend(
                    get_backend("auto", pipe.runner.device, block_size=16, dtype=torch.bfloat16)
                )
                step_workload(out, shape, pipe)
        finally:
            pipe.close()


def step_compiled(out: Path, shape: str, root: Path) -> None:
    """The compiled forward (``torch.compile``, ``--compile``) on this device: compile seconds at start,
    greedy parity with transformers, and pass times beside the eager ones of ``step_model`` (same shape,
    block size 16, auto backend)."""
    from fuseserve.worker.profiler import measure_curve

    path, prompts, ref = reference(shape, root)
    budget = budget_for(shape)
    kv_memory = "2GiB" if device().type == "cuda" else "64MiB"
    pipe = open_pipeline(path, block_size=16, token_budget=budget, kv_memory=kv_memory, compile=True)
    try:
        runner = pipe.runner
        log(f"{shape}: compiled={runner.compiled is not None} in {runner.compile_s:.1f} s")
        results, wall = greedy_parity(pipe, prompts, ref, new_tokens_for(shape))
        curve = measure_curve(runner, sizes=(1, budget), repeats=3)
        record(out, step="compiled", shape=shape, backend=runner.backend.name, compiled=runner.compiled is not None,
               compile_s=runner.compile_s, ok=runner.compiled is not None and all(r["ok"] for r in results),
               seconds=wall, seconds_per_pass=curve, tokens_per_s={n: n / s for n, s in curve.items()},
               per_prompt=results)  # fmt: skip
    finally:
        pipe.close()


def step_graphs(out: Path, shape: str, root: Path, workload: bool = False) -> None:
    """CUDA graphs (``--cuda-graphs``, on by default on CUDA; ``services/worker/cuda_graphs.py``): capture
    seconds at start, greedy parity with transformers replaying them (Triton attention, block size 16),
    pass times replayed and eager on the same pipeline; with ``workload``, the paper's workload both
    ways (token budget ``$GPU_CHECK_TOKEN_BUDGET``, graphs captured up to it)."""
    from fuseserve.worker.profiler import measure_curve

    path, prompts, ref = reference(shape, root)
    kv_memory = "40GiB" if shape == "llama2-7b" else "2GiB" if device().type == "cuda" else "64MiB"
    tiny = shape == "tiny"
    budget = (
        int(os.environ.get("GPU_CHECK_TOKEN_BUDGET", 2048 if not tiny else 32))
        if workload
        else budget_for(shape)
    )
    pipe = open_pipeline(path, block_size=16, token_budget=budget, kv_memory=kv_memory, backend="triton")
    try:
        runner = pipe.runner
        graphs = runner.graphs
        results, wall = greedy_parity(pipe, prompts, ref, new_tokens_for(shape))
        record(out, step="graphs", shape=shape, captured=graphs is not None, token_budget=budget,
               capture_s=graphs.capture_s if graphs else None, buckets=len(graphs.buckets) if graphs else 0,
               ok=graphs is not None and all(r["ok"] for r in results), seconds=wall, per_prompt=results)  # fmt: skip
        sizes = tuple(n for n in (1, 16, 256, 2048) if n <= budget) if not tiny else (1, 16)
        curves = {}
        for label, g in (("graphs", graphs), ("eager", None)):
            runner.graphs = g
            curves[label] = measure_curve(runner, sizes=sizes, repeats=5)
        runner.graphs = graphs
        record(out, step="graphs_pass", shape=shape, seconds_per_pass=curves,
               speedup={n: curves["eager"][n] / curves["graphs"][n] for n in sizes})  # fmt: skip
        if workload:
            for label, g in (("graphs", graphs), ("eager", None)):
                runner.graphs = g
                step_workload(out, shape, pipe, graphs=label)
            runner.graphs = graphs
    finally:
        pipe.close()


# ------------------------------------------------------------------------------------------ attention


def synthetic_pass(seqs, page, kv_heads, group, head_dim, dtype, dev):
    """A SplitFuse pass of ``seqs`` = [(cached tokens, new tokens)] over a randomly filled paged cache.

    Returns the Triton/torch/flash-attn inputs (all on ``dev``); block ids are a random permutation.
    """
    g = torch.Generator(device="cpu").manual_seed(0)
    blocks_per = [-(-(c + n) // page) for c, n in seqs]
    num_blocks = sum(blocks_per) + 1
    perm = torch.randperm(num_blocks, generator=g)
    width = max(blocks_per)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    slots, start = [], 0
    for i, ((c, n), nb) in enumerate(zip(seqs, blocks_per, strict=True)):
        tables[i, :nb] = perm[start : start + nb]
        start += nb
        pos = torch.arange(c, c + n)
        slots.append(tables[i, pos // page].long() * page + pos % page)
    query_lens = [n for _, n in seqs]
    context_lens = [c + n for c, n in seqs]
    num_tokens = sum(query_lens)
    cache_shape = (num_blocks, page, kv_heads, head_dim)
    return dict(
        q=torch.randn(num_tokens, kv_heads * group, head_dim, device=dev, dtype=dtype),
        k=torch.randn(num_tokens, kv_heads, head_dim, device=dev, dtype=dtype),
        v=torch.randn(num_tokens, kv_heads, head_dim, device=dev, dtype=dtype),
        k_cache=torch.randn(cache_shape, device=dev, dtype=dtype),
        v_cache=torch.randn(cache_shape, device=dev, dtype=dtype),
        block_tables=tables.to(dev),
        slot_mapping=torch.cat(slots).to(dev),
        query_lens=query_lens,
        context_lens=context_lens,
        cu_seqlens_q=torch.tensor(
            [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev
        ),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
        page=page,
    )


def scenarios(tiny: bool) -> dict[str, list[tuple[int, int]]]:
    """Passes of a ~2k-token budget: decode-only, mixed SplitFuse, prefill-only, long-context decode."""
    if tiny:
        return {"mixed": [(0, 20), (30, 9), (47, 1), (70, 1)]}
    g = torch.Generator().manual_seed(2)
    ctx = lambda n, lo, hi: torch.randint(lo, hi, (n,), generator=g).tolist()  # noqa: E731
    return {  # the mixed pass last: FlexAttention (compiled on first use) runs on it only
        "decode-256x~2k": [(c, 1) for c in ctx(256, 1000, 3000)],
        "prefill-4x512": [(0, 512)] * 4,
        "decode-8x32k": [(c, 1) for c in ctx(8, 30000, 32000)],
        "mixed-4x384+512dec": [(c, 384) for c in ctx(4, 0, 2000)] + [(c, 1) for c in ctx(512, 200, 3000)],
    }


def time_fn(fn, repeats: int = 20) -> float:
    """Median seconds per call after a warm-up call."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def flex_peer(p, scale):
    """PyTorch FlexAttention over the same pass, K/V gathered into per-sequence contiguous runs first
    (the gather is not timed: FlexAttention has no paged cache of its own). Returns (run, output)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    dev = p["q"].device
    page, kvh, d = p["page"], p["k_cache"].shape[2], p["k_cache"].shape[3]
    keys, seq_of_key, pos_of_key = [], [], []
    for i, n in enumerate(p["context_lens"]):
        pos = torch.arange(n, device=dev)
        keys.append(p["block_tables"][i, pos // page].long() * page + pos % page)
        seq_of_key.append(torch.full((n,), i, device=dev))
        pos_of_key.append(pos)
    slots = torch.cat(keys)
    k = p["k_cache"].view(-1, kvh, d)[slots].transpose(0, 1)[None]
    v = p["v_cache"].view(-1, kvh, d)[slots].transpose(0, 1)[None]
    q = p["q"].transpose(0, 1)[None]
    q_seq = torch.repeat_interleave(
        torch.arange(len(p["query_lens"]), device=dev), torch.tensor(p["query_lens"], device=dev)
    )
    q_pos = torch.cat(
        [torch.arange(c - n, c, device=dev) for n, c in zip(p["query_lens"], p["context_lens"], strict=True)]
    )
    k_seq, k_pos = torch.cat(seq_of_key), torch.cat(pos_of_key)

    def mask_mod(b, h, qi, ki):
        return (q_seq[qi] == k_seq[ki]) & (k_pos[ki] <= q_pos[qi])

    block_mask = create_block_mask(mask_mod, 1, None, q.shape[2], k.shape[2], device=dev)
    compiled = torch.compile(flex_attention, dynamic=False)
    run = lambda: compiled(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=kvh != q.shape[1])  # noqa: E731
    return run, run()[0].transpose(0, 1)


def step_attention(out: Path, tiny: bool = False) -> None:
    """Attention-only time per pass and max |difference| to the torch reference, per backend and shape."""
    dev = device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shapes = {"smollm2": (3, 3, 64), "llama2-7b": (32, 1, 128)} if not tiny else {"tiny": (2, 2, 64)}
    for shape, (kvh, group, d) in shapes.items():
        for scen, seqs in scenarios(tiny).items():
            if shape == "llama2-7b" and scen == "decode-8x32k":
                continue  # 32 KV heads x 8 sequences already fill the GPU's SMs: no split-KV case; saves time
            bench_pass(out, f"{shape}/{scen}", synthetic_pass(seqs, 16, kvh, group, d, dtype, dev))


def bench_pass(out: Path, label: str, p: dict) -> None:
    """Time one synthetic pass ``p`` with every backend that runs here (and FlexAttention on CUDA)."""
    from fuseserve.kernels import flash_attn, reference
    from fuseserve.kernels import triton_attention as tri

    here = backends_here()
    scale = p["q"].shape[-1] ** -0.5
    q, kc, vc = p["q"], p["k_cache"], p["v_cache"]
    rplan = reference.plan_attention(
        p["query_lens"], p["context_lens"], p["block_tables"], p["slot_mapping"], 16
    )
    reference.write_kv(kc, vc, p["k"], p["v"], rplan.slot_mapping)
    want = reference.paged_attention(q, kc, vc, rplan, scale)
    runs = {"torch": lambda: reference.paged_attention(q, kc, vc, rplan, scale)}
    if here["triton"] is None:
        tplan = tri.plan_attention(p["query_lens"], p["context_lens"], p["cu_seqlens_q"], p["seq_lens"],
                                   p["block_tables"], p["slot_mapping"], 16)  # fmt: skip
        runs["triton"] = lambda: tri.paged_attention(q, kc, vc, tplan, scale)
        runs["triton-kv-write"] = lambda: tri.write_kv(kc, vc, p["k"], p["v"], p["slot_mapping"])
    if here["flash-attn"] is None:
        seqs = [(c - n, n) for n, c in zip(p["query_lens"], p["context_lens"], strict=True)]
        fp = synthetic_pass(seqs, flash_attn.PAGE_MULTIPLE, kc.shape[2], q.shape[1] // kc.shape[2], q.shape[2],
                            q.dtype, q.device)  # fmt: skip
        fplan = flash_attn.plan_attention(fp["query_lens"], fp["context_lens"], fp["cu_seqlens_q"],
                                          fp["block_tables"], fp["slot_mapping"])  # fmt: skip
        runs["flash-attn"] = lambda: flash_attn.paged_attention(
            fp["q"], fp["k_cache"], fp["v_cache"], fplan, scale
        )
    if q.device.type == "cuda" and "mixed" in label:  # one pass per shape: each compiles its own kernel
        runs["flex-attention (gathered K/V)"] = None
    for name, run in runs.items():
        rec = {"step": "attention", "pass": label, "backend": name, "tokens": q.shape[0],
               "max_context": max(p["context_lens"])}  # fmt: skip
        try:
            if run is None:
                run, got = flex_peer(p, scale)
                rec["max_abs_diff_vs_torch"] = (got.float() - want.float()).abs().max().item()
            elif name == "triton":
                rec["max_abs_diff_vs_torch"] = (run().float() - want.float()).abs().max().item()
            rec["seconds"] = time_fn(run, repeats=3 if q.device.type == "cpu" else 20)
        except Exception as e:  # one backend failing must not hide the others
            rec["error"] = f"{type(e).__name__}: {e}"
        record(out, **rec)


# ------------------------------------------------------------------------------------------ workload


def step_workload(out: Path, shape: str, pipe, **label) -> None:
    """The paper's closed-loop benchmark through the pipeline ``pipe``: normal prompt/output lengths
    (std 0.3 x mean, the paper's 2600/60 shape), clients 1, 4, 16; random prompt ids (the model is
    random). Token budget ``$GPU_CHECK_TOKEN_BUDGET`` (default 2048); ``label``: fields added to each record."""
    import asyncio

    import numpy as np

    from benchmarks.metrics import model_flops_per_token, scale_sla, summarize
    from benchmarks.token_stream import stream_tokens
    from benchmarks.workload import BenchRequest, closed_loop, sample_lengths, send_from_blocking

    cfg = SHAPES[shape]
    tiny = shape == "tiny"
    prompt_mean, output_mean = (2600, 60) if not tiny else (40, 4)
    clients = (1, 4, 16) if not tiny else (1, 2)
    budget = int(os.environ.get("GPU_CHECK_TOKEN_BUDGET", 2048 if not tiny else 32))
    pipe.scheduler.slots["local"].token_budget = budget
    backend = pipe.runner.backend.name
    send = send_from_blocking(lambda r: stream_tokens(pipe, r.prompt_token_ids, r.max_new_tokens))
    sla = scale_sla(factor=1.0)  # an H200 is at least the paper's A100: the paper's thresholds as they are
    flops = model_flops_per_token(pipe.runner.hf_config)
    for n in clients:
        rng = np.random.default_rng(n)
        num = max(4, 2 * n)
        plens = sample_lengths(rng, num, prompt_mean, 0.3, None)
        olens = sample_lengths(rng, num, output_mean, 0.3, None)
        reqs = [
            BenchRequest(rng.integers(3, cfg["vocab_size"], p).tolist(), "", o)
            for p, o in zip(plens, olens, strict=True)
        ]
        asyncio.run(closed_loop(reqs[:1], send, 1))  # warm-up (kernels compile on first use)
        res = asyncio.run(closed_loop(reqs, send, n))
        rec = summarize(res.traces, res.wall_seconds, sla)
        record(out, step="workload", shape=shape, backend=backend, clients=n, requests=num,
               workload=f"{prompt_mean}/{output_mean}", token_budget=budget, flops_per_token=flops,
               **label, **rec)  # fmt: skip


def main(argv: list[str]) -> int:
    step, out = argv[0], Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    root = Path(os.environ.get("GPU_CHECK_MODELS", "/tmp/fuseserve-gpu-check"))
    if step == "env":
        step_env(out)
    elif step == "model":
        step_model(out, argv[2], root, workload=len(argv) > 3 and argv[3] == "workload")
    elif step == "compiled":
        step_compiled(out, argv[2], root)
    elif step == "graphs":
        step_graphs(out, argv[2], root, workload=len(argv) > 3 and argv[3] == "workload")
    elif step == "attention":
        step_attention(out, tiny=len(argv) > 2 and argv[2] == "tiny")
    else:
        raise SystemExit(f"unknown step {step!r}: env, model, compiled, graphs, attention")
    return 0


if __name__ == "__main__":
    # the dry run hides packages the GPU machine lacks, to prove that nothing here needs them
    for name in filter(None, os.environ.get("GPU_CHECK_ABSENT", "").split(",")):
        sys.modules[name] = None  # import raises ImportError; find_spec returns None
    sys.exit(main(sys.argv[1:]))
