"""Rebalancing by KV migration (``--migration balance``, ``services/scheduler/rebalance.py``): the
queue-delay estimate, which sequences move where, and the whole round over fake workers that report
pass times (a worker 3x slower than the other): sequences placed on the slow worker before the fast
one joined move to it with their K/V, tokens unchanged, nothing recomputed, the accounts exact."""

from __future__ import annotations

from fake_worker import MovingWorker

from fuseserve.config import EngineConfig
from fuseserve.sampling_params import SamplingParams
from fuseserve.scheduler.block_accounting import BlockAccount
from fuseserve.scheduler.engine_core import EngineCore
from fuseserve.scheduler.placement import StepTimeModel, finish_times
from fuseserve.scheduler.rebalance import plan_rebalance
from fuseserve.scheduler.sequence import Sequence
from fuseserve.scheduler.worker_slot import MigrationPhase, WorkerSlot

BS = 4


def _model(a: float, b: float) -> StepTimeModel:
    m = StepTimeModel(refit_every=2)
    for n in (1, 8, 32):  # the third sample refreshes the fit
        m.observe(n, a + b * n)
    return m


def test_finish_times_walks_the_shrinking_batch():
    m = _model(1.0, 0.0)  # every pass 1 s
    assert finish_times(m, None, 32, 0, [5, 3]) == [3.0, 5.0]  # 3 passes of 2, then 2 of 1
    m = _model(0.0, 1.0)  # a pass of n tokens takes n s
    assert finish_times(m, None, 32, 0, [5, 3]) == [3 * 2, 3 * 2 + 2 * 1]
    assert finish_times(m, None, 32, 62, [1, 1]) == [62 / 30 * 32 + 2] * 2  # prompts in full passes
    assert finish_times(StepTimeModel(), None, 32, 60, [4]) == [0.0]  # nothing measured: no information
    assert finish_times(StepTimeModel(), m, 32, 0, [4]) == [4]  # the fallback's line


def _slot(name: str, model: StepTimeModel, outputs: list[int]) -> WorkerSlot:
    slot = WorkerSlot(name, BlockAccount(256, BS), token_budget=32, max_model_len=4096, step_time=model)
    for i, n in enumerate(outputs):
        seq = Sequence(hash((name, i)) % 10_000, [7] * 8, SamplingParams(max_new_tokens=n, ignore_eos=True))
        seq.num_computed_tokens = seq.num_start_tokens = 0
        seq.output_token_ids = [1]  # one generated: decoding
        seq.num_computed_tokens = seq.num_tokens - 1
        slot.account.reserve(seq.seq_id, seq.num_tokens)
        slot.running.append(seq)
    return slot


def test_the_longest_to_run_move_from_the_slow_worker_until_the_delays_even_out():
    config = EngineConfig(token_budget=32, block_size=BS, migration="balance", balance_threshold=1.0)
    slow = _slot("slow", _model(0.3, 0.03), [40, 10, 100, 20, 60, 80])
    fast = _slot("fast", _model(0.1, 0.01), [])
    source, moves = plan_rebalance(config, [slow, fast])
    assert source is slow and set(moves.values()) == {"fast"}
    left = {s.seq_id: s.params.max_new_tokens - 1 for s in slow.running}
    moved = sorted((left[i] for i in moves), reverse=True)
    assert moved == sorted(left.values(), reverse=True)[: len(moved)]  # the longest to run first

    def finishes(slot, gone=(), come=()):
        outputs = [left[s.seq_id] for s in slot.running if s.seq_id not in gone] + list(come)
        return finish_times(slot.step_time, None, 32, 0, outputs)

    before = finishes(slow) + finishes(fast)
    after = finishes(slow, gone=moves) + finishes(fast, come=[left[i] for i in moves])
    assert max(after) < max(before) / 2 and sum(after) < sum(before) / 2
    # two equal workers whose pass time grows with the batch: half the sequences move
    a, b = _slot("a", _model(0.1, 0.01), [30] * 6), _slot("b", _model(0.1, 0.01), [])
    assert len(plan_rebalance(config, [a, b])[1]) == 3


