"""What a generation returns to the caller (pipeline and Python client alike)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fuseserve.types import TokenLogprob


@dataclass
class Response:
    """One prompt's result.

    text: generated text (stop string removed unless ``include_stop_str_in_output``).
    token_ids: generated token ids (an EOS / stop token that ended generation included).
    prompt_tokens, generated_tokens: counts, in tokens.
    finish_reason: ``"stop"`` (EOS, stop token, stop string), ``"length"`` or ``"abort"``.
    logprobs: per generated token, its logprob (when requested), else empty.
    top_logprobs: per generated token, the top-N alternatives (when requested), else empty.
    prompt_logprobs: with ``prompt_logprobs=N``, per prompt position a ``TokenLogprobs`` (the prompt
        token's id, logprob and top-N alternatives; None at position 0), else None.
    cached_tokens: prompt tokens whose KV came from the prefix cache (not computed again).
    """

    text: str
    token_ids: list[int]
    prompt_tokens: int
    generated_tokens: int
    finish_reason: str
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    prompt_logprobs: list | None = None
    cached_tokens: int = 0
