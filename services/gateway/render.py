"""OpenAI response shapes: completions and chat, whole responses and SSE chunks, logprobs, usage.

Completions logprobs: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``.
Chat logprobs: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}]}``. Logprobs cover the visible tokens (a hidden EOS / stop token is counted in usage only).

Completions' ``echo``: the text starts with the prompt and, with ``logprobs``, the logprobs start
with the prompt's tokens (the first one's logprob is null: nothing precedes it). With
``max_tokens`` 0 only the prompt is returned (finish "length", no completion tokens): scoring, as
lm-eval's loglikelihood requests use it.

Chat requests with tools: each choice's ``OutputState.text_parser`` is a
``fuseserve.tools.ToolCallParser``; parsed calls become ``message.tool_calls`` (streamed:
``delta.tool_calls`` pieces) and ``finish_reason`` ``"tool_calls"``.

A streamed error (the scheduler rejected a sequence after the 200 was sent) is one event
``data: {"error": {"message", "type", "param", "code", "status"}}`` (``status``: the HTTP status
the request would have had), then ``data: [DONE]``.

Extension (request ``"return_token_ids": true``): each choice of a non-streamed response also has
``token_ids`` (every generated id, a hidden EOS / stop token included, as ``Response.token_ids``),
``prompt_tokens`` (the prompt's length in tokens) and, when logprobs were asked for, ``token_logprobs`` (per generated id, its logprob) and
``top_logprob_ids`` (per generated id, ``[[token_id, logprob], ...]``).
"""

from __future__ import annotations

import json
import time
import uuid

from fuseserve.frontend.output import Delta, TokenLogprobs
from fuseserve.gateway.generation import SequenceState


