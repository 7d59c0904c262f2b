"""Multi-LoRA through the stack (``fuseserve serve --lora-modules``): the official ``openai`` client
selects an adapter by ``model`` and gets exactly the pipeline's output for that adapter, for
completions and chat, streamed and not; the base model's name still gives the base output;
``/v1/models`` lists the adapters with ``parent``; an unknown name is a 404 with OpenAI's error JSON.

Two random PEFT adapters of SmolLM2 (``tests/lora_checkpoints.py``; small scale, so the text stays
text) on 2 workers with ``max_loras`` 2, fp32 and a small budget as in ``recovery_stack``.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from stack_harness import MODEL, openai_client, recovery_pipeline, recovery_stack

ADAPTERS = {  # name → (rank, target modules, seed)
    "sql-lora": (8, ["q_proj", "v_proj"], 11),
    "tone-lora": (4, ["o_proj", "down_proj"], 12),
}
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(smollm2_source, tmp_path_factory) -> dict[str, str]:
    """The adapters' PEFT directories, name → path."""
    import torch
    from lora_checkpoints import write_adapter
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_source.path, torch_dtype=torch.float32)
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: str(write_adapter(hf, root / name, r, targets, seed, alpha=1))
        for name, (r, targets, seed) in ADAPTERS.items()
    }


@pytest.fixture(scope="module")
def lora_server(adapters):
    """``(stack, base_url)``."""
    with recovery_stack(lora_modules=adapters, max_loras=2) as s:
        yield s


@pytest.fixture(scope="module")
def lora_stack(lora_server):
    return lora_server[1]


@pytest.fixture(scope="module")
def expected(smollm2_source, adapters) -> dict[tuple[str, str], str]:
    """(model, "completion" | "chat") → the pipeline's greedy text, with the stack's settings."""
    with recovery_pipeline(smollm2_source, lora_modules=adapters, max_loras=2) as pipe:
        out = {}
        for name in [MODEL, *ADAPTERS]:
            lora = None if name == MODEL else name
            kw = dict(max_new_tokens=MAX_TOKENS, temperature=0.0, lora=lora, ignore_eos=True)
            out[name, "completion"] = pipe(PROMPT, **kw)[0].text
            out[name, "chat"] = pipe.chat(CHAT, **kw).text
    return out


def _completion(client, model: str, stream: bool) -> str:
    kw = dict(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    if not stream:
        out = client.completions.create(**kw)
        assert out.model == model
        return out.choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)


def _chat(client, model: str, stream: bool) -> str:
    kw = dict(
        model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **kw)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_model_name_selects_the_adapter(lora_stack, expected, stream):
    client = openai_client(lora_stack)
    texts = {name: expected[name, "completion"] for name in [MODEL, *ADAPTERS]}
    assert len(set(texts.values())) == 3, f"the adapters must change the output: {texts}"
    for name in [MODEL, *ADAPTERS]:
        assert _completion(client, name, stream) == expected[name, "completion"], name
        assert _chat(client, name, stream) == expected[name, "chat"], name


def test_models_lists_the_adapters_with_their_parent(lora_stack):
    cards = httpx.get(f"{lora_stack}/v1/models", timeout=30).json()["data"]
    assert [c["id"] for c in cards] == [MODEL, *ADAPTERS]
    assert [c["parent"] for c in cards] == [None, MODEL, MODEL]
    assert all(c["object"] == "model" for c in cards)
    one = httpx.get(f"{lora_stack}/v1/models/tone-lora", timeout=30).json()
    assert one["id"] == "tone-lora" and one["parent"] == MODEL


def test_an_unknown_adapter_is_a_404(lora_stack):
    client = openai_client(lora_stack)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-lora", prompt=PROMPT, max_tokens=2)
    error = e.value.response.json()["error"]
    assert error["param"] == "model" and "no-such-lora" in error["message"]
    assert error["type"] == "invalid_request_error" and error["code"] == "model_not_found"


def test_workers_report_their_adapters_and_loads(lora_server, expected):
    """Each worker's Redis record lists the adapters it serves; the sum of their gRPC ``Health``
    ``num_lora_loads`` grows when an adapter runs (at least one load per adapter served so far)."""
    from benchmarks.lora_placement import lora_loads

    stack, url = lora_server
    before, reported = lora_loads(stack.redis.url)
    assert len(reported) == 2 and all(sorted(a) == sorted(ADAPTERS) for a in reported.values())
    client = openai_client(url)
    for name in ADAPTERS:
        assert _completion(client, name, stream=False) == expected[name, "completion"]
    after, _ = lora_loads(stack.redis.url)
    assert after >= max(before, len(ADAPTERS)), (before, after)
