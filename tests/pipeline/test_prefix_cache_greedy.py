"""Prefix caching on SmolLM2 (fp32): greedy outputs are identical with caching on and off.

One ``ModelRunner`` serves every engine of this module (each engine starts with an empty block
account, so no cached hash outlives it); the engines run inline (``tests/scheduler_harness.py``).
Cases (issue: automatic prefix caching): 16 requests sharing a 700-token prefix; prefixes sharing
only part of a block; the same prompt twice at once; a sequence preempted and recomputed while it
shares blocks; a sharer aborted in the middle of its prefill; eviction under KV pressure.

Every case but the partly shared block / same prompt twice at once (the quickest, ~35 s on a loaded
2-core machine) is marked ``slow`` (45–210 s each there): the default suite still checks caching end
to end on SmolLM2 with that one; ``./dev.sh test-slow`` runs the rest.
"""

from __future__ import annotations

import pytest
from scheduler_harness import Engine

from fuseserve.config import EngineConfig
from fuseserve.sampling_params import SamplingParams
from fuseserve.scheduler.engine_core import EngineCore
from fuseserve.scheduler.sequence import Sequence

BLOCK = 16
TEXT = (
    "The harbour town woke slowly. Fishermen mended their nets on the quay, the baker opened his "
    "shutters, and gulls argued over the first scraps of the morning. "
)


@pytest.fixture(scope="module")
def runner(smollm2_source):
    from fuseserve.worker.model_runner import ModelRunner

    cfg = EngineConfig(kv_cache_memory="64MiB", dtype="float32", device="cpu", block_size=BLOCK)
    return ModelRunner(
        smollm2_source.path, smollm2_source.config, smollm2_source.eos_token_ids(), cfg, progress=False
    )


@pytest.fixture(scope="module")
def tok(smollm2_source):
    return smollm2_source.load_tokenizer()


def ids(tok, text: str) -> list[int]:
    return tok(text)["input_ids"]


def prefix(tok, n: int) -> list[int]:
    out = ids(tok, TEXT * (1 + n // 20))
    assert len(out) >= n
    return out[:n]


def make(runner, caching: bool, num_blocks: int | None = None, budget: int = 128) -> Engine:
    cfg = EngineConfig(
        token_budget=budget, block_size=BLOCK, enable_prefix_caching=caching, watermark_blocks=1
    )
    core = EngineCore(cfg, runner.info.eos_token_ids, overlap=True)
    blocks = num_blocks or runner.info.num_blocks
    core.add_worker("w", runner, blocks, BLOCK, runner.info.max_model_len, threaded=False)
    return Engine(core, {})


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True).validate()


def finish(eng: Engine, runner) -> None:
    eng.run()
    assert not eng.errors, eng.errors
    assert not runner.seqs  # every sequence freed on the worker
    account = eng.sched.slots["w"].account
    account.check()
    assert account.num_free == account.num_blocks and account.held == {}


def run(runner, prompts: list[list[int]], caching: bool, max_new: int = 4, **kw) -> tuple[dict, Engine]:
    eng = make(runner, caching, **kw)
    for i, p in enumerate(prompts):
        eng.add(Sequence(i, list(p), greedy(max_new)))
    finish(eng, runner)
    return dict(eng.outputs), eng


@pytest.mark.slow
def test_sixteen_requests_sharing_a_700_token_prefix(runner, tok):
    shared = prefix(tok, 700)
    questions = [ids(tok, f" Question {i}: what did person {i} see?") for i in range(4)]
    prompts = [shared + questions[i % 4] for i in range(16)]  # 4 distinct prompts, each sent 4 times
    # the reference runs each distinct prompt once with caching off (greedy fp32 output does not
    # depend on the batch: test_pipeline.py), which keeps this test to ~3k computed tokens
    off, _ = run(runner, prompts[:4], caching=False)
    on, eng = run(runner, prompts, caching=True)
    assert on == {i: off[i % 4] for i in range(16)}
    # the first request computes the prefix; later ones admitted after its blocks were written share them
    assert eng.sched.num_prefix_hits >= 8 * (700 // BLOCK) * BLOCK
    assert sum(1 for s in eng.seqs.values() if s.num_cached_tokens >= (700 // BLOCK) * BLOCK) >= 8


def test_prefixes_sharing_part_of_a_block_and_the_same_prompt_twice_at_once(runner, tok):
    base = prefix(tok, 3 * BLOCK + 8)  # 3 full blocks + 8 tokens
    first = base + ids(tok, " The end.")
    partial = base[: 2 * BLOCK + 5] + ids(tok, " Then a storm came in from the west.")  # shares 2.3 blocks
    twin = prefix(tok, 90) + ids(tok, " Twice:")
    off, _ = run(runner, [first, partial, twin, twin], caching=False)
    eng = make(runner, caching=True, budget=256)
    eng.add(Sequence(0, first, greedy(4)))
    eng.run()
    for i, p in enumerate([partial, twin, twin], start=1):  # the twins arrive together
        eng.add(Sequence(i, p, greedy(4)))
    finish(eng, runner)
    assert dict(eng.outputs) == off
    assert eng.seqs[1].num_cached_tokens == 2 * BLOCK  # the partly shared block is never shared
    # the twins start with the text of ``first``: both share its 3 full blocks, not each other's
    # (they run in the same pass, where neither block is written yet)
    assert eng.seqs[2].num_cached_tokens == eng.seqs[3].num_cached_tokens == 3 * BLOCK


@pytest.mark.slow
def test_preempted_while_sharing_and_eviction_under_kv_pressure(runner, tok):
    shared = prefix(tok, 6 * BLOCK)
    prompts = [shared + ids(tok, f" Story {i} begins with a") for i in range(6)]
    prompts += [prefix(tok, 40 + 7 * i)[::-1] for i in range(3)]  # unrelated prompts compete for blocks
    off, _ = run(runner, prompts, caching=False, max_new=12)
    on, eng = run(runner, prompts, caching=True, max_new=12, num_blocks=16, budget=64)
    assert on == off
    assert eng.sched.num_preemptions > 0  # recomputed while sharing the prefix's blocks
    assert eng.sched.slots["w"].account.num_evictions > 0  # cached blocks were evicted to make room
    assert eng.sched.num_prefix_hits > 0


@pytest.mark.slow
def test_sharer_aborted_in_the_middle_of_its_prefill(runner, tok):
    shared = prefix(tok, 8 * BLOCK)
    owner = shared + ids(tok, " First:")
    sharer = shared + prefix(tok, 200)[::-1]  # a long own part: its prefill spans several passes
    late = shared + ids(tok, " Last:")
    off, _ = run(runner, [owner, late], caching=False, max_new=8)
    eng = make(runner, caching=True, budget=64)
    eng.add(Sequence(0, owner, greedy(8)))
    while not eng.outputs.get(0):
        eng.step()
    eng.add(Sequence(2, sharer, greedy(8)))
    while eng.sched.seqs[2].num_computed_tokens <= eng.sched.seqs[2].num_start_tokens + 64:
        eng.step()
    assert eng.sched.seqs[2].num_start_tokens == 8 * BLOCK and eng.sched.seqs[2].in_prefill
    eng.core.abort(2)
    eng.add(Sequence(1, late, greedy(8)))
    finish(eng, runner)
    assert {k: v for k, v in eng.outputs.items() if k != 2} == off
    assert eng.seqs[1].num_cached_tokens == 8 * BLOCK
