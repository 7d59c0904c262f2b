"""From a validated request body to prompt token ids and ``SamplingParams``, as the pipeline does.

Text prompts are tokenized like ``Pipeline._encode`` (``tokenizer(text)["input_ids"]``); chat
messages are rendered like ``Pipeline.chat_prompt_ids`` (the chat template with the generation
prompt, then tokenized without special tokens). Every check that can fail runs here, before
anything is sent to the scheduler: empty prompts, text that is not valid Unicode (lone surrogates,
which JSON can carry as ``\ud800`` escapes but UTF-8 cannot), token ids outside the vocabulary
(prompt and ``stop_token_ids``), seeds outside the signed 64-bit range, sampling ranges, and
prompt + max_tokens against the context (``ContextLengthExceededError`` with the numbers).
"""

from __future__ import annotations

from fuseserve.errors import ContextLengthExceededError, InvalidParameterError, InvalidRequestError
from fuseserve.gateway.constraints import constraint_kwargs
from fuseserve.gateway.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from fuseserve.sampling_params import MAX_LOGPROBS, SamplingParams, check_text
from fuseserve.structured import grammar_backend
from fuseserve.tools import check_tool_messages, render_messages, template_supports_tools

MAX_N = 16
"""Largest ``n`` (sequences per prompt) a request may ask for."""

MAX_PROMPTS = 256
"""Largest number of prompts in one completions request."""

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
"""Seeds travel as signed 64-bit integers (each of ``n`` sequences gets ``seed + index``)."""

_OPTIONAL_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty")


class PromptEncoder:
    """Tokenizes prompts and builds sampling params for one model.

    tokenizer: the model's Hugging Face fast tokenizer. vocab_size: token ids must be below it.
    max_model_len: the context length in tokens (prompt + generated).
    """

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    # ------------------------------------------------------------------ prompts
    def completion_prompts(self, prompt: str | list) -> list[list[int]]:
        """Token ids of each prompt of a completions request (a string, token ids, or a list of either).

        Raises ``InvalidRequestError`` (param "prompt") for an empty prompt or an id outside the vocabulary.
        """
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            batch = [prompt]
        else:
            batch = list(prompt)
        if not batch:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if len(batch) > MAX_PROMPTS:
            raise InvalidRequestError(
                f"{len(batch)} prompts in one request; at most {MAX_PROMPTS}", param="prompt"
            )
        return [self._encode(p) for p in batch]

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            ids = self.tokenizer(prompt)["input_ids"] if prompt else []
        else:
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]} outside [0, {self.vocab_size})", param="prompt")
            ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        return ids

    def chat_prompt(self, messages: list[ChatMessage], tools: list[dict] | None = None) -> list[int]:
        """Token ids of ``messages`` rendered by the chat template (with the generation prompt).

        ``tools``: OpenAI tool dicts to render (``fuseserve/tools.py``: through the template when it
        reads ``tools``, else as a generic system-prompt block).
        Raises ``InvalidRequestError`` (param "messages") when the model has no chat template, a
        message is not valid text, a tool exchange is malformed, the template rejects the messages,
        or they render to nothing.
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "this model has no chat template; use /v1/completions", param="messages"
            )
        msgs = [
            {
                "role": "system" if m.role == "developer" else m.role,
                "content": m.text(),
                "tool_calls": [c.model_dump() for c in m.tool_calls or []],
                "tool_call_id": m.tool_call_id,
            }
            for m in messages
        ]
        check_tool_messages(msgs)
        turns, extra = render_messages(msgs, tools, template_supports_tools(self.tokenizer))
        for turn in turns:
            check_text(turn["content"], "messages")
        try:
            text = self.tokenizer.apply_chat_template(
                turns, add_generation_prompt=True, tokenize=False, **extra
            )
        except Exception as e:  # jinja raises on roles or orders the template does not accept
            raise InvalidRequestError(f"cannot apply the chat template: {e}", param="messages") from e
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise InvalidRequestError("messages render to an empty prompt", param="messages")
        return ids

    # ------------------------------------------------------------------ sampling params
    @staticmethod
    def check_n(n: int) -> None:
        """Raise ``InvalidParameterError`` unless 1 <= n <= ``MAX_N``."""
        if not 1 <= n <= MAX_N:
            raise InvalidParameterError("n", n, f"an integer in [1, {MAX_N}]")

    def sampling_params(
        self, req: CompletionRequest | ChatCompletionRequest, prompt_len: int, index: int = 0
    ) -> SamplingParams:
        """Validated params for sequence ``index`` (0..n-1) of a prompt of ``prompt_len`` tokens.

        Raises ``InvalidParameterError`` (OpenAI parameter names) or ``ContextLengthExceededError``.
        """
        max_tokens = req.max_tokens
        if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
            max_tokens = req.max_completion_tokens
        if max_tokens is not None and max_tokens < 1:
            raise InvalidParameterError("max_tokens", max_tokens, "an integer >= 1")
        room = self.max_model_len - prompt_len
        if max_tokens is None:
            if room < 1:
                raise ContextLengthExceededError(prompt_len, 1, self.max_model_len)
            max_tokens = room
        elif max_tokens > room:
            raise ContextLengthExceededError(prompt_len, max_tokens, self.max_model_len)
        self.check_wire_values(req)
        if not 0 <= req.min_tokens <= max_tokens:
            raise InvalidParameterError(
                "min_tokens", req.min_tokens, f"an integer in [0, max_tokens={max_tokens}]"
            )
        kwargs: dict = dict(
            max_new_tokens=max_tokens,
            min_new_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=self._logprobs(req),
        )
        for name in _OPTIONAL_FLOATS + ("top_k", "repetition_penalty"):
            value = getattr(req, name)
            if value is not None:
                kwargs[name] = value
        if req.seed is not None:
            kwargs["seed"] = req.seed + index
        kwargs.update(constraint_kwargs(req, self.vocab_size))
        params = SamplingParams.from_kwargs(**kwargs)
        if params.constrained:  # compiled once and cached: an uncompilable spec is a 400 here
            grammar_backend(self.tokenizer, self.vocab_size).check(params)
        return params

    def check_wire_values(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        """Raise ``InvalidParameterError`` for values the worker cannot take: stop strings that are
        not valid text, ``stop_token_ids`` outside ``[0, vocab_size)``, and a ``seed`` whose
        ``seed + n - 1`` leaves the signed 64-bit range."""
        stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
        for stop in stops:
            check_text(stop, "stop")
        for t in req.stop_token_ids or []:
            if not 0 <= t < self.vocab_size:
                raise InvalidParameterError(
                    "stop_token_ids", t, f"token ids in [0, {self.vocab_size}) (the model's vocabulary)"
                )
        if req.seed is not None and not SEED_MIN <= req.seed <= SEED_MAX - (req.n - 1):
            raise InvalidParameterError(
                "seed", req.seed, f"an integer in [-2**63, 2**63 - n] (n={req.n}: sequence i uses seed + i)"
            )

    @staticmethod
    def _logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
        if isinstance(req, CompletionRequest):
            if req.echo:
                raise InvalidParameterError("echo", True, "false (echo is not supported)")
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
