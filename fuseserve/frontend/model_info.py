"""What the front end takes from a model: its tokenizer (or ``--tokenizer DIR``), its chat template
(or ``--chat-template FILE``), its context length (or a smaller ``--max-model-len``), and the
sampling defaults of its ``generation_config.json`` (as vLLM's ``--generation-config auto``)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from fuseserve.errors import InvalidParameterError, ModelLoadError
from fuseserve.frontend.encode import PromptEncoder

GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_new_tokens",
}
"""``generation_config.json`` keys → ``SamplingParams`` fields used as request defaults (vLLM's set)."""


def load_tokenizer(source, tokenizer: str | None = None):
    """The tokenizer of ``tokenizer`` (a directory) if given, else the model's; None when the model
    has none (token-id prompts still work). Raises ``ModelLoadError`` for an unusable ``tokenizer``."""
    if tokenizer is None:
        try:
            return source.load_tokenizer()
        except ModelLoadError:
            return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(tokenizer))
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer from {tokenizer}: {e}") from e


def read_chat_template(path: str | None) -> str | None:
    """The text of a chat-template file, or None. Raises ``ModelLoadError`` when it cannot be read."""
    if path is None:
        return None
    try:
        return pathlib.Path(path).read_text()
    except OSError as e:
        raise ModelLoadError(f"cannot read the chat template {path}: {e}") from e


def context_length(config, requested: int | None = None) -> int:
    """``requested`` (``--max-model-len``) checked against the model's context, or the model's.

    Raises ``InvalidParameterError`` for a value below 1 or above ``config.max_position_embeddings``.
    """
    model_len = int(config.max_position_embeddings)
    if requested is None:
        return model_len
    if not 1 <= requested <= model_len:
        raise InvalidParameterError(
            "max_model_len", requested, f"an integer in [1, {model_len}] (the model's)"
        )
    return requested


def generation_defaults(path: pathlib.Path) -> dict[str, Any]:
    """``SamplingParams`` defaults from ``path/generation_config.json`` (empty when it has none)."""
    file = pathlib.Path(path) / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {file}: {e}") from e
    return {field: data[key] for key, field in GENERATION_CONFIG_KEYS.items() if data.get(key) is not None}


def build_encoder(
    source,
    tokenizer=None,
    vocab_size: int | None = None,
    max_model_len: int | None = None,
    chat_template=None,
) -> PromptEncoder:
    """A ``PromptEncoder`` for ``source`` (a ``ModelSource``) with the serving options applied.

    tokenizer: an already loaded tokenizer (or None: token ids only). chat_template: a file path.
    """
    config = source.config
    vocab = vocab_size or int(getattr(config, "vocab_size", 0) or (len(tokenizer) if tokenizer else 0))
    return PromptEncoder(
        tokenizer, vocab, context_length(config, max_model_len), read_chat_template(chat_template)
    )
