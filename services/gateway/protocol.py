"""Request bodies of the OpenAI-compatible API, as strict pydantic models.

Every model forbids unknown fields (a typo or an unsupported OpenAI option is a 400 naming the
field, never silently ignored) and validates in strict mode (``"5"`` is not an integer; ``true`` is
not a number). Fields beyond OpenAI's (vLLM conventions): ``top_k``, ``min_p``,
``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``,
``include_stop_str_in_output``, ``structured_outputs`` / ``guided_*`` (structured output, see
``constraints.py``), and the fuseserve extension ``return_token_ids`` (each choice then
carries ``token_ids`` and, with logprobs, ``top_logprob_ids``; see ``render.py``).

Response bodies are plain dicts built in ``render.py``; their shapes follow the OpenAI API.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from fuseserve.gateway.constraints import ResponseFormat, StructuredOutputs, Tool, ToolCall, ToolChoice

TokenIds = list[int]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    """``include_usage``: send a last chunk (empty ``choices``) with the request's usage."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Strict):
    """Fields shared by both endpoints; names follow the OpenAI API (lengths in tokens)."""

    model: str
    max_tokens: int | None = None  # None: whatever fits the context (max_model_len - prompt_len)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # fuseserve extension: token ids per choice
    # output constraints and logit_bias (constraints.py maps them onto SamplingParams)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``logprobs``: top-N alternatives per token, 0..20 (0: chosen token only)."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    logprobs: int | None = None
    echo: bool = False  # only false is supported (400 otherwise)


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

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. ``logprobs`` (bool) with ``top_logprobs`` 0..20 alternatives."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = Field(default=None, min_length=1)  # OpenAI rejects []
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
