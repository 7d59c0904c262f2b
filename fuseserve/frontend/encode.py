"""Prompts to token ids, for the pipeline and the gateway alike: text, token ids, chat messages.

Text is tokenized with the tokenizer's own special tokens (``tokenizer(text)["input_ids"]``); chat
messages are rendered by the chat template (the model's, or ``chat_template`` given at start-up)
with the generation prompt, then tokenized without special tokens. An empty prompt (one that encodes
to no token) is an error, as in vLLM ("the decoder prompt cannot be empty"). Token-id prompts need no
tokenizer. The context check (prompt + ``max_new_tokens`` <= ``max_model_len``) and the default
``max_new_tokens`` of an OpenAI request (the rest of the context, as vLLM) live here too.
"""

from __future__ import annotations

from typing import Any

from fuseserve.errors import ContextLengthExceededError, InvalidParameterError, InvalidRequestError
from fuseserve.sampling_params import check_text
from fuseserve.tools import check_tool_messages, render_messages, template_supports_tools

MAX_PROMPTS = 256
"""Largest number of prompts in one batch (a completions request or one pipeline call)."""

Prompt = str | list[int]


def is_token_ids(x: object) -> bool:
    """True for a list of ints (bools excluded); ``[]`` counts (an empty prompt)."""
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def as_batch(prompts: object) -> list[Prompt]:
    """``prompts`` as a list of prompts: a str, a list of token ids, or a list (tuple) of those.

    Raises ``InvalidRequestError`` (param "prompt") for anything else, for an empty batch, and for
    more than ``MAX_PROMPTS`` prompts.
    """
    if isinstance(prompts, str) or (is_token_ids(prompts) and prompts):
        return [prompts]
    if prompts == []:
        raise InvalidRequestError("prompt is empty", param="prompt")
    if isinstance(prompts, list | tuple) and all(isinstance(p, str) or is_token_ids(p) for p in prompts):
        if len(prompts) > MAX_PROMPTS:
            raise InvalidRequestError(
                f"{len(prompts)} prompts in one request; at most {MAX_PROMPTS}", "prompt"
            )
        return list(prompts)
    raise InvalidRequestError(
        f"a prompt is a string, a list of token ids, or a list of those; got {type(prompts).__name__}",
        param="prompt",
    )


class PromptEncoder:
    """Encodes prompts for one model and checks them against its context.

    tokenizer: a Hugging Face tokenizer, or None (then only token-id prompts are accepted).
    vocab_size: token ids must be below it. max_model_len: the context length in tokens.
    chat_template: a Jinja chat template that replaces the tokenizer's own (``--chat-template``).
    """

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.chat_template = chat_template

    def _need_tokenizer(self, what: str, param: str) -> None:
        if self.tokenizer is None:
            raise InvalidRequestError(
                f"this model was loaded without a tokenizer; {what} needs one (send token ids, or "
                "start with --tokenizer DIR)",
                param=param,
            )

    # ------------------------------------------------------------------ prompts
    def encode(self, prompt: Prompt, param: str = "prompt") -> list[int]:
        """Token ids of one prompt (text or token ids).

        Raises ``InvalidRequestError`` (param ``param``: the request field the prompt came in): not
        valid text, an id outside the vocabulary, no tokenizer for a text prompt, or an empty prompt.
        """
        if isinstance(prompt, str):
            check_text(prompt, param)
            if not prompt:
                raise InvalidRequestError(f"{param} is empty", param=param)
            self._need_tokenizer("a text prompt", param)
            ids = list(self.tokenizer(prompt)["input_ids"])
        elif is_token_ids(prompt):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]} outside [0, {self.vocab_size})", param=param)
            ids = list(prompt)
        else:
            raise InvalidRequestError("a prompt is a string or a list of token ids", param=param)
        if not ids:
            raise InvalidRequestError(f"{param} is empty", param=param)
        return ids

    def encode_batch(self, prompts: object) -> list[list[int]]:
        """Token ids of each prompt of ``prompts`` (see :func:`as_batch`)."""
        return [self.encode(p) for p in as_batch(prompts)]

    def chat(self, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
        """Token ids of ``messages`` rendered by the chat template, with the generation prompt.

        ``messages``: ``[{"role", "content"}, ...]``; content is a string, None, or a list of
        ``{"type": "text", "text"}`` parts (joined); role "developer" is rendered as "system".
        Assistant messages may carry OpenAI ``tool_calls`` and ``tool`` messages a ``tool_call_id``.
        ``tools``: OpenAI tool dicts to render (``fuseserve/tools.py``: through the template when it
        reads ``tools``, else as a generic system-prompt block).
        Raises ``InvalidRequestError`` (param "messages") when there is no chat template or
        tokenizer, a message is malformed or not valid text, a tool exchange is malformed, the
        template rejects the messages, or they render to nothing.
        """
        self._need_tokenizer("a chat request", "messages")
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise InvalidRequestError(
                "this model has no chat template; send a plain prompt", param="messages"
            )
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise InvalidRequestError(
                "messages must be a non-empty list of {'role': ..., 'content': ...} dicts", "messages"
            )
        turns = [_turn(m) for m in messages]
        check_tool_messages(turns)
        extra: dict[str, Any] = {}
        if tools or any(t.get("tool_calls") or t["role"] == "tool" for t in turns):
            turns, extra = render_messages(turns, tools, template_supports_tools(template))
        try:
            text = self.tokenizer.apply_chat_template(
                turns, chat_template=template, add_generation_prompt=True, tokenize=False, **extra
            )
        except Exception as e:  # jinja raises on roles or orders the template does not accept
            raise InvalidRequestError(f"cannot apply the chat template: {e}", param="messages") from e
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if not ids:
            raise InvalidRequestError("messages render to an empty prompt", param="messages")
        return ids

    # ------------------------------------------------------------------ context
    def check_context(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise ``ContextLengthExceededError`` unless prompt + ``max_new_tokens`` fits the context."""
        if prompt_len + max_new_tokens > self.max_model_len:
            raise ContextLengthExceededError(prompt_len, max_new_tokens, self.max_model_len)

    def max_new_tokens(self, prompt_len: int, requested: int | None, param: str = "max_tokens") -> int:
        """``requested`` checked against the context, or the rest of the context when None (vLLM).

        Raises ``InvalidParameterError`` for a value below 1, ``ContextLengthExceededError`` when
        it does not fit (or the prompt fills the context).
        """
        if requested is not None and requested < 1:
            raise InvalidParameterError(param, requested, "an integer >= 1")
        room = self.max_model_len - prompt_len
        if requested is None:
            if room < 1:
                raise ContextLengthExceededError(prompt_len, 1, self.max_model_len)
            return room
        self.check_context(prompt_len, requested)
        return requested


def _turn(message: dict[str, Any]) -> dict[str, Any]:
    """One message as the template sees it: text content joined, "developer" as "system"."""
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
        raise InvalidRequestError("each message needs a string 'role'", param="messages")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise InvalidRequestError("only text content parts are supported", param="messages")
        content = "".join(str(p.get("text", "")) for p in content)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise InvalidRequestError("a message's content is a string or a list of text parts", "messages")
    check_text(content, "messages")
    return {**message, "role": "system" if role == "developer" else role, "content": content}
