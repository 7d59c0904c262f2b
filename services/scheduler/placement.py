"""Placement by expected completion: each worker's measured step-time curve says when a new
sequence would finish there; it goes where that is soonest.

A worker reports the seconds of every pass (``StepResult.forward_seconds``). Pass time is close to
linear in the tokens of the pass (``seconds ≈ a + b x tokens``, the paper's measured fact that latency
depends mainly on the token count), so each worker keeps a least-squares fit over its recent passes.
``expected_finish`` turns the line, the worker's running sequences, queued prompt tokens and plans in
flight into the seconds a new sequence would take there (its prompt, then its output). Where ``a``
dominates (GPU decode passes bound by the weights' bandwidth) batching is nearly free, so a 3x-slower
worker only finishes a sequence sooner once the faster one is loaded well past its own batch: at light
load everything goes to the fast worker, which serves each request about 3x sooner; under a long queue
the slower worker takes the queue's head when the queue's last request would finish later on the
faster one (``WaitingQueue.place``).

``seconds_per_share`` (``(sequences + 1) x t(budget) / budget``) is the earlier rule, shares in
proportion to speed; it remains the load measure of the prefix-aware guard (``near_least_loaded``).
"""

from __future__ import annotations

import collections


class StepTimeModel:
    """Least-squares line ``seconds = a + b x tokens`` over a worker's last ``window`` passes.

    The fit is refreshed with every sample up to ``refit_every`` of them, then every ``refit_every``
    samples: the samples of that moment are kept and fitted when the line is next read (placement reads it; a worker whose passes are only decodes
    may go long without one).
    """

    def __init__(self, window: int = 64, refit_every: int = 8):
        self.samples: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
        self.refit_every = refit_every
        self._since_fit = 0
        self._coef: tuple[float, float] | None = None
        self._to_fit: tuple[tuple[int, float], ...] | None = None  # samples of the refresh not fitted yet

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Record one pass of ``num_tokens`` tokens that took ``seconds`` (ignored when not positive)."""
        if seconds <= 0 or num_tokens <= 0:
            return
        self.samples.append((num_tokens, seconds))
        self._since_fit += 1
        if len(self.samples) <= self.refit_every or self._since_fit >= self.refit_every:
            self._since_fit = 0
            self._to_fit = tuple(self.samples)

    @staticmethod
    def _fit(samples: tuple[tuple[int, float], ...]) -> tuple[float, float]:
        n = len(samples)
        mx = sum(x for x, _ in samples) / n
        my = sum(y for _, y in samples) / n
        sxx = sum((x - mx) ** 2 for x, _ in samples)
        if sxx <= 1e-9:  # every pass had the same size: no slope to learn, the same time at any size
            return (my, 0.0)
        b = max(0.0, sum((x - mx) * (y - my) for x, y in samples) / sxx)
        return (max(0.0, my - b * mx), b)

    def seconds(self, num_tokens: int) -> float | None:
        """Predicted seconds of a pass of ``num_tokens`` tokens; None before the first measured pass."""
        if self._to_fit is not None:
            self._coef = self._fit(self._to_fit)
            self._to_fit = None
        if self._coef is None:
            return None
        a, b = self._coef
        return a + b * num_tokens


def seconds_per_share(
    model: StepTimeModel, fallback: StepTimeModel | None, token_budget: int, num_seqs: int
) -> float:
    """``(num_seqs + 1) x t(budget) / budget``: the seconds of worker time per token of a full pass,
    times the sequences sharing it once one more is placed (smaller: serves a new sequence sooner).

    ``fallback`` stands in for a worker with no measured pass yet; with neither, 0.0 (no information:
    the caller breaks the tie on free blocks).
    """
    t = model.seconds(token_budget)
    if t is None and fallback is not None:
        t = fallback.seconds(token_budget)
    if t is None:
        return 0.0
    return (num_seqs + 1) * t / token_budget


def expected_finish(
    model: StepTimeModel,
    fallback: StepTimeModel | None,
    token_budget: int,
    num_running: int,
    queued_tokens: int,
    inflight_tokens: list[int],
    prompt_tokens: int,
    output_tokens: int,
) -> float:
    """Seconds until a new sequence placed on this worker now would finish (expected completion).

    The worker holds ``num_running`` sequences, ``queued_tokens`` prompt tokens placed on it and not
    planned yet, and plans in flight of ``inflight_tokens`` tokens each; the new sequence brings
    ``prompt_tokens`` to compute (past any cached prefix) and ``output_tokens`` to generate. With
    ``t(n)`` the fitted pass time (``fallback``'s for a worker with no measured pass; 0.0 when neither
    has one: no information, the caller breaks the tie):

    - passes in flight: ``t(n)`` each, the first counted half (it is under way);
    - prefill: the queued prompts, then this one, go through passes of ``token_budget`` tokens of
      which the running decodes take one each, so ``(queued + prompt) / (budget - running)`` passes of
      ``t(budget)`` (one pass of ``t(running + queued + prompt)`` when that fits in one);
    - decode: ``output_tokens - 1`` passes holding the running sequences and this one,
      ``t(running + 1)`` each.

    Increasing in every load term (queue, running sequences, passes in flight). On a worker whose
    pass time hardly grows with the batch (``a`` of ``a + b x n`` dominant) a faster worker wins even
    with many sequences: a slower worker is only used once the faster one's queue or batch makes it
    the later finish.
    """
    if model.seconds(1) is None:
        model = fallback if fallback is not None else model
    if model.seconds(1) is None:
        return 0.0
    t = model.seconds
    ahead = sum(t(n) for n in inflight_tokens) - (0.5 * t(inflight_tokens[0]) if inflight_tokens else 0.0)
    room = max(1, token_budget - num_running)
    tokens = queued_tokens + prompt_tokens
    prefill = t(num_running + tokens) if tokens <= room else tokens / room * t(token_budget)
    return ahead + prefill + max(0, output_tokens - 1) * t(num_running + 1)


def finish_times(
    model: StepTimeModel,
    fallback: StepTimeModel | None,
    token_budget: int,
    prompt_tokens: int,
    outputs_left: list[int],
) -> list[float]:
    """Seconds from now until each sequence a worker holds would finish, in increasing order (the
    last is the worker's queue delay, for rebalancing).

    ``prompt_tokens``: prompt tokens of its sequences still to compute; ``outputs_left``: tokens each
    sequence has still to generate (its ``max_tokens`` less those generated: an upper bound, as EOS
    may come first). With ``t(n)`` the fitted pass time (``fallback``'s without a measured pass; all
    0.0 with neither: no information): the prompts in passes of ``token_budget`` tokens beside the
    decodes, then decode passes whose batch shrinks as sequences end: ``(r_k - r_(k-1)) x t(alive)``
    over the outputs ``r`` in increasing order. Plans in flight are left out (a sequence moving
    off the worker waits for them too)."""
    if model.seconds(1) is None:
        model = fallback if fallback is not None else model
    if model.seconds(1) is None:
        return [0.0] * len(outputs_left)
    t = model.seconds
    now = 0.0
    if prompt_tokens:
        now += prompt_tokens / max(1, token_budget - len(outputs_left)) * t(token_budget)
    out, done = [], 0
    for k, r in enumerate(sorted(outputs_left)):
        now += max(0, r - done) * t(len(outputs_left) - k)
        done = max(done, r)
        out.append(now)
    return out


#: prefix-aware placement considers the workers whose load is within this factor of the least
#: loaded worker's, plus ``BALANCE_SLACK_SEQS`` sequences (SGLang's cache-aware router uses the same
#: guard: follow the prefix while the load is balanced, else the least loaded)
BALANCE_FACTOR = 1.5
BALANCE_SLACK_SEQS = 2.0


def near_least_loaded(shares: list[float], num_seqs: list[int]) -> list[bool]:
    """Which workers are loaded close enough to the least loaded one to follow a prefix there.

    ``shares``: each worker's ``seconds_per_share`` (all 0.0 before any measurement: then the
    sequence counts + 1 stand in). A worker is near when its load is at most ``BALANCE_FACTOR`` x the
    least plus ``BALANCE_SLACK_SEQS`` sequences of the least loaded worker. So one hot prefix
    cannot pile every sequence onto one worker: past the guard the next sequence goes elsewhere and
    that worker caches the prefix too.
    """
    loads = shares if any(shares) else [n + 1.0 for n in num_seqs]
    i = min(range(len(loads)), key=loads.__getitem__)
    per_seq = loads[i] / (num_seqs[i] + 1)
    limit = loads[i] * BALANCE_FACTOR + BALANCE_SLACK_SEQS * per_seq
    return [x <= limit + 1e-12 for x in loads]
