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
