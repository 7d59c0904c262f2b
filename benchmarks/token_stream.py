"""Per-token events from an in-process `fuseserve.Pipeline`, for benchmark timing.

``Pipeline.stream`` yields text deltas: a delta can hold several tokens (a multi-byte character
completed late) or none. The benchmark needs one timestamp per generated token, so it reads
``Pipeline.stream_tokens``, which yields once per token as soon as the engine thread hands it over.
"""

from __future__ import annotations

from collections.abc import Iterator


def stream_tokens(pipe, prompt_ids: list[int], max_new_tokens: int) -> Iterator[int]:
    """Greedy, EOS ignored: yield 1 per generated token as soon as the engine thread hands it over.

    Raises whatever the engine reports for the request (e.g. ``ContextLengthExceededError``).
    """
    for _ in pipe.stream_tokens(
        list(prompt_ids), max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True
    ):
        yield 1
