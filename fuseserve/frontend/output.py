"""Per-sequence output state: token events in, text / logprob deltas out (pipeline and gateway).

``OutputState.apply`` takes one token event (from the in-process engine core or from the Redis
response stream) and returns what it adds: every token counts in usage; a hidden token (EOS / a
stop token id) adds no text; text goes through the incremental detokenizer and the stop-string
matcher (``fuseserve.detokenizer``); a matched stop string finishes the sequence with "stop" and
``stop_matched`` tells the caller to free it in the engine at once. ``index`` drops duplicate events
(a restarted scheduler may resend).

Hook for parsers of the generated text (tool calls): ``text_parser`` sits between the detokenized
text and the emitted delta. It gets each new piece of text and the ``Delta`` being built, sets the
content it lets through (``delta.text``) and may add ``delta.tool_calls``; ``finish`` flushes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from fuseserve.detokenizer import DetokenizeStream
from fuseserve.sampling_params import SamplingParams
from fuseserve.types import PromptLogprobs, TokenEvent, TokenLogprob


@dataclass
class TokenLogprobs:
    """A visible generated token with its logprob and its top alternatives."""

    token_id: int
    logprob: float | None
    top: list[TokenLogprob]


@dataclass
class Delta:
    """What events added to one sequence: content text, logprobs of its visible tokens, parsed
    items (tool calls, from a ``text_parser``), and whether the sequence finished."""

    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    tool_calls: list[Any] = field(default_factory=list)
    finished: bool = False


class TextParser(Protocol):
    """An incremental parser of generated text (e.g. tool calls) placed by ``OutputState``."""

    def push(self, text: str, delta: Delta) -> None:
        """Consume newly detokenized ``text``: add the content to show to ``delta.text``, parsed
        items to ``delta.tool_calls``."""

    def finish(self, delta: Delta) -> None:
        """The sequence ended: flush anything held back into ``delta``."""


class OutputState:
    """One generated sequence's output so far.

    prompt_ids: its prompt's token ids. params: its validated ``SamplingParams``. tokenizer: for
    the detokenizer (None: token ids only, no text). text_parser: see the module docstring.

    Attributes: token_ids (every generated id, hidden ones included); logprobs / top_logprobs (per
    generated token, when asked for); visible (logprobs of the visible tokens); prompt_logprobs (per
    prompt position, None at position 0 and where not computed; None unless asked for); finish_reason
    ("stop", "length", "abort", "error" or None while running); error (the event's error, as given);
    cached_tokens (prompt tokens the engine found in its prefix cache, from the first token's event).
    """

    def __init__(
        self, prompt_ids: list[int], params: SamplingParams, tokenizer, text_parser: TextParser | None = None
    ):
        self.prompt_ids = prompt_ids
        self.params = params
        self.detok = (
            DetokenizeStream(tokenizer, params.stop, params.include_stop_str_in_output) if tokenizer else None
        )
        self.text_parser = text_parser
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[TokenLogprob]] = []
        self.visible: list[TokenLogprobs] = []
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.next_index = 0
        self.fence = 0  # the highest fence of the events applied (a lower one: a fenced-off scheduler's)
        self.finish_reason: str | None = None
        self.error: Any = None
        self.cached_tokens = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stop_matched(self) -> bool:
        """A stop string ended the sequence (the engine must be told to free it)."""
        return self.detok is not None and self.detok.stopped

    def _text(self, piece: str, delta: Delta) -> None:
        if self.text_parser is not None:
            before = len(delta.text)
            self.text_parser.push(piece, delta)
            self.text += delta.text[before:]
        elif piece:
            delta.text += piece
            self.text += piece

    def apply(self, ev: TokenEvent, delta: Delta) -> bool:
        """Add one engine event to ``delta``; True when it carried a new token (False: duplicate or none).

        ``ev.index``: the token's position in the output (-1: unknown); an index already seen is a
        duplicate (a restarted scheduler resends) and ignored. ``ev.fence``: an event below the highest
        fence applied comes from a scheduler the request was taken from, and is ignored whole (a
        stalled scheduler's late tokens or errors). ``ev.error`` finishes the sequence with
        "error" (``self.error``: ``ev.error_info()``). ``ev.prompt_logprobs``: prompt-token logprobs,
        kept one per position. ``ev.cached_tokens``: on the first token's event (index 0), the prompt
        tokens served from the prefix cache.
        """
        tok = ev.token
        token_id = tok.token_id if tok is not None else None
        logprob = tok.logprob if tok is not None else None
        index, hidden, prompt_logprobs = ev.index, ev.hidden, ev.prompt_logprobs
        cached_tokens = ev.cached_tokens if index == 0 else None
        error = ev.error_info()
        finish_reason = ev.finish_reason.value if ev.finish_reason is not None else None
        if self.finished or ev.fence < self.fence:
            return False
        self.fence = ev.fence
        if prompt_logprobs is not None:
            self._add_prompt_logprobs(prompt_logprobs)
        new_token = False
        if token_id is not None:
            if 0 <= index < self.next_index:
                return False  # a duplicate: applied the first time it came
            if index >= 0:
                self.next_index = index + 1
            new_token = True
            if cached_tokens is not None:
                self.cached_tokens = cached_tokens
            self.token_ids.append(token_id)
            tops = tok.top_logprobs
            if logprob is not None:
                self.logprobs.append(logprob)
                self.top_logprobs.append(tops)
            if not hidden:
                if self.detok is not None:
                    self._text(self.detok.push([token_id]), delta)
                if self.params.logprobs is not None:
                    entry = TokenLogprobs(token_id, logprob, tops)
                    self.visible.append(entry)
                    delta.logprobs.append(entry)
            if self.stop_matched:
                self.finish_reason = "stop"
                self._finish(delta)
                return new_token
        if error is not None:
            self.error = error
            self.finish_reason = "error"
            delta.finished = True
        elif finish_reason is not None:
            self.finish_reason = finish_reason
            if self.detok is not None:
                self._text(self.detok.finish(), delta)
            self._finish(delta)
        return new_token

    def _add_prompt_logprobs(self, p: PromptLogprobs) -> None:
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_ids)
        for i, lp in enumerate(p.logprobs):
            pos = p.start_pos + i
            if 0 < pos < len(self.prompt_ids):
                self.prompt_logprobs[pos] = TokenLogprobs(self.prompt_ids[pos], lp, list(p.top[i]))

    def _finish(self, delta: Delta) -> None:
        if self.text_parser is not None:
            before = len(delta.text)
            self.text_parser.finish(delta)
            self.text += delta.text[before:]
        delta.finished = True
