"""Runtime LoRA loading through the stack (``fuseserve serve --allow-runtime-lora``, 2 workers,
``max_loras`` 2, an API key): an adapter loaded by ``POST /v1/load_lora_adapter`` while 8 streams run
on the startup adapters disturbs none of them (each equals its pipeline text), and a request to it
(``fuseserve.Client(lora=...)``) equals the pipeline's output after ``pipe.load_lora``; unloading it
while a request of it streams is refused (409, a clear message), and once that request ended the
unload succeeds and the name is a 404; a rank above ``--max-lora-rank`` is a 400; the key is needed.
The gateway's own refusals are ``tests/stack/gateway/test_gateway_lora_runtime.py``."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from stack_harness import MODEL, ask_streamed, openai_client, recovery_pipeline, recovery_stack, wait_for

import fuseserve

KEY = "runtime-lora-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
STARTUP = {"sql-lora": (8, ["q_proj", "v_proj"], 11), "tone-lora": (4, ["o_proj", "down_proj"], 12)}
NEW = ("new-lora", 8, ["k_proj", "gate_proj"], 13)
PROMPT = "The capital of France is"
STREAM_TOKENS = 96  # long enough that the 8 streams still run while the load is answered
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(smollm2_source, tmp_path_factory) -> dict[str, str]:
    """name → PEFT directory: the startup adapters, ``new-lora`` and ``big-lora`` (rank 32 > 16)."""
    import torch
    from lora_checkpoints import write_adapter
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_source.path, torch_dtype=torch.float32)
    root = tmp_path_factory.mktemp("adapters")
    specs = {**STARTUP, NEW[0]: NEW[1:], "big-lora": (32, ["q_proj"], 14)}
    return {
        name: str(write_adapter(hf, root / name, r, t, seed, alpha=1)) for name, (r, t, seed) in specs.items()
    }


@pytest.fixture(scope="module")
def expected(smollm2_source, adapters) -> dict[str, str]:
    """Adapter → the pipeline's greedy text (``STREAM_TOKENS`` for the startup ones, ``MAX_TOKENS``
    for ``new-lora``, loaded at runtime with ``pipe.load_lora``), with the stack's settings."""
    startup = {name: adapters[name] for name in STARTUP}
    with recovery_pipeline(
        smollm2_source, lora_modules=startup, max_loras=2, allow_runtime_lora=True
    ) as pipe:
        kw = dict(temperature=0.0, ignore_eos=True)
        out = {name: pipe(PROMPT, lora=name, max_new_tokens=STREAM_TOKENS, **kw)[0].text for name in STARTUP}
        pipe.load_lora(NEW[0], adapters[NEW[0]])
        out[NEW[0]] = pipe(PROMPT, lora=NEW[0], max_new_tokens=MAX_TOKENS, **kw)[0].text
        pipe.unload_lora(NEW[0])
        with pytest.raises(fuseserve.errors.InvalidRequestError):
            pipe(PROMPT, lora=NEW[0], max_new_tokens=1)
    assert out[NEW[0]] != out["sql-lora"][: len(out[NEW[0]])], "the new adapter must change the output"
    return out


@pytest.fixture(scope="module")
def url(adapters):
    startup = {name: adapters[name] for name in STARTUP}
    with recovery_stack(lora_modules=startup, max_loras=2, allow_runtime_lora=True, api_key=KEY) as (_, base):
        yield base


def _post(url: str, path: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=120)


def test_load_while_8_streams_run(url, adapters, expected):
    client = openai_client(url, api_key=KEY)
    names = [name for name in STARTUP for _ in range(4)]
    progress: list[list[float]] = [[] for _ in names]
    results: list = [None] * len(names)

    def stream(i: int) -> None:
        try:
            results[i] = ask_streamed(client, PROMPT, STREAM_TOKENS, progress[i], model=names[i])[0]
        except Exception as e:  # reported by the assertion below
            results[i] = e

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(names))]
    for t in threads:
        t.start()
    wait_for(lambda: all(progress), timeout=300, what="a first chunk on every stream")
    running_at_load = sum(r is None for r in results)
    r = _post(url, "/v1/load_lora_adapter", {"lora_name": NEW[0], "lora_path": adapters[NEW[0]]})
    assert r.status_code == 200, r.text
    with fuseserve.Client(url, api_key=KEY, lora=NEW[0]) as fs:
        assert (
            fs.generate(PROMPT, max_new_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)[0].text
            == expected[NEW[0]]
        )
    for t in threads:
        t.join()
    assert running_at_load == len(names)
    assert results == [expected[name] for name in names]
    cards = httpx.get(f"{url}/v1/models", headers=AUTH, timeout=30).json()["data"]
    assert (NEW[0], MODEL) in [(c["id"], c["parent"]) for c in cards]


def test_unload_is_refused_while_a_request_runs(url, adapters, expected):
    if NEW[0] not in [m.id for m in openai_client(url, api_key=KEY).models.list()]:
        assert _post(
            url, "/v1/load_lora_adapter", {"lora_name": NEW[0], "lora_path": adapters[NEW[0]]}
        ).is_success
    client = openai_client(url, api_key=KEY)
    progress: list[float] = []
    out = []
    t = threading.Thread(
        target=lambda: out.append(ask_streamed(client, PROMPT, STREAM_TOKENS, progress, model=NEW[0]))
    )
    t.start()
    wait_for(lambda: progress, timeout=300, what="the first chunk")
    r = _post(url, "/v1/unload_lora_adapter", {"lora_name": NEW[0]})
    assert r.status_code == 409, r.text
    assert "running or waiting requests" in r.json()["error"]["message"]
    t.join()
    assert out and out[0][0].startswith(expected[NEW[0]])
    # the schedulers' stats records say the request ended within a second (STATS_INTERVAL_S)
    statuses: list[int] = []
    unload = lambda: statuses.append(_post(url, "/v1/unload_lora_adapter", {"lora_name": NEW[0]}).status_code)  # noqa: E731
    wait_for(
        lambda: unload() or statuses[-1] != 409,
        timeout=30,
        what="the scheduler's record to show the request ended",
    )
    assert statuses[-1] == 200, statuses
    assert NEW[0] not in [m.id for m in client.models.list()]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=NEW[0], prompt=PROMPT, max_tokens=1)


def test_refusals(url, adapters):
    big = _post(url, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": adapters["big-lora"]})
    assert big.status_code == 400 and "rank 32 is above max_lora_rank=16" in big.json()["error"]["message"]
    bad = _post(url, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "/no/such/adapter"})
    assert bad.status_code == 400 and "/no/such/adapter" in bad.json()["error"]["message"]
    body = {"lora_name": "x", "lora_path": adapters[NEW[0]]}
    assert _post(url, "/v1/load_lora_adapter", body, headers={}).status_code == 401


def test_a_request_right_after_a_load_is_served(url, adapters, expected):
    """On an idle stack the load answers only once the schedulers place the adapter: the next request
    is served (a load that answered before the workers advertised it gave a 404 here)."""
    r = _post(url, "/v1/load_lora_adapter", {"lora_name": "again-lora", "lora_path": adapters[NEW[0]]})
    assert r.status_code == 200, r.text
    with fuseserve.Client(url, api_key=KEY) as fs:
        out = fs.generate(
            PROMPT, lora="again-lora", max_new_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
        )
    assert out[0].text == expected[NEW[0]]
