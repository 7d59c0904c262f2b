"""Request bodies of the OpenAI-compatible API, as strict pydantic models, and the field policy.

Values validate in strict mode (``"5"`` is not an integer; ``true`` is not a number). The sampling
fields are not written here: they come from ``SamplingParams``' own table
(``fuseserve.frontend.params.openai_model_fields``), so a new sampling parameter appears in both
bodies by itself. Fields beyond OpenAI's follow vLLM (``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``, ``min_tokens``, ``include_stop_str_in_output``,
``structured_outputs`` / ``guided_*`` for structured output, see ``fuseserve/frontend/constraints.py``),
plus the fuseserve extension ``return_token_ids`` (each choice then carries ``token_ids`` and, with logprobs,
``top_logprob_ids``; see ``render.py``), and vLLM's ``cache_salt`` (requests share cached prefix
blocks only with requests of the same salt).

Request fields, vLLM's policy (:func:`field_policy`):

- fields that change nothing in the output are accepted and ignored: ``user``, ``metadata``,
  ``store``, ``service_tier``, ``prompt_cache_key``, ``safety_identifier``,
  ``stream_options.include_obfuscation``;
- a known field that would change the output and is not implemented (``UNIMPLEMENTED``) is a 400
  naming it;
- any other unknown top-level field is accepted, logged once per name at warning level (the first
  ``MAX_WARNED_NAMES`` names), and named in the ``x-fuseserve-ignored-fields`` response header
  (:func:`ignored_header`: header-safe names only, at most ``MAX_HEADER_NAMES``).

Response bodies are plain dicts built in ``render.py``; their shapes follow the OpenAI API.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from fuseserve.errors import InvalidRequestError
from fuseserve.frontend.constraints import ResponseFormat, StructuredOutputs, Tool, ToolCall, ToolChoice
from fuseserve.frontend.params import openai_model_fields

log = logging.getLogger(__name__)

TokenIds = list[int]

UNIMPLEMENTED: dict[str, str] = {
    "best_of": "best_of other than n is not supported; use n",
    "suffix": "suffix (insertion) is not supported",
    "functions": "function calls are not supported",
    "function_call": "function calls are not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "reasoning effort is not supported",
    "web_search_options": "web search is not supported",
    # vLLM's extensions
    "use_beam_search": "beam search is not supported",
    "length_penalty": "length_penalty (beam search) is not supported",
    "prompt_logprobs": "prompt_logprobs is not supported here; use echo with logprobs on /v1/completions",
    "allowed_token_ids": "allowed_token_ids is not supported; use logit_bias or structured_outputs.choice",
    "bad_words": "bad_words is not supported; use logit_bias",
    "truncate_prompt_tokens": "truncate_prompt_tokens is not supported; send a shorter prompt",
    "skip_special_tokens": "special tokens are always left out of the text (skip_special_tokens=false is not supported)",
    "spaces_between_special_tokens": "spaces_between_special_tokens=false is not supported",
    "add_generation_prompt": "add_generation_prompt=false is not supported",
    "continue_final_message": "continue_final_message is not supported",
    "chat_template": "a chat template per request is not supported; start the server with --chat-template",
    "chat_template_kwargs": "chat_template_kwargs is not supported",
}
"""Known OpenAI / vLLM fields that would change the output and are not implemented: 400 when set to
anything but None or their default (``NO_CHANGE``)."""

NO_CHANGE: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "bad_words": ([],),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "chat_template_kwargs": ({},),
}
"""vLLM's defaults of those fields, which clients send as they are: accepted (they change nothing)."""

_warned: set[str] = set()

MAX_WARNED_NAMES = 1024
"""Distinct unknown field names logged per process (a client can send any number of them)."""
MAX_HEADER_NAMES = 16
"""Unknown field names listed in the response header; the rest are counted."""
MAX_HEADER_NAME_CHARS = 64


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    """``include_usage``: send a last chunk (empty ``choices``) with the request's usage."""

    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None  # no-op: fuseserve pads nothing


class _Body(BaseModel):
    """Top-level bodies accept unknown fields (collected in ``model_extra``; see :func:`field_policy`)."""

    model_config = ConfigDict(extra="allow", strict=True)


_SamplingFields = create_model(  # the sampling fields, from SamplingParams' own table
    "_SamplingFields", __base__=_Body, __module__=__name__, **openai_model_fields()
)


NULL_IS_DEFAULT = ("n", "stream", "echo", "logprobs", "return_token_ids")
"""Fields OpenAI's schema marks nullable whose null means the default (``n: null`` is one choice)."""


