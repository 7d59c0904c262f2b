"""Placement by expected completion (``fuseserve.scheduler.placement.expected_finish``) and its use
in ``WaitingQueue.place``: a fast and a 3x-slower worker with given pass-time lines, at light and
heavy load; the estimate grows with every load term; a sequence waits for a faster worker that would
finish it sooner instead of going to a slower one that has room now.
"""

from __future__ import annotations

import pytest

from fuseserve.config import EngineConfig
from fuseserve.sampling_params import SamplingParams
from fuseserve.scheduler.placement import StepTimeModel, expected_finish
from fuseserve.scheduler.scheduler import Scheduler
from fuseserve.scheduler.sequence import Sequence

BUDGET = 256


def line(a: float, b: float) -> StepTimeModel:
    """A step-time model whose fit is ``a + b x tokens`` (seconds)."""
    model = StepTimeModel(refit_every=1)
    for n in (1, 16, 64, 128, 256):
        model.observe(n, a + b * n)
    return model


FAST = (0.010, 0.0001)  # 10 ms a pass + 0.1 ms a token: batching nearly free (the A100 presets' shape)
SLOW = (0.030, 0.0003)  # the same worker 3x slower


def finish(ab, running=0, queued=0, inflight=(), prompt=200, output=64):
    return expected_finish(line(*ab), None, BUDGET, running, queued, list(inflight), prompt, output)


def test_expected_finish_is_the_passes_ahead_the_prefill_and_the_decodes():
    a, b = FAST
    assert finish(FAST) == pytest.approx((a + b * 200) + 63 * (a + b * 1))
    # 4 running: one pass of 4 + 200 tokens, then 63 decodes beside them
    assert finish(FAST, running=4) == pytest.approx((a + b * 204) + 63 * (a + b * 5))
    # 600 queued prompt tokens + 200: (800 / 252) full passes
    assert finish(FAST, running=4, queued=600) == pytest.approx(800 / 252 * (a + b * 256) + 63 * (a + b * 5))
    # a pass under way counts half, the next one in full
    assert finish(FAST, inflight=[100, 50]) == pytest.approx(
        0.5 * (a + b * 100) + (a + b * 50) + finish(FAST)
    )
    assert expected_finish(StepTimeModel(), None, BUDGET, 3, 0, [], 200, 64) == 0.0  # nothing measured
    assert expected_finish(StepTimeModel(), line(*FAST), BUDGET, 0, 0, [], 200, 64) == pytest.approx(
        finish(FAST)
    )


def test_expected_finish_grows_with_the_queue_the_batch_and_the_passes_in_flight():
    for load in ("queued", "running"):
        times = [finish(SLOW, **{load: n}) for n in range(0, 2000, 7)]
        assert all(x < y for x, y in zip(times, times[1:], strict=False)), load
    assert finish(SLOW, inflight=[256]) < finish(SLOW, inflight=[256, 256])


def test_a_fast_worker_wins_at_light_load_and_the_slow_one_once_the_fast_is_loaded():
    # light load: a 3x-slower worker with nothing to do still finishes later than a fast one
    # holding 8 sequences (passes hardly grow with the batch)
    assert finish(FAST, running=8) < finish(SLOW)
    # heavy load: the fast worker's queue of prompts makes it the later finish
    assert finish(FAST, running=150, queued=4000) > finish(SLOW, running=2)


def scheduler(lines: dict[str, tuple[float, float]]) -> Scheduler:
    sched = Scheduler(EngineConfig(token_budget=BUDGET, block_size=16), [])
    for name, ab in lines.items():
        slot = sched.add_worker(name, 1000, 16, 4096)
        slot.step_time = line(*ab)
    return sched


def seq(i: int, prompt: int = 200, output: int = 64) -> Sequence:
    return Sequence(i, [i + 1] + [7] * (prompt - 1), SamplingParams(max_new_tokens=output, ignore_eos=True))


def test_placement_puts_a_sequence_where_it_finishes_soonest():
    sched = scheduler({"fast": FAST, "slow": SLOW})
    for i in range(6):  # light load: every one goes to the fast worker
        sched.add(seq(i))
    plans = sched.schedule()
    assert {sched.seqs[i].worker for i in range(6) if sched.seqs[i].worker} == {"fast"}
    assert "slow" not in plans
    # the fast worker is loaded (its queue a pass deep, many running): the slow one takes the next
    fast = sched.slots["fast"]
    queue = sched.queue
    for i in range(6, 70):
        fast_seq = seq(i)
        sched.add(fast_seq)
        queue.admit(fast, fast_seq)
    late = seq(100)
    sched.add(late)
    assert (
        queue.place(late, [sched.slots["slow"]], elsewhere=True, planning=[sched.slots["slow"]]).name
        == "slow"
    )


def test_a_sequence_waits_for_a_faster_worker_rather_than_go_to_a_slower_one_with_room():
    sched = scheduler({"fast": FAST, "slow": SLOW})
    fast, slow = sched.slots["fast"], sched.slots["slow"]
    queue = sched.queue
    first = seq(0, prompt=300)
    sched.add(first)
    queue.admit(fast, first)  # the fast worker's queue is a pass deep: no candidate now
    nxt = seq(1)
    sched.add(nxt)
    assert queue.place(nxt, [slow], elsewhere=True, planning=[slow]) is None  # it waits for "fast"
    assert queue.place(nxt, [fast, slow], elsewhere=True, planning=[fast, slow]) is fast
    # with the slow worker only, it goes there
    alone = scheduler({"slow": SLOW})
    s = seq(2)
    alone.add(s)
    assert alone.queue.place(s, [alone.slots["slow"]], elsewhere=True, planning=[alone.slots["slow"]])


def test_a_long_queue_behind_sends_the_sequence_to_the_slower_worker_with_room():
    """The queued sequences are alike: placing the first on the slow worker now is as good as placing
    the last there, and with every queued prompt ahead of it the fast worker would finish that one
    later than the slow worker finishes this one."""
    sched = scheduler({"fast": FAST, "slow": SLOW})
    fast, slow = sched.slots["fast"], sched.slots["slow"]
    queue = sched.queue
    first = seq(0, prompt=300)
    sched.add(first)
    queue.admit(fast, first)  # the fast worker's queue is a pass deep: no candidate now
    head = seq(1)
    sched.add(head)
    for i in range(2, 12):  # 10 x 200 queued tokens behind: the fast worker still wins
        sched.add(seq(i))
    assert queue.place(head, [slow], elsewhere=True, planning=[slow]) is None
    for i in range(12, 80):  # 78 behind: its last one would finish sooner on the slow worker
        sched.add(seq(i))
    assert queue.place(head, [slow], elsewhere=True, planning=[slow]) is slow
