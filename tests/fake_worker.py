"""A cost-free fake model worker for scheduler tests: ``step(plan) -> StepResult`` without a model.

It keeps per-sequence state exactly like ``fuseserve.worker.model_runner.ModelRunner`` does (tokens
whose K/V it holds, the token it sampled last, the block table the scheduler fills) and consumes
plans the same way: ``free_seq_ids`` first; a chunk with ``params`` (re)creates the sequence, past
its cached prefix; a decode entry has no token ids and feeds the token sampled last. Every rule of
the plan contract is asserted (``PlanError``), so a scheduler bug shows up as a failed step.

It also keeps what each KV slot holds (``(position, token)`` per slot of each block): a prefix-cache
hit must find exactly the prefix's tokens in the shared blocks, and no pass may write into a block
that another live sequence's table holds (a block reused while referenced, or a shared block
written again).

"Sampling" is deterministic: the next token is a hash of every token of the sequence so far, so a
sequence's output depends only on its own tokens (never on the batch, the chunking or a
recompute), and a greedy run alone gives the reference output. About one token in ``eos_every`` is
EOS, banned like the real sampler while ``len(output) < min_new_tokens`` or with ``ignore_eos``.
"""

from __future__ import annotations

import collections
import zlib
from dataclasses import dataclass, field

from fuseserve.errors import WorkerLostError
from fuseserve.sampling_params import SamplingParams
from fuseserve.types import SampledToken, StepPlan, StepResult

EOS = 0


class PlanError(AssertionError):
    """A step plan broke the scheduler ↔ worker contract."""


def next_token(tokens: list[int], vocab_size: int, eos_every: int) -> int:
    """Deterministic "model": a token in ``[1, vocab)`` from a hash of ``tokens``; EOS now and then."""
    h = zlib.crc32(b",".join(str(t).encode() for t in tokens))
    if eos_every and h % eos_every == 0:
        return EOS
    return 1 + (h >> 8) % (vocab_size - 1)


@dataclass
class FakeSeq:
    params: SamplingParams
    prompt_len: int
    tokens: list[int] = field(default_factory=list)  # tokens whose K/V this worker holds, in order
    last_token: int | None = None  # sampled last, not yet in ``tokens`` (the next decode input)
    table: list[int] = field(default_factory=list)  # block ids, from the plans


