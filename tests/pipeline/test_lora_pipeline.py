"""LoRA adapters through the pipeline (tiny random LLaMA, three PEFT adapters, fp32, CPU).

- Requests of three adapters and of the base model share passes at a token budget of 16, and each
  gets the greedy tokens it gets alone;
- a prompt computed under one adapter is not served from the prefix cache to another adapter nor to
  the base model, and is to the same adapter;
- unknown adapters and unservable checkpoints are refused with typed errors.
"""

from __future__ import annotations

import pytest
from lora_checkpoints import write_adapter, write_adapters
from tiny_models import random_prompt, tiny_checkpoint

import fuseserve
from fuseserve.errors import InvalidRequestError, LoRAAdapterError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-llama")
    hf, _ = tiny_checkpoint("llama-gqa", root / "base")
    return hf, root, write_adapters(hf, root)


def _pipeline(root, adapters, **kw):
    options = {"device": "cpu", "dtype": "float32", "kv_cache_memory": "8MiB", "progress": False, **kw}
    return fuseserve.pipeline(str(root / "base"), lora_modules=adapters, **options)


@pytest.fixture(scope="module")
def pipe(checkpoint):
    _, root, adapters = checkpoint
    p = _pipeline(root, adapters, token_budget=16, max_loras=3)
    yield p
    p.close()


