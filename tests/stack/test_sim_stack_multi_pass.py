"""Multi-step decoding through the whole stack (``fuseserve.serve(..., decode_passes=4)``): real
Redis, scheduler, gateway and two simulated workers over gRPC. The same burst of requests (streamed
and not, lengths 1..40, stop strings) gives the same texts, finish reasons and usage counts as the
one-pass stack, and every KV block is free afterwards. Simulated tokens are a function of the prompt
and the position only (``fuseserve.worker.sim_runner``), so any difference is a scheduling error."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
import redis

from fuseserve import messages
from fuseserve.redis_launcher import free_port

MODEL = "smollm2-135m-instruct"


async def _ask(client: httpx.AsyncClient, body: dict) -> tuple[str, str | None, int]:
    """(text, finish_reason, completion tokens) of one completion, streamed or not."""
    if not body.get("stream"):
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        return (
            out["choices"][0]["text"],
            out["choices"][0]["finish_reason"],
            out["usage"]["completion_tokens"],
        )
    text, reason, usage = "", None, -1
    body = {**body, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                text += c["text"]
                reason = c.get("finish_reason") or reason
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
    return text, reason, usage


def _bodies(stops: dict[int, str] | None = None) -> list[dict]:
    rng = random.Random(0)
    bodies = []
    for i in range(16):
        body = {"model": MODEL, "prompt": f"multi-step request {i}:", "max_tokens": rng.randint(1, 40)}
        body["stream"] = i % 3 == 0
        if stops and i in stops:
            body["stop"] = [stops[i]]
        bodies.append(body)
    return bodies


def _run(passes: int, stops: dict[int, str] | None) -> list[tuple[str, str | None, int]]:
    import fuseserve

    with fuseserve.serve(
        MODEL, workers=2, port=free_port(), simulate="a100-llama2-7b", decode_passes=passes
    ) as server:
        scheduler = next(a for n, a in server.stack.argv.items() if n.startswith("scheduler"))
        assert scheduler[scheduler.index("--decode-passes") + 1] == str(
            passes
        )  # 1 too: the default is per worker

        async def burst():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                return await asyncio.gather(*(_ask(client, b) for b in _bodies(stops)))

        results = asyncio.run(burst())
        r = redis.Redis.from_url(server.stack.redis.url, decode_responses=True)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            stats = messages.read_scheduler_stats(r)
            used = (
                sum(w["num_blocks"] - w["free_blocks"] for w in stats.get("workers", {}).values())
                if stats
                else None
            )
            if used == 0:
                break
            time.sleep(0.25)
        assert used == 0, f"{used} KV blocks still in use"
    return results


@pytest.mark.slow  # two stacks (~23 s); tests/pipeline/test_pipeline_multi_pass.py covers multi-pass in the default run
def test_four_passes_through_the_stack_give_what_one_gives(smollm2_source):
    ref = _run(1, None)
    # stop strings cut some answers in the middle (taken from the one-pass texts)
    stops = {
        i: text[len(text) // 2 : len(text) // 2 + 3]
        for i, (text, _, n) in enumerate(ref)
        if n >= 12 and i % 2
    }
    ref = _run(1, stops)
    got = _run(4, stops)
    assert got == ref
    assert any(reason == "stop" for _, reason, _ in ref) and any(reason == "length" for _, reason, _ in ref)
    for (_, reason, n), body in zip(ref, _bodies(stops), strict=True):
        if reason == "length":
            assert n == body["max_tokens"]