class FakeWorker:
    """Plays a ``ModelRunner``: same plan semantics, same block pool discipline, no tensors.

    num_blocks / block_size: the KV pool; the worker fails a step that needs more blocks than are
    free (the scheduler's accounting must prevent that).
    fail_at_step: raise on the n-th call of ``step`` (0-based) and every later one, to play a lost
        worker (with ``fail_with`` set: raise that on the n-th call only, a rejected plan).
    history: share one dict between the workers of a test, so a sequence that moves to another
        worker (recompute) is checked against the tokens it had before.
    Records every plan (``plans``) and, across frees and recomputes, the longest token history
    seen per sequence (``history``), against which a recompute's token ids are checked.
    """

    def __init__(
        self,
        num_blocks: int = 10_000,
        block_size: int = 16,
        vocab_size: int = 1000,
        eos_every: int = 0,
        fail_at_step: int | None = None,
        name: str = "fake",
        history: dict[int, list[int]] | None = None,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_every = eos_every
        self.fail_at_step = fail_at_step
        self.fail_with: type[Exception] | None = None  # None: WorkerLostError (a lost worker)
        self.name = name
        self.seqs: dict[int, FakeSeq] = {}
        self.history: dict[int, list[int]] = {} if history is None else history
        self.plans: list[StepPlan] = []
        self.seen_seq_ids: set[int] = set()
        self.num_steps = 0
        self.errors: list[PlanError] = []
        self.slots: dict[int, list[tuple[int, int] | None]] = {}  # block id -> (position, token) per slot
        self.num_prefix_tokens = 0  # tokens whose K/V came from shared cached blocks

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - len({b for s in self.seqs.values() for b in s.table})

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def free(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self.seqs.pop(sid, None)

    def step(self, plan: StepPlan) -> StepResult:
        lost = self.fail_with is None  # a lost worker stays lost; a rejected plan is one plan
        if self.fail_at_step is not None and (
            self.num_steps == self.fail_at_step or (lost and self.num_steps > self.fail_at_step)
        ):
            self.num_steps += 1
            raise (self.fail_with or WorkerLostError)(f"{self.name}: worker lost")
        self.num_steps += 1
        self.plans.append(plan)
        try:
            return self._step(plan)
        except PlanError as e:
            self.errors.append(e)  # the engine loop swallows worker errors; tests check this list
            raise

    def _step(self, plan: StepPlan) -> StepResult:
        self.free(plan.free_seq_ids)
        ids = [c.seq_id for c in plan.chunks]
        if len(ids) != len(set(ids)):
            raise PlanError(f"a sequence appears twice in one plan: {ids}")
        inputs: list[tuple[FakeSeq, list[int]]] = []
        for c in plan.chunks:
            if c.num_tokens < 1:
                raise PlanError(f"seq {c.seq_id}: num_tokens={c.num_tokens}")
            seq = self.seqs.get(c.seq_id)
            if any(not 0 <= b < self.num_blocks for b in c.block_ids):
                raise PlanError(f"seq {c.seq_id}: block ids {c.block_ids} outside the pool")
            if c.params is not None:
                seq = FakeSeq(c.params, c.prompt_len)  # new, or a recompute from scratch
                self.seqs[c.seq_id] = seq
                if c.prompt_len < 1:
                    raise PlanError(f"seq {c.seq_id}: first chunk with prompt_len={c.prompt_len}")
                self._shared_prefix(c, seq)
            elif seq is None:
                raise PlanError(f"seq {c.seq_id}: unknown; a first chunk needs params")
            else:
                seq.table.extend(c.block_ids)
            if len(seq.table) * self.block_size < c.start_pos + c.num_tokens:
                raise PlanError(
                    f"seq {c.seq_id}: table of {len(seq.table)} blocks for a chunk ending at {c.start_pos + c.num_tokens}"
                )
            if c.start_pos != len(seq.tokens):
                raise PlanError(
                    f"seq {c.seq_id}: chunk starts at {c.start_pos}, worker holds {len(seq.tokens)}"
                )
            if c.token_ids:
                if len(c.token_ids) != c.num_tokens:
                    raise PlanError(f"seq {c.seq_id}: {len(c.token_ids)} ids for num_tokens={c.num_tokens}")
                tokens = list(c.token_ids)
            else:
                if c.num_tokens != 1 or seq.last_token is None:
                    raise PlanError(
                        f"seq {c.seq_id}: decode entry without a sampled token (num_tokens={c.num_tokens})"
                    )
                tokens = [seq.last_token]
            if seq.last_token is not None and tokens[0] != seq.last_token:
                raise PlanError(f"seq {c.seq_id}: continues with {tokens[0]}, sampled {seq.last_token}")
            known = self.history.get(c.seq_id, [])
            end = c.start_pos + c.num_tokens
            overlap = known[c.start_pos : end]
            if overlap != tokens[: len(overlap)]:
                raise PlanError(f"seq {c.seq_id}: tokens {c.start_pos}:{end} differ from its history")
            limit = max(seq.prompt_len, len(known))  # tokens the scheduler can know of
            if end > limit:
                raise PlanError(f"seq {c.seq_id}: chunk ends at {end}, only {limit} tokens exist")
            # with overlap, the history may end with a token sampled by a plan whose result the
            # scheduler dropped (the sequence was preempted while it ran): a chunk may then sample
            # one short of the history's end
            if (end == limit and not c.sample) or (c.sample and end < limit - 1):
                raise PlanError(f"seq {c.seq_id}: sample={c.sample} for a chunk ending at {end} of {limit}")
            inputs.append((seq, tokens))
        out: list[SampledToken] = []
        holders = collections.Counter(b for s in self.seqs.values() for b in set(s.table))
        for c, (seq, tokens) in zip(plan.chunks, inputs, strict=True):
            self._write(c.seq_id, seq, tokens, holders)
            seq.tokens.extend(tokens)
            seq.last_token = None
            hist = self.history.setdefault(c.seq_id, [])
            if len(seq.tokens) > len(hist):
                hist.extend(seq.tokens[len(hist) :])
            self.seen_seq_ids.add(c.seq_id)
            if c.sample:
                tok = self._sample(seq)
                seq.last_token = tok
                if len(hist) == len(seq.tokens):
                    hist.append(tok)
                elif hist[len(seq.tokens)] != tok:
                    raise PlanError(f"seq {c.seq_id}: resampled a different token after recompute")
                out.append(SampledToken(c.seq_id, tok, -1.0))
        return StepResult(plan.step_id, out)

    def _shared_prefix(self, c, seq: FakeSeq) -> None:
        """Start a new table; its first ``start_pos`` tokens must be in the shared blocks already."""
        bs = self.block_size
        seq.table = list(c.block_ids)
        if c.start_pos % bs or len(c.prefix_token_ids) != c.start_pos:
            raise PlanError(
                f"seq {c.seq_id}: cached prefix of {c.start_pos} tokens (block {bs}), {len(c.prefix_token_ids)} ids"
            )
        for pos, tok in enumerate(c.prefix_token_ids):
            held = self.slots.get(seq.table[pos // bs], [None] * bs)[pos % bs]
            if held != (pos, tok):
                raise PlanError(
                    f"seq {c.seq_id}: cached block {seq.table[pos // bs]} holds {held} at {pos}, not {tok}"
                )
        seq.tokens = list(c.prefix_token_ids)
        self.num_prefix_tokens += c.start_pos

    def _write(self, seq_id: int, seq: FakeSeq, tokens: list[int], holders: collections.Counter) -> None:
        """Write the K/V of ``tokens`` into the slots after ``seq.tokens``; never into a block that
        another live sequence's table holds."""
        bs = self.block_size
        for pos, tok in enumerate(tokens, len(seq.tokens)):
            b = seq.table[pos // bs]
            if holders[b] > 1:
                raise PlanError(f"seq {seq_id}: writes block {b}, which another live sequence holds")
            self.slots.setdefault(b, [None] * bs)[pos % bs] = (pos, tok)

    def _sample(self, seq: FakeSeq) -> int:
        tok = next_token(seq.tokens, self.vocab_size, self.eos_every)
        num_out = len(seq.tokens) - seq.prompt_len
        p = seq.params
        if tok == EOS and (num_out < p.min_new_tokens or p.ignore_eos):
            tok = 1 + zlib.crc32(str(len(seq.tokens)).encode()) % (self.vocab_size - 1)
        return tok


class MovingWorker(FakeWorker):
    """A fake worker with ``migrate`` (``services/scheduler/migration.py``): copies each sequence's
    tokens and written slots into the first of the destination's given blocks, which become its table,
    and drops it here. ``hold``: keep the answer until ``release()`` (a move in flight)."""

    def __init__(self, *a, pass_seconds: tuple[float, float] | None = None, **kw):
        super().__init__(*a, **kw)
        self.pass_seconds = pass_seconds  # (a, b): report a + b x tokens seconds per pass
        self.hold = False
        self.fail = False
        self.blocks_sent = 0  # blocks whose K/V ``migrate`` copied (shared ones are not)
        self._held = []

    def step(self, plan: StepPlan) -> StepResult:
        result = super().step(plan)
        if self.pass_seconds is not None:
            a, b = self.pass_seconds
            result.forward_seconds = a + b * plan.num_tokens
        return result

    def migrate(self, dest: MovingWorker, moves, on_done) -> None:
        from fuseserve.scheduler.migration import MigrationResult

        moved, sent = [], 0
        if not self.fail:
            for seq_id, block_ids, shared in moves:
                seq = self.seqs.pop(seq_id)
                written = -(-len(seq.tokens) // self.block_size)  # the blocks holding its K/V
                for i, b in enumerate(seq.table[:written]):
                    if i < shared:  # the destination's cached block: it must hold the same K/V
                        if dest.slots.get(block_ids[i]) != self.slots[b]:
                            raise PlanError(f"seq {seq_id}: shared block {block_ids[i]} holds other K/V")
                        continue
                    dest.slots[block_ids[i]] = list(self.slots[b])
                    sent += 1
                seq.table = list(block_ids)
                dest.seqs[seq_id] = seq
                moved.append(seq_id)
        self.blocks_sent += sent
        result = MigrationResult(moved, num_bytes=100 * sent, seconds=0.01)
        if self.hold:
            self._held.append((on_done, result))
        else:
            on_done(result)

    def release(self) -> None:
        for on_done, result in self._held:
            on_done(result)
        self._held = []