def test_within_the_threshold_nothing_moves():
    config = EngineConfig(token_budget=32, block_size=BS, migration="balance", balance_threshold=100.0)
    slow = _slot("slow", _model(0.3, 0.0), [40, 10, 100])
    fast = _slot("fast", _model(0.1, 0.0), [])
    assert plan_rebalance(config, [slow, fast]) is None
    even = EngineConfig(token_budget=32, block_size=BS, migration="balance", balance_threshold=0.0)
    a, b = _slot("a", _model(0.1, 0.0), [30]), _slot("b", _model(0.1, 0.0), [30])
    assert plan_rebalance(even, [a, b]) is None  # equal delays: nothing to even out
    c = _slot("c", _model(0.1, 0.0), [30, 30])
    assert plan_rebalance(even, [c, b]) is None  # a pass's time does not grow with its batch: no gain


def test_sequences_on_the_slow_worker_move_to_a_fast_one_that_joins():
    """All sequences start on w0 (3x slower); w1 joins; with ``balance`` some move there with their
    K/V and every sequence ends with the tokens of an undisturbed run."""
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)

    def run(migration: str) -> tuple[EngineCore, list[Sequence], dict]:
        history: dict = {}
        config = EngineConfig(token_budget=32, block_size=BS, migration=migration, balance_threshold=0.5)
        core = EngineCore(config, eos_token_ids=[])
        core.scheduler.migrations.balance_interval = 0.0  # consider it at every step: no wall time
        workers = {
            "w0": MovingWorker(
                num_blocks=128, block_size=BS, name="w0", history=history, pass_seconds=(0.3, 0.03)
            ),
            "w1": MovingWorker(
                num_blocks=128, block_size=BS, name="w1", history=history, pass_seconds=(0.1, 0.01)
            ),
        }
        core.add_worker("w0", workers["w0"], 128, BS, 1 << 12, threaded=False)
        seqs = [Sequence(i, [5 + i] * (6 + 3 * i), params) for i in range(6)]
        for s in seqs:
            core.add_request(s)
        slot = core.scheduler.slots["w0"]
        while not (len(slot.running) == 6 and all(len(s.output_token_ids) >= 2 for s in slot.running)):
            core.step()
        core.add_worker("w1", workers["w1"], 128, BS, 1 << 12, threaded=False)
        for _ in range(500):
            if not core.has_work:
                break
            core.step()
        return core, seqs, workers

    core_off, seqs_off, _ = run("off")
    core, seqs, workers = run("balance")
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in seqs_off]
    sched = core.scheduler
    assert core_off.scheduler.num_migrated == 0
    assert sched.num_migrated >= 1 and sched.totals().num_rebalanced == sched.num_migrated
    assert sched.num_recomputed_tokens == 0
    assert all(s.migration is MigrationPhase.NONE for s in sched.slots.values())
    assert not any(w.errors for w in workers.values())
    for slot in sched.slots.values():
        slot.account.check()


def test_a_worker_never_measured_gets_one_sequence_to_learn_its_speed():
    """Its line is another's: with passes whose time does not grow with the batch no move gains,
    yet it gets the longest sequence; once measured, the usual rule applies."""
    config = EngineConfig(token_budget=32, block_size=BS, migration="balance", balance_threshold=1.0)
    busy = _slot("busy", _model(0.3, 0.0), [40, 100, 60])
    joined = _slot("joined", StepTimeModel(), [])
    source, moves = plan_rebalance(config, [busy, joined])
    longest = max(busy.running, key=lambda s: s.params.max_new_tokens)
    assert source is busy and moves == {longest.seq_id: "joined"}
    measured = _slot("measured", _model(0.3, 0.0), [])
    assert plan_rebalance(config, [busy, measured]) is None
