"""Peer systems driven by the same closed-loop client and the same requests as fuseserve.

Each peer is a ``SendFn`` factory (see `benchmarks.workload`): ``send(request)`` streams
``(timestamp, n_tokens)`` events. All peers decode greedily and ignore EOS (every request produces
exactly ``max_new_tokens`` tokens), so every system does the same work.

- `HFContinuousBatching`: ``transformers``' continuous-batching manager (paged attention, SDPA on
  CPU), the engine behind ``model.generate_batch`` and ``transformers serve --continuous-batching``;
  requests are added one by one as clients send them, tokens streamed per step.
- `HFGenerate`: naive ``model.generate`` one request at a time (a lock serializes clients),
  tokens streamed by a ``BaseStreamer``.
- `openai_send`: any OpenAI-compatible server (``fuseserve serve``, ``transformers serve``,
  vLLM): streaming ``/v1/completions`` with the prompt as token ids.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from benchmarks.workload import BenchRequest, SendFn, send_from_blocking


def load_hf_model(path: str | Path, attn_implementation: str = "sdpa"):
    """The checkpoint at ``path`` (safetensors) as a float32 ``AutoModelForCausalLM`` in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation=attn_implementation
    )
    return model.eval()


class HFContinuousBatching:
    """``transformers`` continuous batching (``ContinuousBatchingManager``), one manager per run.

    max_batch_tokens: tokens per forward pass (set to fuseserve's token budget for a fair match).
    num_blocks / page_size: paged KV cache size (``num_blocks x page_size`` tokens per layer).
    """

    name = "transformers-cb"

    def __init__(self, model, max_batch_tokens: int, num_blocks: int = 64, page_size: int = 256):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        gen = GenerationConfig(do_sample=False, max_new_tokens=64, eos_token_id=-1, pad_token_id=0)
        cb = ContinuousBatchingConfig(
            page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens
        )
        self.manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        self.manager.start()
        self._ids = iter(range(1 << 62))

    def send(self) -> SendFn:
        manager = self.manager

        async def send(request: BenchRequest) -> AsyncIterator[tuple[float, int]]:
            rid = f"bench-{next(self._ids)}"
            outputs: asyncio.Queue = asyncio.Queue()
            manager.register_result_handler(rid, lambda out: outputs.put_nowait((time.perf_counter(), out)))
            manager.add_request(
                list(request.prompt_token_ids),
                request_id=rid,
                max_new_tokens=request.max_new_tokens,
                streaming=True,
                eos_token_id=-1,
            )
            seen = 0
            while True:
                stamp, out = await outputs.get()
                if out.error:
                    raise RuntimeError(out.error)
                n = len(out.generated_tokens)
                if n > seen:
                    yield stamp, n - seen
                    seen = n
                if out.is_finished():
                    return

        return send

    def close(self) -> None:
        self.manager.stop(block=True, timeout=30)


class HFGenerate:
    """Naive ``model.generate``: one request at a time (others wait), greedy, EOS suppressed."""

    name = "transformers-generate"

    def __init__(self, model):
        self.model = model
        self._lock = threading.Lock()

    def _stream(self, request: BenchRequest) -> Iterator[int]:
        import torch
        from transformers.generation.streamers import BaseStreamer

        events: queue.Queue = queue.Queue()

        class Counter(BaseStreamer):
            first = True

            def put(self, value):  # the first put is the prompt
                if self.first:
                    self.first = False
                    return
                events.put(int(value.numel()))

            def end(self):
                events.put(None)

        def run() -> None:
            try:
                with self._lock, torch.inference_mode():
                    n = request.max_new_tokens
                    ids = torch.tensor([request.prompt_token_ids])
                    self.model.generate(
                        ids,
                        max_new_tokens=n,
                        min_new_tokens=n,
                        do_sample=False,
                        streamer=Counter(),
                        attention_mask=torch.ones_like(ids),
                        pad_token_id=0,
                    )
            except BaseException as e:  # forwarded to the client
                events.put(e)

        threading.Thread(target=run, daemon=True).start()
        while (item := events.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    def send(self) -> SendFn:
        return send_from_blocking(self._stream)

    def close(self) -> None:
        pass


def openai_send(base_url: str, model: str, api_key: str = "EMPTY") -> SendFn:
    """Stream ``/v1/completions`` (prompt = token ids, greedy, ``ignore_eos``) from an OpenAI server.

    One streamed chunk is counted as one token; if the final usage says more tokens were
    generated, the difference is added at the last chunk's time.
    """
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=3600)

    async def send(request: BenchRequest) -> AsyncIterator[tuple[float, int]]:
        stream = await client.completions.create(
            model=model,
            prompt=list(request.prompt_token_ids),
            max_tokens=request.max_new_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "min_tokens": request.max_new_tokens},
        )
        counted = 0
        last = time.perf_counter()
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and (chunk.choices[0].text or chunk.choices[0].finish_reason is None):
                counted += 1
                last = now
                yield now, 1
            usage = getattr(chunk, "usage", None)
            if usage is not None and usage.completion_tokens > counted:
                yield last, usage.completion_tokens - counted
                counted = usage.completion_tokens

    return send
