"""The gateway's utility endpoints (vLLM's shapes): model cards, ``/tokenize``, ``/detokenize``.

Each takes the app's ``Gateway`` (``app.py``) and an already validated body; encoding goes through
the front end's ``PromptEncoder``, so ``/tokenize`` gives exactly the ids a request would run on.
"""

from __future__ import annotations

from fuseserve.errors import InvalidRequestError
from fuseserve.gateway.protocol import DetokenizeRequest, TokenizeRequest
from fuseserve.messages import WorkerRecord
from fuseserve.sampling_params import check_text


def model_card(gw, name: str, workers: list[WorkerRecord]) -> dict:
    """The ``/v1/models`` entry of served name ``name``.

    Beyond OpenAI's fields: ``max_model_len`` (tokens), ``quantization`` (the checkpoint's
    ``quant_method`` as the workers load it, e.g. ``gptq`` or ``gguf``; None for float weights) and
    ``kv_cache_dtype`` (the live ``workers``' KV cache storage, e.g. ``bfloat16`` or
    ``float8_e4m3fn``: one value, a sorted list when workers differ, None without a worker).
    ``parent``: for a LoRA adapter the base model's id, else None (vLLM's card).
    """
    kv = sorted({w.kv_cache_dtype for w in workers if w.kv_cache_dtype})
    quant = sorted({w.quantization for w in workers if w.quantization})
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "fuseserve",
        "root": gw.model_name,
        "parent": gw.served.parent_of(name),
        "max_model_len": gw.max_model_len,
        "quantization": _one_or_list(quant) if quant else gw.source.quantization,
        "kv_cache_dtype": _one_or_list(kv) if kv else None,
    }


def _one_or_list(values: list[str]) -> str | list[str]:
    return values[0] if len(values) == 1 else values


def _need_tokenizer(gw) -> None:
    if gw.tokenizer is None:
        raise InvalidRequestError("this server runs without a tokenizer (start it with --tokenizer DIR)")


def tokenize(gw, req: TokenizeRequest) -> dict:
    """``{"count", "max_model_len", "tokens"}`` of a prompt or of chat messages (with the template).

    Raises ``InvalidRequestError`` unless exactly one of ``prompt`` / ``messages`` is given, or
    when they cannot be encoded.
    """
    _need_tokenizer(gw)
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("send exactly one of 'prompt' and 'messages'", param="prompt")
    if req.messages is not None:
        ids = gw.encoder.chat([m.model_dump(exclude_none=True) for m in req.messages])
    else:
        check_text(req.prompt, "prompt")
        ids = gw.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
    return {"count": len(ids), "max_model_len": gw.max_model_len, "tokens": list(ids)}


def detokenize(gw, req: DetokenizeRequest) -> dict:
    """``{"prompt": text}`` of ``tokens``; raises ``InvalidRequestError`` for ids outside the vocabulary."""
    _need_tokenizer(gw)
    if req.tokens:
        gw.encoder.encode(req.tokens, param="tokens")  # checks the ids against the vocabulary
    return {"prompt": gw.tokenizer.decode(req.tokens)}
