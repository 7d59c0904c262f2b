"""Stop-string matching over a stream of text pieces.

Text that might be the start of a stop string is held back until the next piece rules it in or
out; on a match the stop string and everything after it are dropped (or the stop string is kept,
with ``include_stop_str_in_output``).

Which match wins: the stop string that *completes first* in the text (smallest end offset); among
those ending at the same offset, the one that starts first (the longest). This is what a server
that stops generating as soon as a stop string appears produces, and it does not depend on how the
text is cut into pieces: feeding the whole text at once gives the same result as feeding it one
character at a time.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopMatcher:
    """Streams text through a set of stop strings.

    stop: the stop strings (empty strings are ignored; duplicates are harmless).
    include_stop_str_in_output: keep the matched stop string at the end of the text.

    Attributes:
        stopped: a stop string matched; later pushes return "".
        stop_reason: the matched stop string, or None.
    """

    def __init__(self, stop: Iterable[str] = (), include_stop_str_in_output: bool = False):
        self.stops: list[str] = sorted({s for s in stop if s}, key=len)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stopped = False
        self.stop_reason: str | None = None
        self._held = ""  # received but not yet emitted: a possible start of a stop string

    def push(self, piece: str) -> str:
        """Add ``piece``; return the text now safe to emit (may be ""), the final text on a match."""
        if self.stopped or not piece:
            return ""
        if not self.stops:
            return piece
        text = self._held + piece
        match = self._first_match(text)
        if match is not None:
            start, stop = match
            self.stopped = True
            self.stop_reason = stop
            self._held = ""
            return text[: start + len(stop)] if self.include_stop_str_in_output else text[:start]
        keep = self._partial_suffix_len(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """End of text: return what was held back ("" after a match)."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the match ending first (ties: starting first), or None."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self.stops:
            i = text.find(s)
            if i >= 0:
                cand = (i + len(s), i, s)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        return None if best is None else (best[1], best[2])

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        longest = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
