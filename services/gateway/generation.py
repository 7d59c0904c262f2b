"""One HTTP request's sequences in flight: submit them, consume their token events, abort them.

Each sequence's output is the front end's ``OutputState`` (``fuseserve/frontend/output.py``), the
same the pipeline uses; this module is only the Redis I/O around it. When a stop string matches, the
scheduler is told to free the sequence at once (abort ControlMessage, reason "stop").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from fuseserve.frontend.output import Delta, OutputState
from fuseserve.gateway.gateway_metrics import GatewayMetrics
from fuseserve.gateway.http_errors import SchedulerRejectedError
from fuseserve.gateway.streams import ResponseRouter
from fuseserve.messages import RequestMessage
from fuseserve.types import TokenEvent


class ClientDisconnected(Exception):
    """The HTTP client went away before the request finished."""


class SequenceState(OutputState):
    """One generated sequence of a request: choice ``choice`` of the response, ``seq_id`` in the engine.

    prompt_index: which prompt of the request it continues (``n`` sequences share one).
    last_token_at: monotonic seconds of its last token (inter-token latency metric).
    echo / echo_only: see ``render.py`` (completions' ``echo``).
    text_parser: see ``OutputState`` (chat with tools: a ``fuseserve.tools.ToolCallParser``).
    """

    def __init__(
        self,
        choice: int,
        seq_id: int,
        prompt_index: int,
        prompt_ids: list[int],
        params,
        tokenizer,
        text_parser=None,
    ):
        super().__init__(prompt_ids, params, tokenizer, text_parser)
        self.choice = choice
        self.seq_id = seq_id
        self.prompt_index = prompt_index
        self.last_token_at: float | None = None
        self.echo: str | None = None  # completions' echo: the prompt's text, shown before the output
        self.echo_only = False  # echo with max_tokens 0: the prompt only (its one generated token hidden)


class Generation:
    """The sequences of one HTTP request, sharing one event queue.

    is_disconnected: awaited every ``poll_s`` seconds while no event arrives; True aborts.
    lora: the LoRA adapter every sequence runs with (None: the base model).
    """

    def __init__(
        self,
        router: ResponseRouter,
        metrics: GatewayMetrics,
        seqs: list[SequenceState],
        request_id: str,
        is_disconnected: Callable[[], Awaitable[bool]],
        poll_s: float = 0.25,
        cache_salt: str | None = None,
        lora: str | None = None,
    ):
        self.router = router
        self.metrics = metrics
        self.seqs = seqs
        self.request_id = request_id
        self.is_disconnected = is_disconnected
        self.poll_s = poll_s
        self.cache_salt = cache_salt
        self.lora = lora
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self._by_seq = {s.seq_id: s for s in seqs}
        self._queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    @property
    def error(self) -> dict | None:
        return next((s.error for s in self.seqs if s.error is not None), None)

    async def submit(self) -> None:
        """Register the event queue, then XADD every sequence to the scheduler."""
        for s in self.seqs:
            self.router.register(s.seq_id, self._queue, self.lora)
        msgs = [
            RequestMessage(
                s.seq_id,
                self.request_id,
                self.router.gateway_id,
                s.prompt_ids,
                s.params.to_dict(),
                cache_salt=self.cache_salt,
                lora=self.lora,
            )
            for s in self.seqs
        ]
        try:
            await self.router.submit(msgs)
        except BaseException:
            for s in self.seqs:
                self.router.unregister(s.seq_id)
            raise
        self.metrics.prompt_tokens.inc(sum(len(s.prompt_ids) for s in self.seqs))

    def abort(self, reason: str = "abort") -> None:
        """Abort every unfinished sequence (the scheduler frees them); idempotent. Each counts as
        finished with "abort", or "error" when another sequence of the request failed."""
        live = [s for s in self.seqs if not s.finished]
        outcome = "abort" if self.error is None else "error"
        for s in live:
            s.finish_reason = "abort"
            self.metrics.count_finished(outcome)
        self.router.abort([s.seq_id for s in live], reason)

    async def batches(self) -> AsyncIterator[dict[int, Delta]]:
        """Yield ``{choice: Delta}`` for each batch of events until every sequence finished.

        A scheduler error event on one sequence aborts the others (the request fails as a whole).
        Raises ``ClientDisconnected`` (after aborting) when the client goes away.
        """
        checked_at = time.monotonic()
        while not self.finished:
            try:
                first = await asyncio.wait_for(self._queue.get(), timeout=self.poll_s)
            except TimeoutError:
                first = None
            if time.monotonic() - checked_at >= self.poll_s:
                checked_at = time.monotonic()
                if await self.is_disconnected():
                    self.abort()
                    raise ClientDisconnected()
            if first is None:
                continue
            events = [first]
            while not self._queue.empty():
                events.append(self._queue.get_nowait())
            deltas = self._apply(events)
            if self.error is not None:
                self.abort()
            if deltas:
                yield deltas

    async def run(self) -> None:
        """Consume every event (non-streaming). Raises ``SchedulerRejectedError`` or ``ClientDisconnected``."""
        async for _ in self.batches():
            pass
        if self.error is not None:
            raise scheduler_error(self.error)

    def _apply(self, events: list[TokenEvent]) -> dict[int, Delta]:
        now = time.monotonic()
        deltas: dict[int, Delta] = {}
        for ev in events:
            seq = self._by_seq.get(ev.seq_id)
            if seq is None or seq.finished:
                continue
            delta = deltas.setdefault(seq.choice, Delta())
            if seq.apply(ev, delta):
                self.metrics.generation_tokens.inc()
                if self.first_token_at is None:
                    self.first_token_at = now
                    self.metrics.ttft.observe(now - self.arrival)
                if seq.last_token_at is not None:
                    self.metrics.itl.observe(now - seq.last_token_at)
                seq.last_token_at = now
            if seq.finished:  # just now: finished sequences were skipped above
                self.metrics.count_finished(seq.finish_reason)
                if seq.finish_reason == "stop" and seq.stop_matched:
                    self.router.abort([seq.seq_id], "stop")
                else:
                    self.router.unregister(seq.seq_id)
        return deltas


def scheduler_error(error: dict) -> SchedulerRejectedError:
    """The typed error of a scheduler ``error`` event ``{"message", "type", "status"}``."""
    status = int(error.get("status") or 500)
    kind = error.get("type") or ("invalid_request_error" if 400 <= status < 500 else "server_error")
    return SchedulerRejectedError(
        str(error.get("message") or "the scheduler rejected the request"), status, kind
    )
