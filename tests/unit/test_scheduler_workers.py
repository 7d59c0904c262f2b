"""Scheduler under KV-pool pressure and across workers, on CPU with cost-free fake workers
(``tests/scheduler_harness.py``).

A small KV pool preempts (rule 3) with and without a cap, and every request still ends with the
output it gets alone; a recompute cut one token short of its end; placement on the least-loaded of
two workers; a removed or failing worker's sequences finish elsewhere; a failed plan fails only its
own sequences.
"""

from __future__ import annotations

import pytest
from scheduler_harness import check_free, greedy, make_engine, solo_output, workload

from fuseserve.scheduler.sequence import SeqStatus, Sequence

# ------------------------------------------------------------------------------------- preemption


@pytest.mark.parametrize("workers", [{"w0": 80}, {"w0": 40, "w1": 40}], ids=["one_worker", "two_workers"])
@pytest.mark.parametrize("max_preemptions", [0, 1, 4])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_small_kv_pool_preempts_and_every_request_finishes(workers, max_preemptions, overlap):
    # 32 requests of up to 40 + 40 tokens (20 blocks of 4): the pool holds about 4 at a time
    eng = make_engine(
        budget=32, workers=workers, max_preemptions=max_preemptions, eos_every=31, overlap=overlap
    )
    reqs = workload(32, seed=11, prompt_range=(20, 40), new_range=(20, 40))
    for i, (p, n) in enumerate(reqs):
        eng.add(Sequence(i, p, greedy(n)))

    def on_step(plans, before):
        for plan in plans.values():
            assert plan.num_tokens <= 32
        for slot in eng.sched.slots.values():  # reference counts and the free count are exact
            slot.account.check()  # (the fake worker checks no block is written while another holds it)

    eng.run(on_step)
    assert sorted(eng.finish) == list(range(32))
    assert eng.sched.num_preemptions > 0
    if max_preemptions == 0:  # only preemptions that break a deadlock (every sequence waits for a block)
        assert eng.sched.num_forced_preemptions == eng.sched.num_preemptions
    else:
        assert eng.sched.num_forced_preemptions == 0
        assert max(s.num_preemptions for s in eng.seqs.values()) <= max_preemptions
    assert sum(s.num_preemptions for s in eng.seqs.values()) == eng.sched.num_preemptions
    for i, (p, n) in enumerate(reqs):
        assert eng.outputs[i] == solo_output(p, greedy(n), eos_every=31), i
    check_free(eng)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_recompute_cut_one_token_short_of_its_end(overlap):
    """A recompute whose first chunk stops one token short of its known tokens: the last token
    is a generated one the (fresh) worker never sampled, so it must travel with the plan."""
    eng = make_engine(budget=12, overlap=overlap)
    prompt = list(range(1, 11))
    eng.add(Sequence(0, prompt, greedy(8)))
    while len(eng.outputs[0]) < 3:
        eng.step()
    seq = eng.seqs[0]
    assert seq.num_tokens == 13 or (overlap and seq.num_tokens == 13 + seq.num_pending - 1)
    eng.sched.preempt(eng.sched.slots["w0"], seq)
    eng.run()
    assert eng.outputs[0] == solo_output(prompt, greedy(8), eos_every=0)
    assert seq.num_preemptions == 1
    check_free(eng)


# ------------------------------------------------------------------------------------- two workers


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_two_workers_spread_sequences(overlap):
    eng = make_engine(budget=32, workers={"w0": 500, "w1": 500}, eos_every=19, overlap=overlap)
    reqs = workload(20, seed=23)
    for i, (p, n) in enumerate(reqs):
        eng.add(Sequence(i, p, greedy(n)))
    placed = {}

    def on_step(plans, before):
        for name, plan in plans.items():
            assert plan.num_tokens <= 32
            for c in plan.chunks:
                assert placed.setdefault(c.seq_id, name) == name, "a sequence changed worker"

    eng.run(on_step)
    counts = {name: sum(1 for w in placed.values() if w == name) for name in ("w0", "w1")}
    assert counts["w0"] >= 5 and counts["w1"] >= 5, counts
    for i, (p, n) in enumerate(reqs):
        assert eng.outputs[i] == solo_output(p, greedy(n), eos_every=19), i
    check_free(eng)


