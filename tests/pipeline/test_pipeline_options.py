"""Pipeline serving options: a checkpoint without tokenizer files runs token-id prompts, and runs
text once ``tokenizer=DIR`` is given; ``chat_template=FILE``, ``max_model_len``, and sampling
defaults from ``generation_config.json``."""

from __future__ import annotations

import json

import pytest

from fuseserve.errors import ContextLengthExceededError, InvalidParameterError, InvalidRequestError
from fuseserve.frontend.model_info import generation_defaults


@pytest.fixture(scope="module")
def bare_checkpoint(smollm2_source, tmp_path_factory):
    """SmolLM2's config and weights without tokenizer files, with sampling defaults in its
    generation_config.json (greedy, 5 new tokens)."""
    root = tmp_path_factory.mktemp("bare")
    for name in ("config.json", "model.safetensors"):
        (root / name).symlink_to(smollm2_source.path / name)
    gen = json.loads((smollm2_source.path / "generation_config.json").read_text())
    (root / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.0, "max_new_tokens": 5}))
    return root


def _pipe(path, **kwargs):
    import fuseserve

    return fuseserve.pipeline(
        str(path), token_budget=64, kv_cache_memory="64MiB", dtype="float32", progress=False, **kwargs
    )


def test_generation_defaults_read_vllm_keys(bare_checkpoint, tmp_path):
    assert generation_defaults(bare_checkpoint) == {"temperature": 0.0, "max_new_tokens": 5}
    assert generation_defaults(tmp_path) == {}


def test_no_tokenizer_then_tokenizer_dir_chat_template_and_context(bare_checkpoint, smollm2_source, tmp_path):
    tok = smollm2_source.load_tokenizer()
    ids = tok("The capital of France is")["input_ids"]
    with _pipe(bare_checkpoint) as pipe:
        assert pipe.tokenizer is None
        (r,) = pipe(ids)  # defaults from generation_config.json: greedy, 5 tokens
        assert r.generated_tokens == 5 and r.text == "" and r.finish_reason == "length"
        with pytest.raises(InvalidRequestError, match="tokenizer"):
            pipe("text needs a tokenizer")
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:")
    with _pipe(
        bare_checkpoint, tokenizer=str(smollm2_source.path), chat_template=str(template), max_model_len=64
    ) as pipe:
        (again,) = pipe("The capital of France is")
        assert again.token_ids == r.token_ids and again.text == tok.decode(
            r.token_ids, skip_special_tokens=True
        )
        assert (
            pipe.chat_prompt_ids([{"role": "user", "content": "Hi"}])
            == tok("Q: Hi\nA:", add_special_tokens=False)["input_ids"]
        )
        with pytest.raises(ContextLengthExceededError):
            pipe(ids, max_new_tokens=64)
    with pytest.raises(InvalidParameterError, match="max_model_len"):
        _pipe(bare_checkpoint, max_model_len=10**7)
