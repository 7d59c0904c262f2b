"""OpenAI response shapes: completions and chat, whole responses and SSE chunks, logprobs, usage.

Completions logprobs: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``.
Chat logprobs: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}]}``. Logprobs cover the visible tokens (a hidden EOS / stop token is counted in usage only).

A streamed error (the scheduler rejected a sequence after the 200 was sent) is one event
``data: {"error": {"message", "type", "param", "code", "status"}}`` (``status``: the HTTP status
the request would have had), then ``data: [DONE]``.

Chat requests with tools: the assistant text goes through ``fuseserve.tools.ToolCallParser``;
parsed calls become ``message.tool_calls`` (streamed: ``delta.tool_calls`` pieces) and
``finish_reason`` ``"tool_calls"``.

Extension (request ``"return_token_ids": true``): each choice of a non-streamed response also has
``token_ids`` (every generated id, a hidden EOS / stop token included, as ``Response.token_ids``),
``prompt_tokens`` (the prompt's length in tokens) and, when logprobs were asked for, ``token_logprobs`` (per generated id, its logprob) and
``top_logprob_ids`` (per generated id, ``[[token_id, logprob], ...]``).
"""

from __future__ import annotations

import json
import time
import uuid

from fuseserve.gateway.generation import Delta, SequenceState, TokenLogprobs


def sse(payload: dict | str) -> bytes:
    """One server-sent event ``data: ...`` (a dict is JSON-encoded)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


class Renderer:
    """Builds the bodies of one request. ``chat``: chat shapes, else completions shapes."""

    def __init__(self, tokenizer, model: str, chat: bool, return_token_ids: bool = False, tool_parser=None):
        self.tokenizer = tokenizer
        self.model = model
        self.chat = chat
        self.return_token_ids = return_token_ids
        self._new_tool_parser = tool_parser  # () -> ToolCallParser when the request has tools
        self._tool_parsers: dict = {}  # choice -> its ToolCallParser (streaming)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}  # choice -> characters of text emitted (text_offset)

    # ------------------------------------------------------------------ pieces
    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def usage(self, seqs: list[SequenceState]) -> dict:
        """Prompt tokens count once per prompt (not per ``n``); every generated token counts."""
        prompts = {s.prompt_index: len(s.prompt_ids) for s in seqs}
        prompt_tokens = sum(prompts.values())
        completion_tokens = sum(len(s.token_ids) for s in seqs)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
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
            "top_logprobs": [{self._token(t): lp for t, lp in e.top} or None for e in entries],
            "text_offset": offsets,
        }

    def _chat_logprob(self, e: TokenLogprobs) -> dict:
        tok = self._token(e.token_id)
        top = []
        for tid, lp in e.top:
            alt = self._token(tid)
            top.append({"token": alt, "logprob": lp, "bytes": list(alt.encode())})
        return {"token": tok, "logprob": e.logprob, "bytes": list(tok.encode()), "top_logprobs": top}

    # ------------------------------------------------------------------ whole response
    def response(self, seqs: list[SequenceState]) -> dict:
        """The non-streamed body."""
        choices = []
        for s in seqs:
            lp = self.logprobs(s.choice, s.visible) if s.params.logprobs is not None else None
            if self.chat:
                message, reason = self._message(s)
                choice = {"index": s.choice, "message": message, "logprobs": lp, "finish_reason": reason}
            else:
                choice = {
                    "index": s.choice,
                    "text": s.detok.text,
                    "logprobs": lp,
                    "finish_reason": s.finish_reason,
                }
            if self.return_token_ids:
                choice["token_ids"] = s.token_ids
                choice["prompt_tokens"] = len(s.prompt_ids)
                if s.params.logprobs is not None:
                    choice["token_logprobs"] = s.raw_logprobs
                    choice["top_logprob_ids"] = s.raw_top
            choices.append(choice)
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(seqs),
        }

    def _message(self, s: SequenceState) -> tuple[dict, str | None]:
        """The assistant message of a finished chat choice, with ``tool_calls`` parsed out when the
        request has tools; ``finish_reason`` becomes ``tool_calls`` when a call ended the output."""
        if self._new_tool_parser is None:
            return {"role": "assistant", "content": s.detok.text}, s.finish_reason
        parser = self._new_tool_parser()
        content = parser.feed(s.detok.text).content + parser.finish().content
        message: dict = {"role": "assistant", "content": content or None}
        if parser.calls:
            message["tool_calls"] = parser.calls
        return message, self._finish_reason(s, parser)

    @staticmethod
    def _finish_reason(s: SequenceState, parser) -> str | None:
        return "tool_calls" if parser.calls and s.finish_reason == "stop" else s.finish_reason

    def _chat_delta(
        self, choice: int, seq: SequenceState, text: str, finished: bool
    ) -> tuple[dict, str | None]:
        """A streamed chat ``delta`` and finish reason; with tools, content and tool-call pieces."""
        reason = seq.finish_reason if finished else None
        if self._new_tool_parser is None:
            return ({"content": text} if text or not finished else {}), reason
        parser = self._tool_parsers.get(choice)
        if parser is None:
            parser = self._tool_parsers[choice] = self._new_tool_parser()
        parsed = parser.feed(text)
        if finished:
            tail = parser.finish()
            parsed.content += tail.content
            parsed.tool_calls += tail.tool_calls
            reason = self._finish_reason(seq, parser)
        delta: dict = {}
        if parsed.content:
            delta["content"] = parsed.content
        if parsed.tool_calls:
            delta["tool_calls"] = [d.to_openai() for d in parsed.tool_calls]
        return delta, reason

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
            if not d.text and not d.finished and not d.logprobs:
                continue
            lp = self.logprobs(choice, d.logprobs) if seq.params.logprobs is not None and d.logprobs else None
            reason = seq.finish_reason if d.finished else None
            if self.chat:
                delta, reason = self._chat_delta(choice, seq, d.text, d.finished)
                if not delta and not d.finished and not lp:
                    continue  # text held back by the tool-call parser
                choices.append({"index": choice, "delta": delta, "logprobs": lp, "finish_reason": reason})
            else:
                choices.append({"index": choice, "text": d.text, "logprobs": lp, "finish_reason": reason})
        return self._chunk(choices, include_usage) if choices else None

    def usage_chunk(self, seqs: list[SequenceState]) -> dict:
        body = self._chunk([], include_usage=False)
        body["usage"] = self.usage(seqs)
        return body
