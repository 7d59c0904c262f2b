"""Test harness for the scheduler tests: an ``EngineCore`` over cost-free fake workers
(``tests/fake_worker.py``) run inline, stepped one round at a time (``EngineCore.step``), and
workload helpers. ``overlap=True`` builds each worker's next plan before the current one's result is
applied, as the pipeline and the stack do.

The fake "samples" a deterministic hash of each sequence's own tokens, so every request has one
correct greedy output: the one it gets alone (``solo_output``).
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field

from fake_worker import EOS, FakeWorker

from fuseserve.config import EngineConfig
from fuseserve.sampling_params import SamplingParams
from fuseserve.scheduler.engine_core import EngineCore
from fuseserve.scheduler.scheduler import Scheduler
from fuseserve.scheduler.sequence import FinishReason, SeqStatus, Sequence

MAX_MODEL_LEN = 4096


@dataclass
class Engine:
    core: EngineCore
    fakes: dict[str, FakeWorker]
    seqs: dict[int, Sequence] = field(default_factory=dict)  # every sequence ever added
    outputs: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    finish: dict[int, FinishReason] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)  # sequences failed with an error event

    @property
    def sched(self) -> Scheduler:
        return self.core.scheduler

    def add(self, seq: Sequence) -> None:
        self.core.add_request(seq)
        self.seqs[seq.seq_id] = seq

    def step(self):
        """One engine step; returns ``(plans, before)``: ``before[seq_id] = (status, in_prefill,
        num_uncomputed)`` of every live sequence just before the plans were built."""
        before = {
            sid: (s.status, s.in_prefill, s.num_uncomputed, s.worker) for sid, s in self.sched.seqs.items()
        }
        events = self.core.step()
        for fake in self.fakes.values():
            assert not fake.errors, fake.errors
        for ev in events:
            assert ev.seq_id not in self.finish, f"token for finished seq {ev.seq_id}"
            if ev.error is not None:
                self.errors[ev.seq_id] = ev.error
            else:
                self.outputs[ev.seq_id].append(ev.token.token_id)
            if ev.finish_reason is not None:
                self.finish[ev.seq_id] = ev.finish_reason
        return self.core.last_plans, before

    def run(self, on_step=None, max_steps=20_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work:
                return
            plans, before = self.step()
            if on_step is not None:
                on_step(plans, before)
        raise AssertionError(f"no end after {max_steps} steps: {len(self.sched.seqs)} sequences left")


def make_engine(
    policy: str = "splitfuse",
    budget: int = 32,
    workers: dict[str, int] | None = None,
    block_size: int = 4,
    max_num_seqs: int = 256,
    watermark: int = 1,
    max_preemptions: int = 4,
    eos_every: int = 0,
    fail_at: dict[str, int] | None = None,
    overlap: bool = False,
    max_loras: int = 1,
    lora_adapters: dict[str, set[str]] | None = None,
    lora_aware_placement: bool = True,
) -> Engine:
    """EngineCore over fake workers ``{name: num_blocks}`` (default one with a big pool);
    ``lora_adapters``: the adapters each worker reports serving (a worker not named reports none)."""
    workers = workers or {"w0": 100_000}
    cfg = EngineConfig(
        token_budget=budget,
        max_num_seqs=max_num_seqs,
        block_size=block_size,
        watermark_blocks=watermark,
        max_preemptions=max_preemptions,
        policy=policy,
        max_loras=max_loras,
        lora_aware_placement=lora_aware_placement,
    )
    core = EngineCore(cfg, [EOS], overlap=overlap)
    history: dict[int, list[int]] = {}
    fakes = {}
    for name, num_blocks in workers.items():
        fail = (fail_at or {}).get(name)
        fakes[name] = FakeWorker(
            num_blocks, block_size, eos_every=eos_every, fail_at_step=fail, name=name, history=history
        )
        adapters = None if lora_adapters is None else lora_adapters.get(name, set())
        core.add_worker(
            name, fakes[name], num_blocks, block_size, MAX_MODEL_LEN, threaded=False, lora_adapters=adapters
        )
    return Engine(core, fakes)


def greedy(max_new_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, **kw).validate()


def workload(n: int, seed: int, prompt_range=(1, 100), new_range=(1, 40)) -> list[tuple[list[int], int]]:
    """``n`` (prompt token ids, max_new_tokens) pairs."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        out.append(([rng.randint(1, 999) for _ in range(plen)], rng.randint(*new_range)))
    return out


def solo_output(prompt: list[int], params: SamplingParams, eos_every: int, budget: int = 32) -> list[int]:
    """The request's output when it runs alone on a roomy worker."""
    eng = make_engine(budget=budget, eos_every=eos_every)
    eng.add(Sequence(0, list(prompt), params))
    eng.run()
    return eng.outputs[0]


def classify(plan, before) -> list[str]:
    """Kind of each chunk: "decode", "continue" (a running prompt / recompute) or "new" (admitted now)."""
    kinds = []
    for c in plan.chunks:
        status, in_prefill, _, _ = before[c.seq_id]
        if status is SeqStatus.WAITING or c.start_pos == 0:  # admitted this round (maybe preempted in it)
            kinds.append("new")
        else:
            kinds.append("continue" if in_prefill else "decode")
    return kinds


def check_free(eng: Engine) -> None:
    """Every block is back, in the scheduler's accounting and in each fake worker."""
    for name, slot in eng.sched.slots.items():
        assert slot.account.num_free == slot.account.num_blocks, name
        assert slot.account.held == {}, name
        assert not slot.running and not slot.pending_free and not slot.inflight, name
        fake = eng.fakes[name]
        assert fake.num_free_blocks == fake.num_blocks, name
        assert fake.seqs == {}, name
