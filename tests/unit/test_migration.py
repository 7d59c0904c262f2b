"""KV migration, the scheduler's side (``services/scheduler/migration.py``) over fake workers that
move their sequences' state and slots the way ``Migrate`` does: a draining worker's decoding
sequences continue on the other worker with no recompute and the same tokens; the block accounts stay
exact; an abort while a move is in flight, a failed move and migration off behave."""

from __future__ import annotations

from fake_worker import MovingWorker

from fuseserve.config import EngineConfig
from fuseserve.sampling_params import SamplingParams
from fuseserve.scheduler.engine_core import EngineCore
from fuseserve.scheduler.sequence import Sequence
from fuseserve.scheduler.worker_slot import MigrationPhase

BS = 4
PARAMS = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def _core(
    migration: str = "drain", lora_adapters: dict[str, set[str]] | None = None
) -> tuple[EngineCore, dict[str, MovingWorker]]:
    history: dict = {}
    workers = {n: MovingWorker(num_blocks=64, block_size=BS, name=n, history=history) for n in ("w0", "w1")}
    core = EngineCore(EngineConfig(token_budget=32, block_size=BS, migration=migration), eos_token_ids=[])
    for name, w in workers.items():
        adapters = None if lora_adapters is None else lora_adapters[name]
        core.add_worker(name, w, 64, BS, 1 << 12, threaded=False, lora_adapters=adapters)
    return core, workers


def _reference() -> dict[int, list[int]]:
    core, _ = _core()
    return _run(core, _requests(core))


def _requests(core: EngineCore) -> list[Sequence]:
    seqs = [Sequence(i, [5 + i] * (6 + 3 * i), PARAMS) for i in range(6)]
    for s in seqs:
        core.add_request(s)
    return seqs


def _run(core: EngineCore, seqs, until=None, steps: int = 500) -> dict[int, list[int]]:
    for _ in range(steps):
        if until is not None and until():
            break
        if not core.has_work:
            break
        core.step()
    return {s.seq_id: list(s.output_token_ids) for s in seqs}


def _decoding(core: EngineCore, name: str) -> bool:
    running = core.scheduler.slots[name].running
    return len(running) >= 2 and all(not s.in_prefill and len(s.output_token_ids) >= 2 for s in running)


def test_a_draining_workers_sequences_move_and_finish_with_the_same_tokens():
    want = _reference()
    core, workers = _core()
    seqs = _requests(core)
    _run(core, seqs, until=lambda: _decoding(core, "w0"))
    moving = {s.seq_id for s in core.scheduler.slots["w0"].running}
    core.drain_worker("w0")
    got = _run(core, seqs)
    assert got == want
    sched = core.scheduler
    assert sched.num_migrated == len(moving) and sched.num_recomputed_tokens == 0
    assert sched.slots["w0"].migration is MigrationPhase.DONE and not sched.slots["w0"].running
    assert not any(w.errors for w in workers.values())  # every plan kept the contract
    for slot in sched.slots.values():
        slot.account.check()


def test_an_abort_while_the_move_is_in_flight_frees_the_sequence_on_the_destination():
    core, workers = _core()
    seqs = _requests(core)
    _run(core, seqs, until=lambda: _decoding(core, "w0"))
    victim = core.scheduler.slots["w0"].running[0]
    workers["w0"].hold = True
    core.drain_worker("w0")
    _run(core, seqs, until=lambda: core.scheduler.slots["w0"].migration is not MigrationPhase.NONE)
    assert core.scheduler.slots["w0"].migration is MigrationPhase.MOVING  # the answer is held
    core.abort(victim.seq_id)
    workers["w0"].release()
    _run(core, seqs)
    assert victim.seq_id not in workers["w1"].seqs  # freed there with w1's next plan
    for slot in core.scheduler.slots.values():
        slot.account.check()
    assert all(len(s.output_token_ids) == 12 for s in seqs if s is not victim)


def test_a_failed_move_leaves_the_sequences_finishing_at_home():
    want = _reference()
    core, workers = _core()
    seqs = _requests(core)
    _run(core, seqs, until=lambda: _decoding(core, "w0"))
    workers["w0"].fail = True
    core.drain_worker("w0")
    assert _run(core, seqs) == want
    assert core.scheduler.num_migrated == 0 and core.scheduler.num_recomputed_tokens == 0
    for slot in core.scheduler.slots.values():
        slot.account.check()


def test_migration_off_lets_them_finish_at_home():
    core, workers = _core("off")
    seqs = _requests(core)
    _run(core, seqs, until=lambda: _decoding(core, "w0"))
    held = {s.seq_id for s in core.scheduler.slots["w0"].running}
    core.drain_worker("w0")
    _run(core, seqs)
    assert core.scheduler.num_migrated == 0 and held <= set(workers["w0"].history)


