"""Multi-step decoding on the worker: one plan, up to ``plan.num_passes`` decode passes.

The scheduler plans K decode passes at once for a pass of decodes only (``EngineConfig.decode_passes``,
``services/scheduler/multi_pass_plan.py``; vLLM v0's multi-step scheduling): one plan, one round trip and
one postprocess instead of K. Every runner (``ModelRunner``, ``SimulatedRunner``, the tensor-parallel
rank 0) runs its plans through ``run_passes``, which runs the plan as the first pass and then, for
each later pass, a plan of decode entries fed with the tokens just sampled (the runner's own
``SeqTable`` keeps them), so sampling state (penalties, seeds, grammars, logprobs) advances pass by
pass exactly as with one plan per pass.

A sequence stops taking passes when it reaches ``max_new_tokens`` or samples a stop token (EOS unless
``ignore_eos``, or a ``stop_token_ids`` id, once ``min_new_tokens`` are generated): the scheduler's
own token-level stop rule (``fuseserve.stop_rule.check_stop``). A plan the scheduler built while that plan
ran may still hold the stopped sequence (overlap), positioned as if every pass had run: such chunks
are dropped (``WorkerSeq.stopped``), and the scheduler drops nothing it expects from them (the
sequence finished on the stop).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fuseserve.stop_rule import check_stop
from fuseserve.types import FinishReason, SeqChunk, StepPlan, StepResult
from fuseserve.worker.seq_table import WorkerSeq

_NO_LIMIT = 1 << 62  # the context window, checked by the scheduler instead


def run_passes(runner, plan: StepPlan, step_once: Callable[[StepPlan], StepResult]) -> StepResult:
    """Run ``plan``: its first pass with ``step_once``, then up to ``plan.num_passes - 1`` decode passes.

    ``runner``: has ``seqs`` (``WorkerSeq`` by id), ``info.eos_token_ids`` and ``free``.
    Returns every sampled token in pass order (per pass, plan order), ``forward_seconds`` summed over
    the passes and ``num_passes`` run. Raises what ``step_once`` raises (a later pass's error
    leaves the sequences as far as they got: the scheduler fails or recomputes them).
    """
    kept = _drop_stopped(runner, plan)
    if kept is not plan and not kept.chunks:
        return _only_free(runner, kept)
    plan = kept
    first = step_once(plan)
    if plan.num_passes <= 1 or not first.tokens:
        return first
    eos = set(runner.info.eos_token_ids)
    tokens = list(first.tokens)
    seconds = first.forward_seconds
    passes = 1
    last = first.tokens
    while passes < plan.num_passes:
        live = [t.seq_id for t in last if not _stops(runner.seqs[t.seq_id], t.token_id, eos)]
        if not live:
            break
        chunks = [SeqChunk(sid, runner.seqs[sid].num_computed, 1, sample=True) for sid in live]
        result = step_once(StepPlan(plan.step_id, chunks))
        tokens.extend(result.tokens)
        seconds += result.forward_seconds
        passes += 1
        last = result.tokens
    return dataclasses.replace(first, tokens=tokens, forward_seconds=seconds, num_passes=passes)


def _stops(seq: WorkerSeq, token_id: int, eos: set[int]) -> bool:
    """True when ``seq``, having just sampled ``token_id``, takes no further pass of this plan.

    A stop token marks the sequence ``stopped`` (later plans built before the scheduler learned of
    the stop drop its chunks); the length stop needs no mark (the scheduler plans no token past it).
    """
    num_tokens = seq.num_computed + 1  # prompt + generated, this one included
    # no context-window check: the scheduler plans no pass past the window (``plan_passes``)
    reason = check_stop(
        seq.sampling.params, token_id, num_tokens - seq.prompt_len, num_tokens, eos, _NO_LIMIT
    )
    if reason is FinishReason.STOP:
        seq.stopped = True
    return reason is not None


def _drop_stopped(runner, plan: StepPlan) -> StepPlan:
    """``plan`` without the chunks of sequences a multi-pass plan stopped (a chunk with params
    restarts its sequence and is kept)."""
    seqs = runner.seqs
    if not any(c.seq_id in seqs and seqs[c.seq_id].stopped for c in plan.chunks):
        return plan
    chunks = [c for c in plan.chunks if c.params is not None or not seqs[c.seq_id].stopped]
    return dataclasses.replace(plan, chunks=chunks)


def _only_free(runner, plan: StepPlan) -> StepResult:
    """A plan whose every chunk was dropped: do its frees, run nothing (an empty pass)."""
    runner.free(plan.free_seq_ids)
    return StepResult(plan.step_id, [], 0.0)
