"""An OpenAI request (completions or chat) to validated ``SamplingParams``, one per sequence.

The generic fields come from ``SamplingParams``' own table (``fuseserve.frontend.params``); what is
mapped here by hand is only what differs per endpoint or per sequence: ``max_tokens`` (default: the
rest of the context, as vLLM; chat's ``max_completion_tokens``; 0 with ``echo``: the prompt is only
scored), ``logprobs`` (an int on completions; a bool plus ``top_logprobs`` on chat; with ``echo``
also ``prompt_logprobs``), ``seed`` (sequence ``i`` of ``n`` uses
``seed + i``), the output constraints and ``logit_bias`` (``fuseserve.frontend.constraints``; a
constraint must compile), and checks that need the model (``stop_token_ids`` inside the vocabulary). The request
object is read by attribute (the gateway's pydantic models, or anything with the same names).
"""

from __future__ import annotations

from typing import Any

from fuseserve.errors import InvalidParameterError, InvalidRequestError
from fuseserve.frontend.constraints import constraint_kwargs
from fuseserve.frontend.encode import PromptEncoder
from fuseserve.frontend.params import params_kwargs_from_body
from fuseserve.sampling_params import MAX_LOGPROBS, SamplingParams, check_text
from fuseserve.structured import grammar_backend  # imports no torch; xgrammar only when compiling

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
"""Seeds travel as signed 64-bit integers (each of ``n`` sequences gets ``seed + index``)."""


def check_n(n: int) -> None:
    """Raise ``InvalidParameterError`` unless n >= 1. The upper bound is a cost limit, configured in
    one place: ``RequestLimits.max_n`` (``--max-n``, checked by ``gateway/limits.py``)."""
    if n < 1:
        raise InvalidParameterError("n", n, "an integer >= 1")


def sampling_params(
    req: Any,
    encoder: PromptEncoder,
    prompt_len: int,
    index: int = 0,
    chat: bool = False,
    defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """Validated params for sequence ``index`` (0..n-1) of a prompt of ``prompt_len`` tokens.

    defaults: ``SamplingParams`` keywords used where the request leaves a field unset (the model's
    ``generation_config.json``). Raises ``InvalidParameterError`` (OpenAI parameter names) or
    ``ContextLengthExceededError``.
    """
    kwargs = {**(defaults or {}), **params_kwargs_from_body(req)}
    requested = getattr(req, "max_completion_tokens", None) if chat else None
    requested = requested if requested is not None else getattr(req, "max_tokens", None)
    echo = not chat and bool(getattr(req, "echo", False))
    if echo and requested == 0:  # score the prompt only: generate one token, shown to nobody (vLLM)
        requested = 1
    if requested is None and "max_new_tokens" in kwargs:  # generation_config.json's, within the context
        requested = max(1, min(kwargs["max_new_tokens"], encoder.max_model_len - prompt_len))
    max_tokens = encoder.max_new_tokens(prompt_len, requested)
    kwargs["max_new_tokens"] = max_tokens
    min_tokens = kwargs.get("min_new_tokens", 0)
    if not isinstance(min_tokens, int) or not 0 <= min_tokens <= max_tokens:
        raise InvalidParameterError("min_tokens", min_tokens, f"an integer in [0, max_tokens={max_tokens}]")
    _check_wire_values(req, encoder.vocab_size)
    kwargs["logprobs"] = _logprobs(req, chat)
    if echo and kwargs["logprobs"] is not None:
        kwargs["prompt_logprobs"] = kwargs["logprobs"]  # echo + logprobs: the prompt's logprobs too
    if kwargs.get("seed") is not None:
        kwargs["seed"] += index
    kwargs.update(constraint_kwargs(req, encoder.vocab_size))
    params = SamplingParams.from_kwargs(**kwargs)
    if params.constrained:  # compiled once and cached: an uncompilable spec is a 400 here
        if encoder.tokenizer is None:  # the grammar compiler needs the vocabulary's strings
            raise InvalidRequestError(
                "structured output needs a tokenizer; start with --tokenizer DIR", param="response_format"
            )
        grammar_backend(encoder.tokenizer, encoder.vocab_size).check(params)
    return params


def _check_wire_values(req: Any, vocab_size: int) -> None:
    """Raise ``InvalidParameterError`` for values the worker cannot take: stop strings that are not
    valid text, ``stop_token_ids`` outside ``[0, vocab_size)``, and a ``seed`` whose ``seed + n - 1``
    leaves the signed 64-bit range."""
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    for stop in stops:
        check_text(stop, "stop")
    for t in req.stop_token_ids or []:
        if not 0 <= t < vocab_size:
            raise InvalidParameterError(
                "stop_token_ids", t, f"token ids in [0, {vocab_size}) (the model's vocabulary)"
            )
    n = getattr(req, "n", 1)
    if req.seed is not None and not SEED_MIN <= req.seed <= SEED_MAX - (n - 1):
        raise InvalidParameterError(
            "seed", req.seed, f"an integer in [-2**63, 2**63 - n] (n={n}: sequence i uses seed + i)"
        )


def _logprobs(req: Any, chat: bool) -> int | None:
    if not chat:
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise InvalidParameterError(
                "logprobs", req.logprobs, f"null or an integer in [0, {MAX_LOGPROBS}]"
            )
        return req.logprobs
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise InvalidParameterError("top_logprobs", req.top_logprobs, "null unless logprobs is true")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise InvalidParameterError(
                "top_logprobs", req.top_logprobs, f"null or an integer in [0, {MAX_LOGPROBS}]"
            )
    return (req.top_logprobs or 0) if req.logprobs else None
