"""Incremental (streaming) detokenization with stop strings, one stream per request.

Decoding follows the prefix-offset / read-offset scheme of text-generation-inference and vLLM:
each new token is decoded together with a few tokens before it (``ids[prefix_offset:]``), and the
text beyond what those earlier tokens decode to (``ids[prefix_offset:read_offset]``) is the new
piece. A piece ending in U+FFFD (an incomplete multi-byte character, as byte-level BPE splits CJK
and emoji over several tokens) is held back until later tokens complete it, so a stream never
shows a replacement character that the full decode would not show. At ``finish()`` the stream
reconciles with ``tokenizer.decode(all_ids)``, so the joined deltas equal the full decode whenever
no stop string matched.

The decoded text then runs through :class:`fuseserve.stop.StopMatcher` (see there for which of
several overlapping stop strings wins). The gateway and the pipeline both use this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from fuseserve.stop import StopMatcher

_REPLACEMENT = "\ufffd"


class DetokenizeStream:
    """Turns a request's generated token ids into text deltas, applying stop strings.

    tokenizer: a Hugging Face fast tokenizer (anything with ``decode(ids, skip_special_tokens=...)``).
    stop: stop strings (at most a handful; empty strings ignored).
    include_stop_str_in_output: keep the matched stop string at the end of the text.
    skip_special_tokens: passed to ``tokenizer.decode``.

    Attributes:
        text: everything emitted so far (the join of all returned deltas).
        stopped: a stop string matched; later pushes are ignored.
        stop_reason: the matched stop string, or None.
        token_ids: every id pushed (including ids pushed after the stop, which are ignored).
    """

    def __init__(
        self,
        tokenizer,
        stop: Iterable[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._stop = StopMatcher(stop, include_stop_str_in_output)
        self.token_ids: list[int] = []
        self.text = ""
        self._decoded = ""  # all decoded text handed to the stop matcher
        self._prefix_offset = 0  # ids[prefix_offset:read_offset] give the context of the next piece
        self._read_offset = 0  # ids before this have been turned into text
        self._finished = False

    @property
    def stopped(self) -> bool:
        return self._stop.stopped

    @property
    def stop_reason(self) -> str | None:
        return self._stop.stop_reason

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: Sequence[int] | int) -> str:
        """Add generated token ids; return the new text safe to show ("" when all is held back).

        Tokens are processed one at a time, so pushing several at once gives the same text as
        pushing them singly. After a stop match, ``stopped`` is True, the returned piece ends the
        text, and later pushes return "".
        """
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        out = []
        for tid in token_ids:
            if self.stopped or self._finished:
                break
            self.token_ids.append(int(tid))
            piece = self._next_piece()
            if piece:
                out.append(self._emit(piece))
        return "".join(out)

    def finish(self) -> str:
        """End of generation (EOS or length): flush all held-back text; "" if a stop matched."""
        if self._finished:
            return ""
        self._finished = True
        if self.stopped:
            return ""
        full = self._decode(self.token_ids)
        if full.startswith(self._decoded):
            rest = full[len(self._decoded) :]
        else:  # the tokenizer's full decode is not an extension of the pieces: flush the window
            prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
            rest = self._decode(self.token_ids[self._prefix_offset :])[len(prefix_text) :]
        out = self._emit(rest) if rest else ""
        flushed = self._stop.flush()
        self.text += flushed
        return out + flushed

    # ------------------------------------------------------------------ internals
    def _next_piece(self) -> str:
        """Decode the newest token against its context window; advance offsets when complete."""
        ids = self.token_ids
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            piece = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
            return piece
        return ""

    def _emit(self, piece: str) -> str:
        """Run decoded text through the stop matcher; record and return what may be shown."""
        self._decoded += piece
        shown = self._stop.push(piece)
        self.text += shown
        return shown


def detokenize_all(
    tokenizer,
    token_ids: Sequence[int],
    stop: Iterable[str] = (),
    include_stop_str_in_output: bool = False,
    skip_special_tokens: bool = True,
) -> tuple[str, bool]:
    """Non-streamed result: (text, stopped) for all ids at once, built on :class:`DetokenizeStream`.

    Equals the join of the deltas a stream returns for the same ids, however they are pushed.
    """
    stream = DetokenizeStream(tokenizer, stop, include_stop_str_in_output, skip_special_tokens)
    text = stream.push(list(token_ids)) + stream.finish()
    return text, stream.stopped
