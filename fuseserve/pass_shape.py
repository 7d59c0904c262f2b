"""The shape of one ragged forward pass: what its latency depends on.

Shared by the worker's latency models (``fuseserve.worker.latency_model``: a roofline per device
and model, the simulated workers' presets) and the scheduler's online fit
(``fuseserve.scheduler.slo_budget``), which must not import each other (``docs/architecture.md``,
"Layering"). Counts only: no tensor, no model.
"""

from __future__ import annotations

from dataclasses import dataclass

from fuseserve.types import StepPlan


@dataclass(frozen=True)
class PassShape:
    """What a pass's latency depends on: tokens, sequences, cached tokens read, attention pairs.

    num_tokens: tokens in the pass. num_seqs: sequences (chunks) in it. kv_tokens: sum over its
    chunks of ``start_pos + num_tokens``. attn_pairs: sum of ``n x (start_pos + (n + 1) / 2)``.
    """

    num_tokens: int
    num_seqs: int = 1
    kv_tokens: float = 0.0
    attn_pairs: float = 0.0

    @classmethod
    def of_plan(cls, plan: StepPlan) -> PassShape:
        """The shape of a step plan."""
        return cls.of_chunks([(c.start_pos, c.num_tokens) for c in plan.chunks])

    @classmethod
    def of_chunks(cls, chunks: list[tuple[int, int]]) -> PassShape:
        """The shape of a pass of ``(start_pos, num_tokens)`` chunks."""
        kv = sum(s + n for s, n in chunks)
        pairs = sum(n * (s + (n + 1) / 2) for s, n in chunks)
        return cls(sum(n for _, n in chunks), len(chunks), kv, pairs)
