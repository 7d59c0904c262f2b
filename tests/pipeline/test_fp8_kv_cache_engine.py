"""``pipeline(kv_cache_dtype="fp8")`` end to end on a tiny LLaMA (GQA): capacity, preemption, prefix
caching and tensor parallelism with an fp8 KV cache.

Capacity, counted, not timed: the same ``kv_cache_memory`` holds twice the blocks of a bf16 cache. The
workload: ``n`` requests at once, each a 10-token prompt (one block of 16) growing to 32 tokens (two
blocks). All are admitted (one block each, plus the watermark), then every one needs its second
block at the same step, so ``n`` run without a preemption exactly while ``2 n`` blocks fit: with P
blocks the largest such ``n`` is P / 2. The scheduler's preemption counter shows the bf16 pool (8
blocks) takes 4 requests and preempts at 5, the fp8 pool in the same memory (16 blocks) takes 8 and
preempts at 9.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_checkpoint

import fuseserve
from fuseserve.kernels import kv_quant
from fuseserve.worker.kv_cache import bytes_per_block

PROMPT_LEN, NEW_TOKENS, BLOCK = 10, 22, 16  # one block at admission, two at the end
BF16_BLOCKS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-gqa-fp8kv")
    _, config = tiny_checkpoint("llama-gqa", path)
    head_dim = config.hidden_size // config.num_attention_heads
    per_block = bytes_per_block(
        config.num_hidden_layers, BLOCK, config.num_key_value_heads, head_dim, torch.bfloat16
    )
    return path, BF16_BLOCKS * per_block


def _pipe(model, kv_cache_dtype: str, **kw):
    path, memory = model
    return fuseserve.pipeline(
        str(path),
        token_budget=64,
        kv_cache_memory=memory,
        dtype="bfloat16",
        device="cpu",
        progress=False,
        prefix_caching=False,
        kv_cache_dtype=kv_cache_dtype,
        **kw,
    )


def _preemptions(pipe, n: int) -> int:
    """Preemptions while ``n`` distinct requests of the workload run together."""
    g = torch.Generator().manual_seed(n)
    prompts = [torch.randint(3, 200, (PROMPT_LEN,), generator=g).tolist() for _ in range(n)]
    before = pipe.scheduler.num_preemptions
    out = pipe(prompts, max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert all(len(r.token_ids) == NEW_TOKENS for r in out)
    return pipe.scheduler.num_preemptions - before


def test_fp8_pool_admits_twice_the_sequences_before_preemption(model):
    found = {}
    for kv in ("auto", "fp8"):
        with _pipe(model, kv) as pipe:
            assert pipe.runner.kv_cache.k[0].dtype == (kv_quant.FP8 if kv == "fp8" else torch.bfloat16)
            blocks = pipe.runner.info.num_blocks
            fits = blocks // 2
            found[kv] = (blocks, fits, _preemptions(pipe, fits), _preemptions(pipe, fits + 1))
    print(f"blocks, requests without preemption, preemptions at that load and one more: {found}")
    assert found["auto"][0] == BF16_BLOCKS and found["fp8"][0] == 2 * BF16_BLOCKS
    for blocks, fits, at_fit, over in found.values():
        assert at_fit == 0 and over > 0, (blocks, fits, at_fit, over)
    assert found["fp8"][1] == 2 * found["auto"][1]


def test_fp8_with_prefix_caching_and_two_ranks_equals_one_rank(model):
    """A shared prefix served from cached fp8 blocks, and 2 ranks (each its own fp8 cache of its KV
    heads) greedy-decode as one rank with prefix caching off."""
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 200, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 200, (n,), generator=g).tolist() for n in (3, 9, 17)]
    outs = {}
    for name, kw in {
        "one": {},
        "prefix": dict(prefix_caching=True),
        "tp2": dict(tensor_parallel_size=2, prefix_caching=True),
    }.items():
        kw.setdefault("prefix_caching", False)
        path, memory = model
        with fuseserve.pipeline(
            str(path),
            token_budget=16,
            kv_cache_memory=4 * memory,
            dtype="float32",
            device="cpu",
            progress=False,
            kv_cache_dtype="fp8",
            **kw,
        ) as pipe:
            outs[name] = [pipe([p], max_new_tokens=8, temperature=0.0)[0].token_ids for p in prompts]
    assert all(len(t) == 8 for t in outs["one"])
    assert outs["prefix"] == outs["one"]
    assert outs["tp2"] == outs["one"]