def test_placement_goes_to_least_loaded_worker():
    # blocks of 16 tokens; 4 new tokens never cross a block boundary here, so counts stay exact
    eng = make_engine(budget=256, workers={"w0": 100, "w1": 100}, block_size=16)
    eng.add(Sequence(0, [1] * 150, greedy(4)))  # 10 blocks
    eng.step()
    first = eng.seqs[0].worker
    other = "w1" if first == "w0" else "w0"
    eng.add(Sequence(1, [2] * 100, greedy(4)))  # 7 blocks: to the emptier worker
    eng.step()
    assert eng.seqs[1].worker == other
    eng.add(Sequence(2, [3] * 20, greedy(4)))  # 2 blocks: `other` holds 7, `first` 10
    eng.step()
    assert eng.seqs[2].worker == other
    eng.add(Sequence(3, [4] * 20, greedy(4)))  # `other` holds 9 → 11 after this one
    eng.add(Sequence(4, [5] * 100, greedy(4)))  # `first` holds 10 < 11: goes there
    eng.step()
    assert eng.seqs[3].worker == other
    assert eng.seqs[4].worker == first
    eng.run()
    check_free(eng)
    # placement compares free blocks in proportion: a bigger worker takes more
    eng = make_engine(budget=1024, workers={"small": 50, "big": 400}, block_size=16)
    for i in range(8):
        eng.add(Sequence(i, [1] * 150, greedy(2)))  # 10 blocks each
    eng.step()
    placed = [eng.seqs[i].worker for i in range(8)]
    assert placed.count("big") == 7 and placed.count("small") == 1, placed


@pytest.mark.parametrize("how", ["remove_worker", "worker_fails"])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_removed_worker_sequences_finish_elsewhere(how, overlap):
    reqs = workload(16, seed=29, prompt_range=(10, 60), new_range=(10, 30))
    fail_at = {"w1": 6} if how == "worker_fails" else None
    eng = make_engine(
        budget=32, workers={"w0": 1000, "w1": 1000}, eos_every=37, fail_at=fail_at, overlap=overlap
    )
    for i, (p, n) in enumerate(reqs):
        eng.add(Sequence(i, p, greedy(n)))
    for _ in range(6):
        eng.step()
    on_w1 = {s.seq_id for s in eng.sched.slots["w1"].running}
    assert on_w1, "nothing ran on w1"
    if how == "remove_worker":
        moved = eng.core.remove_worker("w1")
        assert {s.seq_id for s in moved} == on_w1
        assert all(s.status is SeqStatus.WAITING and s.num_computed_tokens == 0 for s in moved)
        assert eng.core.take_lost() == {}  # removed by its owner, who holds its handle
    else:
        for _ in range(20):  # w1 raises at its 7th plan; the loop drops it
            if "w1" not in eng.sched.slots:
                break
            eng.step()
        assert set(eng.sched.slots) == {"w0"} and set(eng.core.workers) == {"w0"}
        # the lost worker's handle goes to its owner once (to close it), held nowhere else
        assert eng.core.take_lost() == {"w1": eng.fakes["w1"]} and eng.core.take_lost() == {}
    del eng.fakes["w1"]
    eng.run()
    assert sorted(eng.finish) == list(range(16))
    assert on_w1 <= eng.fakes["w0"].seen_seq_ids
    for i, (p, n) in enumerate(reqs):
        assert eng.outputs[i] == solo_output(p, greedy(n), eos_every=37), i
    check_free(eng)