class _RequestFields(_SamplingFields):
    """Fields shared by both endpoints besides the sampling ones; lengths in tokens."""

    model: str
    n: int = 1
    # vLLM's extension, a real field: only requests with the same salt share cached prefix blocks
    cache_salt: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # fuseserve extension: token ids per choice
    # output constraints and logit_bias (frontend/constraints.py maps them onto SamplingParams)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # accepted, change nothing in the output
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in NULL_IS_DEFAULT):
            data = {k: v for k, v in data.items() if not (k in NULL_IS_DEFAULT and v is None)}
        return data


class CompletionRequest(_RequestFields):
    """``POST /v1/completions``. ``logprobs``: top-N alternatives per token, 0..20 (0: chosen token only)."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    logprobs: int | None = None
    echo: bool = False


class TextPart(_Strict):
    """One part of a message's content list; only text parts are supported."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One chat turn; ``content`` is a string or a list of text parts (joined)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools


def check_message_content(messages: Any) -> None:
    """OpenAI's content rules on raw ``messages`` before they are parsed; raises
    ``InvalidRequestError`` (param ``messages``) naming the message: content missing or null in a turn
    other than the assistant's (which may carry only ``tool_calls``), an empty list of parts, or a
    part that is not text (images, audio, files: the model takes text only)."""
    if not isinstance(messages, list):
        return  # the model's own validation answers
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if content is None and m.get("role") not in ("assistant", None):  # no role: the model's error
            raise InvalidRequestError(
                f"messages[{i}]: content is required for role {m.get('role')!r}", "messages"
            )
        if isinstance(content, list):
            if not content:
                raise InvalidRequestError(f"messages[{i}]: content is an empty list of parts", "messages")
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise InvalidRequestError(
                        f"messages[{i}]: content parts of type {kind!r} are not supported (text only)",
                        "messages",
                    )


class ChatCompletionRequest(_RequestFields):
    """``POST /v1/chat/completions``. ``logprobs`` (bool) with ``top_logprobs`` 0..20 alternatives."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = Field(default=None, min_length=1)  # OpenAI rejects []
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _content_rules(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_message_content(data.get("messages"))
        return data


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's shape): ``prompt`` (text) or ``messages`` (chat, through the
    template with the generation prompt). ``add_special_tokens`` applies to ``prompt`` only."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _content_rules(cls, data: Any) -> Any:
        if isinstance(data, dict):  # the chat endpoint's rules: the same template renders both
            check_message_content(data.get("messages"))
        return data


class DetokenizeRequest(_Strict):
    """``POST /detokenize``: ``tokens`` (token ids) back to text."""

    model: str | None = None
    tokens: TokenIds


def field_policy(req: BaseModel) -> list[str]:
    """Apply the request-field policy to a parsed body; returns the ignored unknown field names.

    Raises ``InvalidRequestError`` (param: the field) for a set field in ``UNIMPLEMENTED``.
    """
    extra: dict[str, Any] = req.model_extra or {}
    for name, value in extra.items():
        if name == "best_of" and value == getattr(req, "n", 1) and type(value) is int:
            continue  # as many candidates as choices: what n alone gives
        unchanged = any(value == v and type(value) is type(v) for v in NO_CHANGE.get(name, ()))
        if name in UNIMPLEMENTED and value is not None and not unchanged:
            raise InvalidRequestError(f"'{name}': {UNIMPLEMENTED[name]}", param=name)
    ignored = sorted(n for n in extra if n not in UNIMPLEMENTED)
    new = [n for n in ignored if n not in _warned][: max(0, MAX_WARNED_NAMES - len(_warned))]
    if new:
        _warned.update(new)
        shown = ", ".join(repr(n[:MAX_HEADER_NAME_CHARS]) for n in new[:MAX_HEADER_NAMES])
        more = f" and {len(new) - MAX_HEADER_NAMES} more" if len(new) > MAX_HEADER_NAMES else ""
        log.warning("ignoring unknown request fields %s%s (named in x-fuseserve-ignored-fields)", shown, more)
    return ignored


def ignored_header(names: list[str]) -> str:
    """The ``x-fuseserve-ignored-fields`` value for ignored field ``names``: the first
    ``MAX_HEADER_NAMES`` that are printable ASCII without commas and at most
    ``MAX_HEADER_NAME_CHARS`` long, comma-separated, then ``(+N more)`` for the rest (a name with a
    newline, a NUL or a non-Latin-1 character cannot be a header value)."""
    safe = [
        n
        for n in names
        if n.isascii() and n.isprintable() and "," not in n and len(n) <= MAX_HEADER_NAME_CHARS
    ]
    shown = safe[:MAX_HEADER_NAMES]
    rest = len(names) - len(shown)
    return ",".join(shown + ([f"(+{rest} more)"] if rest else []))