def test_a_lora_sequence_does_not_move_to_a_worker_that_does_not_serve_its_adapter():
    """w1 reports no adapters: draining w0, its "a" sequences stay and finish at home, its base-model
    sequences move."""
    core, workers = _core(lora_adapters={"w0": {"a"}, "w1": set()})
    seqs = [Sequence(i, [5 + i] * 8, PARAMS, lora="a" if i % 2 else None) for i in range(4)]
    for s in seqs:
        core.add_request(s)
    _run(core, seqs, until=lambda: _decoding(core, "w0"))
    on_w0 = {s.seq_id: s.lora for s in core.scheduler.slots["w0"].running}
    assert "a" in on_w0.values()
    core.drain_worker("w0")
    _run(core, seqs)
    assert core.scheduler.num_migrated == sum(1 for lora in on_w0.values() if lora is None)
    assert all(len(s.output_token_ids) == PARAMS.max_new_tokens for s in seqs)
    assert not any(w.errors for w in workers.values())


def test_a_lone_draining_worker_keeps_every_sequence_even_those_in_their_prompt():
    """No other worker to move to (one scheduler, one worker: compose's --scale scheduler=2 with two
    workers): nothing goes back to the queue, where it would wait for a worker that never comes or
    be recomputed elsewhere; everything finishes at home."""
    w = MovingWorker(num_blocks=64, block_size=BS, name="w0")
    core = EngineCore(EngineConfig(token_budget=8, block_size=BS), eos_token_ids=[])
    core.add_worker("w0", w, 64, BS, 1 << 12, threaded=False)
    seqs = _requests(core)
    slot = core.scheduler.slots["w0"]
    _run(core, seqs, until=lambda: any(s.in_prefill and s.num_computed_tokens for s in slot.running))
    running = list(slot.running)
    core.drain_worker("w0")
    _run(core, seqs, until=lambda: not slot.running)
    assert core.scheduler.num_recomputed_tokens == 0 and core.scheduler.num_migrated == 0
    assert all(len(s.output_token_ids) == 12 for s in running)  # those queued wait for a worker


def test_a_sequence_part_way_through_its_prompt_moves_and_computes_the_rest_there():
    """The destination reserves blocks for the whole prompt (a prompt's blocks are reserved at
    admission; its continuing chunks bring none), the moved K/V fills the first ones."""

    def run(drain: bool) -> tuple[EngineCore, dict[int, list[int]], set[int]]:
        history: dict = {}
        workers = {
            n: MovingWorker(num_blocks=64, block_size=BS, name=n, history=history) for n in ("w0", "w1")
        }
        core = EngineCore(EngineConfig(token_budget=8, block_size=BS), eos_token_ids=[])
        for name, w in workers.items():
            core.add_worker(name, w, 64, BS, 1 << 12, threaded=False)
        seqs = [Sequence(i, [5 + i] * 30, PARAMS) for i in range(4)]
        for s in seqs:
            core.add_request(s)
        slot = core.scheduler.slots["w0"]

        def mid_prompt():
            return {
                s.seq_id for s in slot.running if s.in_prefill and s.num_computed_tokens > s.num_start_tokens
            }

        _run(core, seqs, until=mid_prompt)
        moving = mid_prompt()
        if drain:
            core.drain_worker("w0")
        got = _run(core, seqs)
        assert not any(w.errors for w in workers.values())
        return core, got, moving

    _, want, _ = run(drain=False)
    core, got, moving = run(drain=True)
    assert moving and got == want
    assert core.scheduler.num_migrated >= len(moving) and core.scheduler.num_recomputed_tokens == 0
    for slot in core.scheduler.slots.values():
        slot.account.check()


def test_a_moved_sequence_shares_the_destinations_cached_prefix_blocks():
    """The destination already computed the same prompt prefix (another sequence): those blocks are
    shared there (reference counted, their K/V not sent) and the moved sequence ends as it would at
    home; the fake worker checks that each shared block holds the sequence's own K/V."""
    history: dict = {}
    workers = {n: MovingWorker(num_blocks=64, block_size=BS, name=n, history=history) for n in ("w0", "w1")}
    config = EngineConfig(token_budget=32, block_size=BS, prefix_aware_placement=False)
    core = EngineCore(config, eos_token_ids=[])
    core.add_worker("w0", workers["w0"], 64, BS, 1 << 12, threaded=False)
    prefix = list(range(10, 26))  # 4 full blocks
    moving = Sequence(1, prefix + [7, 8], PARAMS)
    core.add_request(moving)
    _run(core, [moving], until=lambda: len(moving.output_token_ids) >= 2)
    core.add_worker("w1", workers["w1"], 64, BS, 1 << 12, threaded=False)
    other = Sequence(2, prefix + [9], PARAMS)
    core.add_request(other)
    _run(core, [moving, other], until=lambda: other.worker == "w1" and len(other.output_token_ids) >= 1)
    assert moving.worker == "w0"
    core.drain_worker("w0")
    _run(core, [moving, other], until=lambda: moving.worker == "w1")
    account = core.scheduler.slots["w1"].account
    assert account.tables[1][:4] == account.tables[2][:4]  # the prefix's blocks, held by both
    assert 0 < workers["w0"].blocks_sent <= len(account.tables[1]) - 4  # only those after the prefix
    _run(core, [moving, other])
    assert len(moving.output_token_ids) == PARAMS.max_new_tokens and not any(
        w.errors for w in workers.values()
    )
    assert history[1][: len(moving.prompt_token_ids)] == moving.prompt_token_ids
    for slot in core.scheduler.slots.values():
        slot.account.check()
