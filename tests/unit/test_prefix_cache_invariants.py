"""Prefix-cache invariants over random workloads on fake workers (``tests/fake_worker.py``).

Every step, on every worker: reference counts equal the table references, the free count is exact
and no referenced block is free (``BlockAccount.check``); the fake worker checks that a cache hit
finds exactly the prefix's tokens in the shared blocks and that no pass writes into a block another
live sequence holds (a block freed or reused while referenced). Every output equals the request's
output alone, and after every request ends nothing leaks.
"""

from __future__ import annotations

import random

import pytest
from scheduler_harness import check_free, greedy, make_engine, solo_output

from fuseserve.scheduler.sequence import FinishReason, Sequence


def shared_prefix_workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    """``n`` requests: most continue one of three prefixes (some cut mid-block), some repeat a
    whole earlier prompt, some are fresh."""
    rng = random.Random(seed)
    bases = [[rng.randint(1, 999) for _ in range(rng.randint(8, 40))] for _ in range(3)]
    out: list[tuple[list[int], int]] = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.6:
            base = rng.choice(bases)
            prompt = base[: rng.randint(1, len(base))] + [
                rng.randint(1, 999) for _ in range(rng.randint(0, 12))
            ]
        elif kind < 0.8 and out:
            prompt = list(rng.choice(out)[0])
        else:
            prompt = [rng.randint(1, 999) for _ in range(rng.randint(1, 30))]
        out.append((prompt or [1], rng.randint(1, 24)))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_random_shared_prefix_workloads_keep_the_invariants(seed, overlap):
    rng = random.Random(1000 + seed)
    workers = {"w0": 40} if seed % 2 else {"w0": 30, "w1": 30}  # small pools: eviction and preemption
    eng = make_engine(budget=rng.choice([8, 16, 32]), workers=workers, eos_every=29, overlap=overlap)
    reqs = shared_prefix_workload(40, seed)
    pending = list(enumerate(reqs))
    aborted: set[int] = set()

    def check(plans, before):
        for slot in eng.sched.slots.values():
            slot.account.check()

    while pending or eng.sched.has_work:
        for _ in range(rng.randint(0, 3)):  # requests arrive over time
            if pending:
                i, (p, n) = pending.pop(0)
                eng.add(Sequence(i, p, greedy(n)))
        if eng.sched.seqs and rng.random() < 0.05:  # a client goes away, maybe mid-prefill
            victim = rng.choice(sorted(eng.sched.seqs))
            eng.core.abort(victim)
            aborted.add(victim)
        if eng.sched.has_work:
            check(*eng.step())
    for i, (p, n) in enumerate(reqs):
        if i in aborted:
            continue
        assert eng.finish[i] in (FinishReason.STOP, FinishReason.LENGTH), i
        assert eng.outputs[i] == solo_output(p, greedy(n), eos_every=29), i
    # hits the workers served (a sequence preempted or aborted before its first chunk served none)
    assert 0 < sum(f.num_prefix_tokens for f in eng.fakes.values()) <= eng.sched.num_prefix_hits
    check_free(eng)
    for slot in eng.sched.slots.values():
        slot.account.check()


def test_cached_tokens_count_as_computed_and_salts_isolate():
    eng = make_engine(budget=64, block_size=4)
    prompt = list(range(1, 31))  # 7 full blocks + 2 tokens
    eng.add(Sequence(0, prompt, greedy(3)))
    eng.run()
    for sid, salt in ((1, None), (2, "tenant-b"), (3, "tenant-b")):
        eng.add(Sequence(sid, list(prompt), greedy(3), cache_salt=salt))
        eng.run()
    got = {sid: s.num_cached_tokens for sid, s in eng.seqs.items()}
    assert got == {0: 0, 1: 28, 2: 0, 3: 28}  # at most 7 blocks: the last token must run
    first_chunks = [c for p in eng.fakes["w0"].plans for c in p.chunks if c.params is not None]
    assert [c.start_pos for c in first_chunks] == [0, 28, 0, 28]
    assert all(eng.outputs[i] == eng.outputs[0] for i in range(4))
    check_free(eng)


def test_prompt_logprobs_requests_take_no_prefix_hit():
    """A cached position is not computed, so it would have no prompt logprobs: a request asking for
    them starts from position 0 (as vLLM does); its own blocks still serve later requests."""
    eng = make_engine(budget=64, block_size=4)
    prompt = list(range(1, 31))
    eng.add(Sequence(0, prompt, greedy(3)))
    eng.run()
    eng.add(Sequence(1, list(prompt), greedy(3, prompt_logprobs=1)))
    eng.run()
    eng.add(Sequence(2, list(prompt), greedy(3)))
    eng.run()
    assert {sid: s.num_cached_tokens for sid, s in eng.seqs.items()} == {0: 0, 1: 0, 2: 28}
    first_chunks = [c for p in eng.fakes["w0"].plans for c in p.chunks if c.params is not None]
    assert [c.start_pos for c in first_chunks] == [0, 0, 28]
    assert eng.outputs[1] == eng.outputs[2] == eng.outputs[0]
    assert eng.sched.num_prefix_queries == 2 * len(prompt)  # no lookup for sequence 1
    assert eng.sched.num_prefix_hits == 28
    check_free(eng)


def test_placement_follows_the_prefix_until_the_load_is_unbalanced():
    eng = make_engine(budget=64, block_size=4, workers={"w0": 1000, "w1": 1000})
    shared = list(range(1, 41))
    eng.add(Sequence(0, [7] * 5, greedy(200)))  # w0 gets a long unrelated sequence
    eng.step()
    eng.add(Sequence(1, shared + [50], greedy(200)))
    eng.step()
    assert eng.sched.seqs[0].worker == "w0" and eng.sched.seqs[1].worker == "w1"
    for _ in range(3):
        eng.step()  # the prefix is computed and cached on w1
    for sid in range(2, 12):  # sharers follow the prefix to w1 while its load stays near w0's
        eng.add(Sequence(sid, shared + [50 + sid], greedy(200)))
        eng.step()
    on = {sid: eng.sched.seqs[sid].worker for sid in range(2, 12)}
    assert on[2] == "w1" and eng.sched.seqs[2].num_cached_tokens == 40
    assert "w0" in on.values(), "one hot prefix must not pile every sequence onto one worker"
    n1 = sum(1 for s in eng.sched.seqs.values() if s.worker == "w1")
    assert n1 <= 1.5 * (len(eng.sched.seqs) - n1 + 1) + 2


def test_a_failed_plan_takes_its_cached_blocks_back():
    """Blocks are cached when the plan that fills them is built; when that plan fails, a later
    request with the same prompt must not share them (the fake worker checks their contents)."""
    prompt = list(range(1, 41))
    eng = make_engine(budget=16, block_size=4, fail_at={"w0": 1})
    eng.fakes["w0"].fail_with = ValueError
    eng.add(Sequence(0, prompt, greedy(3)))
    eng.step()  # plan 0: tokens 0..16, cached at once
    assert eng.sched.slots["w0"].account.cached
    eng.step()  # plan 1 (tokens 16..32) fails: sequence 0 ends with an error
    assert 0 in eng.errors
    eng.add(Sequence(1, prompt, greedy(3)))
    eng.run()
    assert eng.seqs[1].num_cached_tokens == 16  # plan 0 ran: its blocks stay shared, plan 1's do not
    assert eng.outputs[1] == solo_output(prompt, greedy(3), eos_every=0)
    check_free(eng)
