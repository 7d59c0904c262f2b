"""SLO-driven token budget: each SplitFuse pass sized from the latency targets and the measured
latency curve (``--target-itl``, ``--target-prefill-rate``).

The fixed budget (the knee of the throughput curve, ``fuseserve.worker.profiler``) ignores both the
load and the targets: at high load the running decodes take most of it, prompts crawl in
``budget - decodes`` tokens per pass and break the TTFT target, while each pass is many times faster
than the inter-token latency (ITL) target needs. With targets, before each pass of a worker:

1. **Limit** ``L``: the largest pass (tokens) whose predicted latency is at most
   ``target_itl x (1 - ITL_MARGIN)``. Every running decode is in every pass, so a pass within ``L``
   keeps each decode's inter-token gap within the target. The prediction is the shape of the pass the
   policy would build (running decodes, then prompt chunks earliest deadline first) fed to the
   worker's ``PassLatency``. When the running decodes alone exceed ``L`` the pass holds just them
   (the target cannot be met; splitting them would only delay each one further).
2. **Need**: each waiting or partly computed prompt has a TTFT deadline, ``arrival + prompt_len /
   target_prefill_rate``. Earliest deadline first, the prompt tokens per second that meet them all
   is ``rate = max_k (tokens of the first k prompts) / (deadline_k - now)``; the pass needed is the
   smallest ``n`` whose prompt share ``(n - decodes) / t(n)`` reaches that rate. A prompt past its
   deadline makes the need ``L``.
3. **Budget** = ``min(L, max(knee, need, decodes))``: at low load passes stay at the knee (no
   growth beyond need, so decodes keep short gaps); as deadlines press, prompt chunks grow up to
   ``L``; every running decode fits while ``L`` allows.

Why this follows from the paper's observations (DeepSpeed-FastGen, Holmes et al. 2024, §3.1): pass
latency depends mainly on the tokens in the pass, so a predicted latency per token count turns the
ITL target into a token limit; throughput saturates past the knee, so passes larger than the knee buy
prompt tokens per second only slightly and are taken only when deadlines need them; the curve is
concave, so within the chosen size passes stay equal-sized (the policy fills each one exactly).

Only ``splitfuse`` is sized this way; ``prefill_first`` and ``whole_prompt`` keep the fixed budget
(they are the baselines, as vLLM's / TGI's fixed ``max_num_batched_tokens``). Without targets nothing
here runs and plans are exactly the fixed-budget ones.
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from fuseserve.pass_shape import PassShape

if TYPE_CHECKING:
    from fuseserve.scheduler.sequence import Sequence
    from fuseserve.scheduler.worker_slot import WorkerSlot

ITL_MARGIN = 0.1
"""A pass may take at most ``(1 - ITL_MARGIN) x target_itl`` seconds (prediction error, jitter)."""

MAX_PASS_TOKENS = 1 << 15
"""The largest pass ever considered (tokens)."""

# feature scales: each feature ~1 in a typical pass, so one prior covariance fits them all
_SCALES = np.array([1.0, 1.0, 1e3, 1e2, 1e5, 1e7])


def curve_prior(curve: dict[int, float]) -> Callable[[PassShape], float]:
    """A latency prior from a start-up profile ``{tokens: seconds}`` of prompt-only passes.

    Linear between profiled sizes, flat below the smallest, extended with the last slope above the
    largest; context and sequence count are left to the online correction. Raises ``ValueError`` on
    an empty curve.
    """
    if not curve:
        raise ValueError("empty latency curve")
    xs = sorted(curve)
    ys = [curve[x] for x in xs]
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else ys[0] / xs[0]

    def prior(shape: PassShape) -> float:
        n = shape.num_tokens
        if n <= xs[0]:
            return ys[0]
        if n >= xs[-1]:
            return ys[-1] + slope * (n - xs[-1])
        i = bisect.bisect_right(xs, n)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    return prior


class PassLatency:
    """One worker's predicted pass latency (seconds): a prior, corrected online from measured passes.

    ``predict(shape) = w . x(shape)``, with ``x = [prior(shape), 1, tokens, sequences, kv tokens,
    attention pairs]`` (scaled) and ``w`` fitted by recursive least squares with forgetting to every
    pass the worker reports. It starts at ``w = [1, 0, ...]``: the prediction is the prior until
    measurements say otherwise (a device uniformly slower than profiled moves the first weight;
    context and sequence costs the profile did not see move the others); directions no pass has
    exercised stay at the prior. Without a prior the fit alone predicts, after ``min_samples`` passes.

    prior: the start-up profile (``curve_prior``) or a latency model (``LatencyModel.shape_seconds``).
    forgetting: RLS forgetting factor per pass (older passes weigh less as the device drifts).
    """

    def __init__(
        self,
        prior: Callable[[PassShape], float] | None = None,
        forgetting: float = 0.99,
        min_samples: int = 8,
        prior_variance: float = 1.0,
    ):
        self.prior = prior
        self.forgetting = forgetting
        self.min_samples = min_samples
        self.num_samples = 0
        self._w = np.zeros(len(_SCALES))
        self._w[0] = 1.0 if prior is not None else 0.0
        self._p0 = prior_variance
        self._P = np.eye(len(_SCALES)) * prior_variance

    def _features(self, shape: PassShape) -> np.ndarray:
        base = self.prior(shape) if self.prior else 0.0
        raw = np.array([base, 1.0, shape.num_tokens, shape.num_seqs, shape.kv_tokens, shape.attn_pairs])
        return raw / _SCALES

    @property
    def ready(self) -> bool:
        """Whether predictions can be made (a prior, or enough measured passes)."""
        return self.prior is not None or self.num_samples >= self.min_samples

    def observe(self, shape: PassShape, seconds: float) -> None:
        """Correct the model with one measured pass (ignored when ``seconds`` is not positive)."""
        if seconds <= 0 or shape.num_tokens <= 0:
            return
        x = self._features(shape)
        residual = seconds - float(self._w @ x)
        px = self._P @ x
        gain = px / (self.forgetting + float(x @ px))
        self._w = self._w + gain * residual
        self._P = self._P - np.outer(gain, px)
        if np.trace(self._P) < self._p0 * len(_SCALES):  # forget only while it cannot wind up
            self._P /= self.forgetting
        self.num_samples += 1

    def predict(self, shape: PassShape) -> float | None:
        """Predicted seconds of a pass of ``shape``; None while not ``ready``."""
        if not self.ready:
            return None
        return max(1e-6, float(self._w @ self._features(shape)))


class SLOBudget:
    """Chooses each SplitFuse pass's token budget from latency targets (module docstring).

    target_itl: inter-token latency to keep, seconds. target_prefill_rate: prompt tokens per second
    of TTFT allowance (TTFT target = prompt tokens / rate); None → no TTFT deadlines (the budget is
    then the knee, capped by the ITL limit). At least one target must be given. ``clock`` (seconds)
    is the scheduler's.
    """

    def __init__(
        self, target_itl: float | None, target_prefill_rate: float | None, clock: Callable[[], float]
    ):
        self.target_itl = target_itl
        self.target_prefill_rate = target_prefill_rate
        self.clock = clock

    def deadline(self, seq: Sequence) -> float:
        """The TTFT deadline of ``seq`` on the scheduler's clock (inf without a prefill-rate target)."""
        if self.target_prefill_rate is None:
            return math.inf
        return seq.arrival_time + seq.prompt_len / self.target_prefill_rate

    def order_waiting(self, waiting: collections.deque[Sequence], kv_free_tokens: int | None = None) -> None:
        """Sort the queue earliest TTFT deadline first (stable: FIFO among equal deadlines); when the
        queue's tokens exceed ``kv_free_tokens`` (the free KV cache of the workers, in tokens), the
        prompts already past their deadline go behind the others.

        Admission under overload: while the KV cache holds fewer requests than are sent, a freed slot
        goes to the queue's most overdue prompt under earliest deadline first, so every admitted
        request has already missed its TTFT target (it waited for the overdue ones ahead) and
        effective throughput falls to 0. Giving the freed blocks to a prompt that can still meet its
        deadline keeps the admitted requests inside their targets; the overdue ones wait until no
        such prompt is queued (they have missed it either way).
        """
        if self.target_prefill_rate is None or len(waiting) <= 1:
            return
        ordered = sorted(waiting, key=self.deadline)
        if kv_free_tokens is not None and sum(s.num_tokens for s in ordered) > kv_free_tokens:
            now = self.clock()
            ordered.sort(key=lambda s: self.deadline(s) <= now)  # stable: EDF within each group
        waiting.clear()
        waiting.extend(ordered)

    def prompts(
        self, slot: WorkerSlot, waiting: collections.deque[Sequence], num_workers: int
    ) -> list[tuple[float, int, float]]:
        """``(deadline, start_pos, tokens)`` of the prompts ``slot`` may run next, in the order the
        policy takes them: its partly computed prompts, then the queue's, each earliest deadline
        first; a queued prompt counts 1/(workers) of its tokens (it may be placed on any worker)."""
        share = 1.0 / max(1, num_workers)
        running = [
            (self.deadline(s), s.num_computed_tokens, float(s.num_uncomputed))
            for s in slot.running
            if s.in_prefill
        ]
        queued = [(self.deadline(s), 0, s.num_tokens * share) for s in waiting]
        return sorted(running, key=lambda t: t[0]) + sorted(queued, key=lambda t: t[0])

    def pass_budget(
        self, slot: WorkerSlot, waiting: collections.deque[Sequence], num_workers: int, max_model_len: int
    ) -> int:
        """The token budget of ``slot``'s next pass (module docstring: ``min(L, max(knee, need, decodes))``),
        with ``waiting`` the queue, shared by ``num_workers`` workers of context ``max_model_len``.

        The knee (``slot.token_budget``) while the worker's latency model is not ready.
        """
        model: PassLatency = slot.latency
        knee = slot.token_budget
        if not model.ready:
            return knee
        decodes = [
            (s.num_computed_tokens, 1)
            for s in slot.running
            if not s.in_prefill and not s.ends_in_flight(max_model_len)
        ]
        prompts = self.prompts(slot, waiting, num_workers)
        num_decodes = len(decodes)
        n_max = min(MAX_PASS_TOKENS, num_decodes + int(math.ceil(sum(t for _, _, t in prompts))))
        if n_max <= 0:
            return knee

        def seconds(n: int) -> float:
            chunks = decodes[:n]
            left = n - len(chunks)
            for _, start, tokens in prompts:
                if left <= 0:
                    break
                take = min(left, int(math.ceil(tokens)))
                chunks.append((start, take))
                left -= take
            return model.predict(PassShape.of_chunks(chunks))

        limit = n_max
        if self.target_itl is not None:
            limit = _largest(1, n_max, lambda n: seconds(n) <= self.target_itl * (1 - ITL_MARGIN))
            limit = max(limit, num_decodes)
        need = self._need(prompts, num_decodes, limit, seconds)
        return max(1, min(limit, max(knee, need, num_decodes)))

    def _need(self, prompts, num_decodes: int, limit: int, seconds: Callable[[int], float]) -> int:
        """Smallest pass whose prompt tokens per second meet every TTFT deadline (``limit`` when a
        deadline is past or none fits); 0 without deadlines."""
        if self.target_prefill_rate is None or not prompts or limit <= num_decodes:
            return 0
        now = self.clock()
        rate, total = 0.0, 0.0
        for deadline, _, tokens in sorted(prompts, key=lambda t: t[0]):
            total += tokens
            slack = deadline - now
            if slack <= 0:
                return limit
            rate = max(rate, total / slack)
        if (limit - num_decodes) < rate * seconds(limit):
            return limit
        return _smallest(num_decodes + 1, limit, lambda n: (n - num_decodes) >= rate * seconds(n))


def _largest(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The largest ``n`` in ``[lo, hi]`` with ``ok(n)`` (``ok`` true up to a point); ``lo - 1`` if none."""
    if not ok(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _smallest(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The smallest ``n`` in ``[lo, hi]`` with ``ok(n)`` (``ok`` false up to a point; ``ok(hi)`` true)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