def test_three_adapters_and_the_base_in_one_pass_match_each_alone(pipe):
    v = 512
    prompts = [random_prompt(i, n, v) for i, n in ((1, 21), (2, 9), (3, 30), (4, 14))]
    loras = ["a4", "a8", "a16", None]
    params = dict(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    seen: list[tuple[int, bool]] = []  # per pass with adapters: (adapters, base tokens too)
    manager = pipe.runner.lora
    build = manager.batch

    def record(slots, lengths):
        seen.append((len({s for s in slots if s >= 0}), -1 in slots))
        return build(slots, lengths)

    manager.batch = record
    try:
        together = pipe(prompts, lora=loras, **params)
    finally:
        manager.batch = build
    assert (3, True) in seen, seen
    alone = [pipe([p], lora=a, **params)[0] for p, a in zip(prompts, loras, strict=True)]
    for got, want, a in zip(together, alone, loras, strict=True):
        assert got.token_ids == want.token_ids, a
    # the adapters matter: one prompt, four different continuations
    same = [pipe([prompts[0]], lora=a, **params)[0].token_ids for a in loras]
    assert len({tuple(t) for t in same}) == 4


def test_a_prefix_is_not_shared_across_adapters(pipe):
    prompt = random_prompt(9, 40, 512)  # two full blocks of 16
    params = dict(max_new_tokens=4, temperature=0.0)
    first = pipe([prompt], lora="a4", **params)[0]
    other = pipe([prompt], lora="a8", **params)[0]
    base = pipe([prompt], **params)[0]
    again = pipe([prompt], lora="a4", **params)[0]
    assert (first.cached_tokens, other.cached_tokens, base.cached_tokens) == (0, 0, 0)
    assert again.cached_tokens == 32 and again.token_ids == first.token_ids


def test_unknown_adapter_is_refused(pipe):
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'nope'"):
        pipe([[1, 2, 3]], lora="nope")
    with pytest.raises(InvalidRequestError, match="2 adapters for 1 prompts"):
        pipe([[1, 2, 3]], lora=["a4", "a8"])
    assert pipe.lora_names == ["a4", "a8", "a16"]


def test_adapter_refusals(checkpoint, tmp_path):
    """Typed errors at start: rank above the limit, a missing file, a target that is not a
    decoder projection, another base model's shapes, DoRA."""
    from tiny_models import CONFIGS, random_model

    hf, root, adapters = checkpoint
    cases = {
        "rank": ({"a16": adapters["a16"]}, {"max_lora_rank": 8}, "rank 16 is above max_lora_rank=8"),
        "missing": ({"gone": str(tmp_path / "none")}, {}, "adapter_config.json"),
    }
    write_adapter(hf, tmp_path / "head", 4, ["q_proj", "lm_head"], 5)
    cases["head"] = ({"head": str(tmp_path / "head")}, {}, "target module 'lm_head'")
    config = CONFIGS["llama-gqa"]()
    config.hidden_size, config.intermediate_size = 32, 64
    write_adapter(random_model(config), tmp_path / "other", 4, ["q_proj"], 5)
    cases["other"] = ({"other": str(tmp_path / "other")}, {}, "another base model")
    from peft import LoraConfig, get_peft_model

    get_peft_model(random_model(CONFIGS["llama-gqa"]()), LoraConfig(r=4, use_dora=True)).save_pretrained(
        tmp_path / "dora"
    )
    cases["dora"] = ({"dora": str(tmp_path / "dora")}, {}, "DoRA is not served")
    (tmp_path / "weightless").mkdir()
    (tmp_path / "weightless" / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    cases["weightless"] = (
        {"w": str(tmp_path / "weightless")},
        {},
        "adapter_model.safetensors does not exist",
    )
    for what, (modules, kw, message) in cases.items():
        with pytest.raises(LoRAAdapterError, match=message) as e:
            _pipeline(root, modules, token_budget=16, **kw)
        assert e.value.http_status == 400, what


@pytest.mark.parametrize("options", [{"decode_passes": 4}, {"kv_cache_memory": 8 * 4096}])
def test_multi_step_decoding_and_preemption_keep_each_adapter(checkpoint, pipe, options):
    """Several decode passes per plan, and a KV pool of 8 blocks that four requests overflow
    (preempted sequences recompute with their adapter): each request's tokens equal its tokens
    alone on the roomy pipeline."""
    _, root, adapters = checkpoint
    prompts = [random_prompt(i, n, 512) for i, n in ((11, 30), (12, 25), (13, 28), (14, 20))]
    loras = ["a16", "a4", None, "a8"]
    params = dict(max_new_tokens=14, temperature=0.0, ignore_eos=True)
    other = _pipeline(root, adapters, **{"token_budget": 16, "max_loras": 3, **options})
    try:
        if "kv_cache_memory" in options:
            assert other.runner.info.num_blocks == 8
        together = other(prompts, lora=loras, **params)
        if "kv_cache_memory" in options:
            assert other.scheduler.num_preemptions > 0
    finally:
        other.close()
    for p, a, got in zip(prompts, loras, together, strict=True):
        assert got.token_ids == pipe([p], lora=a, **params)[0].token_ids, a


def test_prompt_logprobs_and_logprobs_follow_each_adapter(pipe):
    """Prompt logprobs and sampled logprobs of requests of different adapters in the same passes (their
    tokens laid out adapter by adapter) equal those of each request alone."""
    prompts = [random_prompt(i, n, 512) for i, n in ((21, 18), (22, 26), (23, 11))]
    loras = ["a8", None, "a4"]
    params = dict(max_new_tokens=3, temperature=0.0, prompt_logprobs=2, logprobs=1)
    together = pipe(prompts, lora=loras, **params)
    for p, a, got in zip(prompts, loras, together, strict=True):
        want = pipe([p], lora=a, **params)[0]
        assert got.token_ids == want.token_ids
        assert _flat(got.prompt_logprobs) == pytest.approx(_flat(want.prompt_logprobs), abs=1e-4)
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def _flat(entries) -> list[float]:
    """Prompt logprobs as numbers: per position its token id and logprob, then each alternative's
    (the first position has none)."""
    out: list[float] = []
    for e in entries[1:]:
        out += [e.token_id, e.logprob]
        for t in e.top:
            out += [t.token_id, t.logprob]
    return out


def test_load_and_unload_at_runtime(checkpoint, pipe, tmp_path):
    """``pipe.load_lora`` (``allow_runtime_lora``): an adapter loaded after start gives the tokens it
    gives when served from the start, through the one checkpoint check (rank, path, name, another
    base model's shapes: typed 400s); unload refuses an adapter in flight, one given at start and an
    unknown one; off without the flag."""
    from tiny_models import CONFIGS, random_model

    from fuseserve.errors import LoRAAdapterInUseError, LoRAAdapterNotFoundError, RuntimeLoRADisabledError

    hf, root, adapters = checkpoint
    prompt = random_prompt(7, 12, 128)
    want = pipe([prompt], lora="a8", max_new_tokens=6, temperature=0.0, ignore_eos=True)[0].token_ids
    with pytest.raises(RuntimeLoRADisabledError, match="--allow-runtime-lora"):
        pipe.load_lora("late", adapters["a8"])
    config = CONFIGS["llama-gqa"]()
    config.hidden_size, config.intermediate_size = 32, 64
    write_adapter(random_model(config), tmp_path / "other", 4, ["q_proj"], 5)
    with _pipeline(
        root, {"a4": adapters["a4"]}, token_budget=16, max_loras=2, max_lora_rank=8, allow_runtime_lora=True
    ) as p:
        for name, path, error, message in [
            ("big", adapters["a16"], LoRAAdapterError, "rank 16 is above max_lora_rank=8"),
            ("gone", str(tmp_path / "none"), LoRAAdapterError, "is not a directory"),
            ("other", str(tmp_path / "other"), LoRAAdapterError, "another base model"),
            (p.name, adapters["a8"], InvalidRequestError, "base model's name"),
            ("a4", adapters["a8"], InvalidRequestError, "already loaded"),
        ]:
            with pytest.raises(error, match=message):
                p.load_lora(name, path)
        assert p.lora_names == ["a4"]
        p.load_lora("late", adapters["a8"])
        assert p.lora_names == ["a4", "late"]
        got = p([prompt], lora="late", max_new_tokens=6, temperature=0.0, ignore_eos=True)[0].token_ids
        assert got == want
        stream = p.stream_tokens(prompt, lora="late", max_new_tokens=6, temperature=0.0, ignore_eos=True)
        next(stream)
        with pytest.raises(LoRAAdapterInUseError):
            p.unload_lora("late")
        assert [t for t, _ in stream] == want[1:]
        with pytest.raises(InvalidRequestError, match="construction"):
            p.unload_lora("a4")
        with pytest.raises(LoRAAdapterNotFoundError):
            p.unload_lora("nope")
        p.unload_lora("late")
        with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'late'"):
            p([prompt], lora="late", max_new_tokens=1)
