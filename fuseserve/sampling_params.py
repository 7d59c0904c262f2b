"""Per-request sampling and generation parameters, validated once at the edge.

Ranges follow the OpenAI API (temperature, top_p, presence/frequency penalties) and the
``transformers`` / vLLM conventions (top_k, min_p, repetition_penalty). The gateway and the pipeline
call :meth:`SamplingParams.validate` before a request enters the engine; the sampler trusts it.
"""

from __future__ import annotations

import json
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

#: ``top_k`` crosses the wire as int32 (``proto/worker.proto``); a larger k keeps every token anyway.
MAX_TOP_K = 2**31 - 1

#: Repetition penalty range: outside it the scaled logits overflow fp32.
MIN_PENALTY = 0.01
MAX_PENALTY = 100.0
"""Upper bound accepted for temperature (OpenAI documents 0..2; larger values are harmless)."""

#: ``logit_bias`` values are clipped to this range by OpenAI; we reject values outside it.
MAX_LOGIT_BIAS = 100.0

#: Most ``logit_bias`` entries and ``choice`` strings per request.
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_CHOICES = 1024


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
    json_schema: the output is JSON valid under this JSON Schema (a dict, or its JSON text; stored as
        text). ``{"type": "object"}`` is OpenAI's ``json_object`` mode.
    regex: the output matches this regular expression (whole output).
    choice: the output is exactly one of these strings.
    grammar: the output is derived from this EBNF grammar (xgrammar / GBNF syntax, rule ``root``).
        At most one of json_schema / regex / choice / grammar is set (``fuseserve/structured.py``
        compiles them; the front end checks that they compile).
    logit_bias: token id → bias in [-100, 100] added to that token's logit before sampling
        (OpenAI semantics; -100 effectively bans the token).
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
    json_schema: str | dict | None = _param(
        None, "JSON Schema the output must satisfy", openai=None, cli=False
    )
    regex: str | None = _param(None, "regular expression the output must match", openai=None, cli=False)
    choice: list[str] | None = _param(None, "the output is one of these strings", openai=None, cli=False)
    grammar: str | None = _param(None, "EBNF grammar the output must derive from", openai=None, cli=False)
    logit_bias: dict[int, float] = _param(dict, "token id -> bias added to its logit", openai=None, cli=False)

    def __post_init__(self):
        if isinstance(self.json_schema, dict):  # one canonical form (key order kept: it orders fields)
            self.json_schema = json.dumps(self.json_schema)

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

    @property
    def constrained(self) -> bool:
        """True when a grammar (json_schema / regex / choice / grammar) constrains the output."""
        return any(getattr(self, k) is not None for k in ("json_schema", "regex", "choice", "grammar"))

    # ------------------------------------------------------------------ validation
    def validate(self) -> SamplingParams:
        """Check every field against its allowed range; returns ``self`` for chaining.

        Raises:
            InvalidParameterError: naming the first offending parameter, its value and the range.
        """
        self._validate_lengths()
        self._validate_sampling()
        self._validate_stops()
        self._validate_outputs()
        self._validate_constraints()
        return self

    def _validate_lengths(self) -> None:
        """``max_new_tokens`` and ``min_new_tokens``."""
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InvalidParameterError("max_new_tokens", self.max_new_tokens, "an integer >= 1")
        if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise InvalidParameterError(
                "min_new_tokens",
                self.min_new_tokens,
                f"an integer in [0, max_new_tokens={self.max_new_tokens}]",
            )

    def _validate_sampling(self) -> None:
        """The distribution's parameters: temperature, top_k, top_p, min_p, penalties, seed."""
        if not _is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidParameterError(
                "temperature", self.temperature, f"a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy)"
            )
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_TOP_K:
            raise InvalidParameterError(
                "top_k", self.top_k, f"-1 or 0 (off), or an integer in [1, {MAX_TOP_K}]"
            )
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

    def _validate_stops(self) -> None:
        """``stop``, ``stop_token_ids`` and ``ignore_eos``."""
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

    def _validate_outputs(self) -> None:
        """What is returned: ``logprobs``, ``prompt_logprobs``, ``include_stop_str_in_output``."""
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

    def _validate_constraints(self) -> None:
        """Types and ranges of the structured-output fields and ``logit_bias`` (not compilation)."""
        set_ = [k for k in ("json_schema", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if len(set_) > 1:
            raise InvalidRequestError(
                f"at most one of json_schema, regex, choice, grammar may be set; got {', '.join(set_)}",
                param=set_[1],
            )
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema) if isinstance(self.json_schema, str) else None
            except ValueError as exc:
                raise InvalidParameterError("json_schema", "<text>", f"a JSON object ({exc})") from exc
            if not isinstance(schema, dict):
                raise InvalidParameterError("json_schema", "<value>", "a JSON Schema object")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or not _is_utf8(value)):
                raise InvalidParameterError(name, value, "a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not 0 < len(self.choice) <= MAX_CHOICES
            or not all(isinstance(c, str) and c and _is_utf8(c) for c in self.choice)
        ):
            raise InvalidParameterError("choice", self.choice, f"1 to {MAX_CHOICES} non-empty strings")
        bias = self.logit_bias
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidParameterError(
                "logit_bias", bias, f"a map of at most {MAX_LOGIT_BIAS_ENTRIES} entries"
            )
        for token, value in bias.items():
            if not _is_int(token) or not 0 <= token < MAX_TOKEN_ID:
                raise InvalidParameterError("logit_bias", token, f"token ids in [0, {MAX_TOKEN_ID}) as keys")
            if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise InvalidParameterError(
                    "logit_bias", value, f"bias values in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
                )

    # ------------------------------------------------------------------ construction / transport
    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> SamplingParams:
        """Build from keyword arguments, then validate.

        ``stop`` may be a single string; ``stop`` / ``stop_token_ids`` / ``logit_bias`` may be None
        (= empty); ``logit_bias`` keys may be decimal strings (JSON objects).

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
        if kwargs.get("logit_bias") is None and "logit_bias" in kwargs:
            kwargs["logit_bias"] = {}
        elif isinstance(kwargs.get("logit_bias"), dict):  # JSON (OpenAI, Redis) has string keys
            kwargs["logit_bias"] = {
                int(k) if isinstance(k, str) and k.isascii() and k.isdigit() else k: v
                for k, v in kwargs["logit_bias"].items()
            }
        if isinstance(kwargs.get("choice"), tuple):
            kwargs["choice"] = list(kwargs["choice"])
        params = cls(**kwargs)
        return params.validate()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field (lists copied)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Inverse of :meth:`to_dict`; unknown keys raise like :meth:`from_kwargs`."""
        return cls.from_kwargs(**data)