def sse(payload: dict | str) -> bytes:
    """One server-sent event ``data: ...`` (a dict is JSON-encoded)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


class Renderer:
    """Builds the bodies of one request. ``chat``: chat shapes, else completions shapes."""

    def __init__(self, tokenizer, model: str, chat: bool, return_token_ids: bool = False):
        self.tokenizer = tokenizer
        self.model = model
        self.chat = chat
        self.return_token_ids = return_token_ids
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}  # choice -> characters of text emitted (text_offset)

    # ------------------------------------------------------------------ pieces
    def _token(self, token_id: int) -> str:
        if self.tokenizer is None:  # served without a tokenizer: vLLM's token-id form
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    @staticmethod
    def _prompt_entries(s: SequenceState) -> list[TokenLogprobs]:
        """The prompt's tokens as logprob entries (the first has none: nothing precedes it)."""
        got = s.prompt_logprobs or [None] * len(s.prompt_ids)
        return [e or TokenLogprobs(t, None, []) for t, e in zip(s.prompt_ids, got, strict=True)]

    def usage(self, seqs: list[SequenceState]) -> dict:
        """Prompt tokens count once per prompt (not per ``n``); every generated token counts (none
        for an echo with ``max_tokens`` 0). ``prompt_tokens_details.cached_tokens``: prompt tokens
        served from the prefix cache (per prompt, its first sequence's count)."""
        prompts = {s.prompt_index: len(s.prompt_ids) for s in seqs}
        cached: dict[int, int] = {}
        for s in seqs:
            cached.setdefault(s.prompt_index, s.cached_tokens)
        prompt_tokens = sum(prompts.values())
        completion_tokens = sum(0 if s.echo_only else len(s.token_ids) for s in seqs)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
        }

    def logprobs(self, choice: int, entries: list[TokenLogprobs]) -> dict:
        if self.chat:
            return {"content": [self._chat_logprob(e) for e in entries]}
        tokens, offsets = [], []
        offset = self._offsets.get(choice, 0)
        for e in entries:
            tok = self._token(e.token_id)
            tokens.append(tok)
            offsets.append(offset)
            offset += len(tok)
        self._offsets[choice] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self._token(t.token_id): t.logprob for t in e.top} or None for e in entries],
            "text_offset": offsets,
        }

    def _chat_logprob(self, e: TokenLogprobs) -> dict:
        tok = self._token(e.token_id)
        top = []
        for t in e.top:
            alt = self._token(t.token_id)
            top.append({"token": alt, "logprob": t.logprob, "bytes": list(alt.encode())})
        return {"token": tok, "logprob": e.logprob, "bytes": list(tok.encode()), "top_logprobs": top}

    # ------------------------------------------------------------------ whole response
    def response(self, seqs: list[SequenceState]) -> dict:
        """The non-streamed body."""
        choices = []
        for s in seqs:
            entries = s.visible
            if s.echo is not None:  # completions' echo: the prompt (and its logprobs) first
                entries = self._prompt_entries(s) + ([] if s.echo_only else s.visible)
            lp = self.logprobs(s.choice, entries) if s.params.logprobs is not None else None
            if self.chat:
                choice = {"index": s.choice, "message": self._message(s), "logprobs": lp}
                choice["finish_reason"] = self._finish_reason(s)
            else:
                text = s.text if s.echo is None else s.echo + ("" if s.echo_only else s.text)
                reason = "length" if s.echo_only else s.finish_reason
                choice = {"index": s.choice, "text": text, "logprobs": lp, "finish_reason": reason}
            if self.return_token_ids:
                choice["token_ids"] = s.token_ids
                choice["prompt_tokens"] = len(s.prompt_ids)
                if s.params.logprobs is not None:
                    choice["token_logprobs"] = s.logprobs
                    choice["top_logprob_ids"] = [
                        [[t.token_id, t.logprob] for t in top] for top in s.top_logprobs
                    ]
            choices.append(choice)
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(seqs),
        }

    @staticmethod
    def _message(s: SequenceState) -> dict:
        """The assistant message of a finished chat choice, with the parsed ``tool_calls`` when the
        request has tools (``s.text`` is then the content around the calls)."""
        parser = s.text_parser
        if parser is None:
            return {"role": "assistant", "content": s.text}
        message: dict = {"role": "assistant", "content": s.text or None}
        if parser.calls:
            message["tool_calls"] = parser.calls
        return message

    @staticmethod
    def _finish_reason(s: SequenceState) -> str | None:
        """``tool_calls`` when a parsed call ended the output, else the sequence's own reason."""
        calls = s.text_parser is not None and s.text_parser.calls
        return "tool_calls" if calls and s.finish_reason == "stop" else s.finish_reason

    # ------------------------------------------------------------------ streaming
    def _chunk(self, choices: list[dict], include_usage: bool) -> dict:
        body = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if include_usage:
            body["usage"] = None
        return body

    def role_chunk(self, seqs: list[SequenceState], include_usage: bool) -> dict | None:
        """Chat streams open each choice with ``{"role": "assistant", "content": ""}``."""
        if not self.chat:
            return None
        choices = [
            {
                "index": s.choice,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for s in seqs
        ]
        return self._chunk(choices, include_usage)

    def delta_chunk(
        self, seqs: list[SequenceState], deltas: dict[int, Delta], include_usage: bool
    ) -> dict | None:
        """A chunk for one batch of events; None when it carries neither text nor a finish."""
        choices = []
        for choice, d in sorted(deltas.items()):
            seq = seqs[choice]
            if not d.text and not d.finished and not d.logprobs and not d.tool_calls:
                continue
            lp = self.logprobs(choice, d.logprobs) if seq.params.logprobs is not None and d.logprobs else None
            reason = self._finish_reason(seq) if d.finished else None
            if self.chat:
                delta = {"content": d.text} if d.text or not (d.finished or d.tool_calls) else {}
                if d.tool_calls:
                    delta["tool_calls"] = [c.to_openai() for c in d.tool_calls]
                choices.append({"index": choice, "delta": delta, "logprobs": lp, "finish_reason": reason})
            else:
                choices.append({"index": choice, "text": d.text, "logprobs": lp, "finish_reason": reason})
        return self._chunk(choices, include_usage) if choices else None

    def usage_chunk(self, seqs: list[SequenceState]) -> dict:
        body = self._chunk([], include_usage=False)
        body["usage"] = self.usage(seqs)
        return body