def test_failed_plan_fails_only_its_sequences_and_the_worker_stays():
    """A step that raises something other than WorkerLostError (a plan the worker rejected) finishes
    exactly that plan's sequences with an error; the worker keeps serving the others."""
    reqs = workload(12, seed=31, prompt_range=(10, 40), new_range=(5, 20))
    eng = make_engine(budget=32, workers={"w0": 1000, "w1": 1000}, eos_every=0, fail_at={"w1": 3})
    eng.fakes["w1"].fail_with = ValueError
    for i, (p, n) in enumerate(reqs):
        eng.add(Sequence(i, p, greedy(n)))
    failed_plan = None
    for _ in range(4):
        plans, _ = eng.step()
        if "w1" in plans and eng.fakes["w1"].num_steps == 4:
            failed_plan = {c.seq_id for c in plans["w1"].chunks}
    assert failed_plan and set(eng.errors) == failed_plan
    assert all("ValueError" in e for e in eng.errors.values())
    assert "w1" in eng.core.workers and "w1" in eng.sched.slots
    eng.run()
    assert set(eng.finish) == set(range(len(reqs)))
    assert all(len(eng.outputs[i]) == reqs[i][1] for i in range(len(reqs)) if i not in failed_plan)
    for name, fake in eng.fakes.items():
        assert fake.num_free_blocks == fake.num_blocks, name
        assert eng.sched.slots[name].account.num_free == eng.sched.slots[name].account.num_blocks


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_draining_worker_gets_no_new_sequences_and_finishes_its_own(overlap):
    """``EngineCore.drain_worker``: sequences running on the draining worker finish there; every
    sequence admitted after the notice (new ones, and recomputes) goes to the other worker."""
    reqs = workload(16, seed=31, prompt_range=(10, 60), new_range=(10, 30))
    eng = make_engine(budget=32, workers={"w0": 1000, "w1": 1000}, eos_every=37, overlap=overlap)
    for i, (p, n) in enumerate(reqs[:8]):
        eng.add(Sequence(i, p, greedy(n)))
    for _ in range(3):
        eng.step()
    on_w1 = {s.seq_id for s in eng.sched.slots["w1"].running}
    assert on_w1, "nothing ran on w1"
    assert eng.core.drain_worker("w1") and not eng.core.drain_worker("w1")
    seen_before = set(eng.fakes["w1"].seen_seq_ids)
    for i, (p, n) in enumerate(reqs[8:], start=8):
        eng.add(Sequence(i, p, greedy(n)))
    eng.run()
    assert sorted(eng.finish) == list(range(16))
    assert eng.fakes["w1"].seen_seq_ids == seen_before  # nothing new was placed on w1
    assert on_w1 <= eng.fakes["w1"].seen_seq_ids
    assert set(range(8, 16)) <= eng.fakes["w0"].seen_seq_ids
    for i, (p, n) in enumerate(reqs):
        assert eng.outputs[i] == solo_output(p, greedy(n), eos_every=37), i
    check_free(eng)
    assert eng.core.remove_worker("w1") == []  # drained: nothing left to hand back


def test_step_time_fit_refreshes_every_refit_every_samples():
    """The line is fitted on read, from the samples of its last refresh (the first sample, then
    every ``refit_every``-th): later samples wait for the next refresh."""
    from fuseserve.scheduler.placement import StepTimeModel

    model = StepTimeModel(window=64, refit_every=4)
    assert model.seconds(10) is None
    model.observe(10, 0.01)
    assert model.seconds(10) == pytest.approx(0.01)  # one size seen: time proportional to tokens
    for tokens in (20, 30, 40, 50):  # the 5th sample refreshes: 10..50 tokens at 1 ms per token
        model.observe(tokens, tokens * 1e-3)
    model.observe(60, 1.0)  # not in the line until the next refresh
    assert model.seconds(100) == pytest.approx(0.1)
    for _ in range(3):
        model.observe(60, 1.0)
    assert model.seconds(100) > 0.5
