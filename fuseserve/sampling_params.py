"""Per-request sampling and generation parameters, validated once at the edge.

Ranges follow the OpenAI API (temperature, top_p, presence/frequency penalties) and the
``transformers`` / vLLM conventions (top_k, min_p, repetition_penalty). The gateway and the pipeline
call :meth:`SamplingParams.validate` before a request enters the engine; the sampler trusts it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from fuseserve.errors import InvalidParameterError, InvalidRequestError

MAX_LOGPROBS = 20
"""Largest ``logprobs`` (top-N alternatives per token) a request may ask for."""

MAX_STOP_STRINGS = 16
"""Largest number of stop strings per request."""

MAX_TEMPERATURE = 100.0

#: Temperatures below this decode greedily (vLLM's ``_SAMPLING_EPS``).
GREEDY_TEMPERATURE = 1e-5

#: Token ids cross the wire as uint32; any real vocabulary is far smaller.
MAX_TOKEN_ID = 2**31

#: Repetition penalty range: outside it the scaled logits overflow fp32.
MIN_PENALTY = 0.01
MAX_PENALTY = 100.0
"""Upper bound accepted for temperature (OpenAI documents 0..2; larger values are harmless)."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates
        return False
    return True


def check_text(text: str, param: str) -> None:
    """Raise ``InvalidRequestError`` (``param``) unless ``text`` can be encoded as UTF-8.

    Shared by every front end (pipeline, gateway) for prompts, messages and stop strings.
    """
    if not _is_utf8(text):
        start = next(i for i, ch in enumerate(text) if not _is_utf8(ch))
        raise InvalidRequestError(
            f"{param} is not valid text: lone surrogate U+{ord(text[start]):04X} at character {start}; "
            "text must be encodable as UTF-8",
            param=param,
        )


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _param(default, help: str, *, openai: str | None = "", openai_type: object = None, cli: bool = True):
    """A ``SamplingParams`` field with the facts every front end derives from it.

    default: the value, or a factory (``list``) for mutable defaults. help: one line for ``--help``.
    openai: the field's name in an OpenAI request body ("" = the same name; None = mapped by hand,
    per endpoint, as ``logprobs``). openai_type: the body's type when it differs from the field's
    (``stop`` also takes one string). cli: offer it as a ``fuseserve generate`` flag.
    """
    meta = {"help": help, "openai": openai, "openai_type": openai_type, "cli": cli}
    if callable(default):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class SamplingParams:
    """How one request chooses its tokens and when it stops.

    max_new_tokens: tokens to generate at most (>= 1).
    min_new_tokens: EOS and ``stop_token_ids`` are banned until this many tokens exist
        (0 <= min_new_tokens <= max_new_tokens).
    temperature: logits are divided by it; 0 means greedy (argmax). Range [0, 100].
    top_k: keep the k most likely tokens; 0 or -1 turns it off. 1 is greedy.
    top_p: nucleus sampling; keep the smallest set of tokens whose probability reaches top_p.
        Range (0, 1]; 1 turns it off.
    min_p: drop tokens whose probability is below ``min_p * max_prob``. Range [0, 1]; 0 is off.
    repetition_penalty: ``transformers`` semantics over prompt + output tokens (> 0; 1 is off).
    presence_penalty, frequency_penalty: OpenAI semantics over output tokens, each in [-2, 2].
    seed: when set, the request's random draws come from its own generator, so its tokens do not
        depend on the rest of the batch.
    stop: up to 16 non-empty stop strings (matched on detokenized text).
    stop_token_ids: token ids that end the sequence like EOS (the id itself is not shown as text).
    ignore_eos: keep generating past EOS (the EOS ids are never sampled).
    logprobs: None for none; 0 for the chosen token's logprob; N (<= 20) for the top-N as well.
    include_stop_str_in_output: keep the matched stop string at the end of the output text.
    prompt_logprobs: None for none; N (<= 20) for each prompt token after the first its logprob and
        the top-N alternatives (the OpenAI completions API's ``echo`` with ``logprobs``).
    """

    max_new_tokens: int = _param(16, "tokens to generate at most", openai="max_tokens")
    min_new_tokens: int = _param(
        0, "EOS and stop_token_ids are banned before this many tokens", openai="min_tokens"
    )
    temperature: float = _param(1.0, "logits are divided by it; 0 = greedy")
    top_k: int = _param(0, "keep the k most likely tokens; 0 or -1 = off")
    top_p: float = _param(1.0, "nucleus sampling mass in (0, 1]; 1 = off")
    min_p: float = _param(0.0, "drop tokens below min_p x the top probability; 0 = off")
    repetition_penalty: float = _param(1.0, "transformers semantics over prompt + output; 1 = off")
    presence_penalty: float = _param(0.0, "OpenAI semantics, [-2, 2]")
    frequency_penalty: float = _param(0.0, "OpenAI semantics, [-2, 2]")
    seed: int | None = _param(None, "per-request seed (same output whatever the batch)")
    stop: list[str] = _param(list, "stop string (repeatable)", openai_type=str | list[str] | None)
    stop_token_ids: list[int] = _param(list, "token id that ends generation like EOS (repeatable)")
    ignore_eos: bool = _param(False, "keep generating past EOS")
    logprobs: int | None = _param(
        None, "top-N logprobs per token (0: the chosen token's only)", openai=None, cli=False
    )
    include_stop_str_in_output: bool = _param(False, "keep the matched stop string in the text")
    prompt_logprobs: int | None = _param(
        None, "prompt tokens' logprobs with top-N alternatives (scoring)", openai=None, cli=False
    )

    # ------------------------------------------------------------------ derived properties
    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax: top_k 1, or a temperature below ``GREEDY_TEMPERATURE``
        (as in vLLM: a smaller one would overflow the scaled logits)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """True when any repetition / presence / frequency penalty changes the logits."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    # ------------------------------------------------------------------ validation
    def validate(self) -> SamplingParams:
        """Check every field against its allowed range; returns ``self`` for chaining.

        Raises:
            InvalidParameterError: naming the first offending parameter, its value and the range.
        """
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InvalidParameterError("max_new_tokens", self.max_new_tokens, "an integer >= 1")
        if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise InvalidParameterError(
                "min_new_tokens",
                self.min_new_tokens,
                f"an integer in [0, max_new_tokens={self.max_new_tokens}]",
            )
        if not _is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidParameterError(
                "temperature", self.temperature, f"a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy)"
            )
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidParameterError("top_k", self.top_k, "-1 or 0 (off), or an integer >= 1")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidParameterError("top_p", self.top_p, "a number in (0, 1]")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidParameterError("min_p", self.min_p, "a number in [0, 1]")
        if (
            not _is_number(self.repetition_penalty)
            or not MIN_PENALTY <= self.repetition_penalty <= MAX_PENALTY
        ):
            raise InvalidParameterError(
                "repetition_penalty", self.repetition_penalty, f"a number in [{MIN_PENALTY}, {MAX_PENALTY:g}]"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise InvalidParameterError(name, value, "a number in [-2, 2]")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**63):
            raise InvalidParameterError("seed", self.seed, "null or a signed 64-bit integer")
        if (
            not isinstance(self.stop, (list, tuple))
            or len(self.stop) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s and _is_utf8(s) for s in self.stop)
        ):
            raise InvalidParameterError(
                "stop", self.stop, f"at most {MAX_STOP_STRINGS} non-empty strings of valid Unicode"
            )
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            _is_int(t) and 0 <= t < MAX_TOKEN_ID for t in self.stop_token_ids
        ):
            raise InvalidParameterError(
                "stop_token_ids", self.stop_token_ids, f"a list of token ids in [0, {MAX_TOKEN_ID})"
            )
        if not isinstance(self.ignore_eos, bool):
            raise InvalidParameterError("ignore_eos", self.ignore_eos, "true or false")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise InvalidParameterError(
                "logprobs", self.logprobs, f"null or an integer in [0, {MAX_LOGPROBS}]"
            )
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise InvalidParameterError(
                "prompt_logprobs", self.prompt_logprobs, f"null or an integer in [0, {MAX_LOGPROBS}]"
            )
        if not isinstance(self.include_stop_str_in_output, bool):
            raise InvalidParameterError(
                "include_stop_str_in_output", self.include_stop_str_in_output, "true or false"
            )
        return self

    # ------------------------------------------------------------------ construction / transport
    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> SamplingParams:
        """Build from keyword arguments, then validate.

        ``stop`` may be a single string; ``stop`` / ``stop_token_ids`` may be None (= empty).

        Raises:
            InvalidRequestError: a keyword is not a SamplingParams field (``param`` names it).
            InvalidParameterError: a value is out of range.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in kwargs if k not in known)
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling parameter(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}",
                param=unknown[0],
            )
        # transport / OpenAI conveniences: a single stop string, null lists
        if isinstance(kwargs.get("stop"), str):
            kwargs["stop"] = [kwargs["stop"]]
        for name in ("stop", "stop_token_ids"):
            if name in kwargs and (kwargs[name] is None or isinstance(kwargs[name], tuple)):
                kwargs[name] = list(kwargs[name] or [])
        params = cls(**kwargs)
        return params.validate()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field (lists copied)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Inverse of :meth:`to_dict`; unknown keys raise like :meth:`from_kwargs`."""
        return cls.from_kwargs(**data)
