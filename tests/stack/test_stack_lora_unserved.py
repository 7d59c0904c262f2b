"""A LoRA adapter the gateway names but no worker serves (``fuseserve.serve(..., simulate=PRESET)``:
simulated workers report no adapters in their records) fails at once with a 404 and OpenAI's error
JSON (``LoRAAdapterNotServedError``; streamed: the error event in the stream, its headers already
sent), not with a worker-side pass failure; the base model still answers."""

from __future__ import annotations

import openai
import pytest
from stack_harness import MODEL, openai_client

from fuseserve.redis_launcher import free_port


@pytest.fixture(scope="module")
def url(smollm2_source, tmp_path_factory):
    import fuseserve

    ghost = tmp_path_factory.mktemp("ghost-lora")  # the gateway reads only the names
    with fuseserve.serve(
        MODEL, workers=2, port=free_port(), simulate="a100-llama2-7b", lora_modules={"ghost-lora": str(ghost)}
    ) as s:
        yield s.url


def test_an_adapter_no_worker_serves_is_a_404_at_once(url):
    client = openai_client(url, max_retries=0)
    models = [m.id for m in client.models.list().data]
    assert models == [MODEL, "ghost-lora"]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="ghost-lora", prompt="Hi", max_tokens=4)
    error = e.value.response.json()["error"]
    assert "ghost-lora" in error["message"] and "no live worker" in error["message"], error
    assert error["type"] == "invalid_request_error"
    with pytest.raises(openai.APIError, match="'ghost-lora' is served by no live worker"):
        list(client.completions.create(model="ghost-lora", prompt="Hi", max_tokens=4, stream=True))
    ok = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0)
    assert ok.usage.completion_tokens == 4
