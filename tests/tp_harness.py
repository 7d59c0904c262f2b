"""Test helper: the same teacher-forced plans on N tensor-parallel ranks (gloo on CPU) and on one.

- ``tp_runner(path)``: a float32 CPU ``ModelRunner`` (16 MiB of KV cache, blocks of 16) for ``path``.
- ``tp_prompts(vocab)``: four seeded prompts (40, 90, 12 and 5 tokens), run in chunks of ``SIZES``
  (7, 64, 1 and 1 tokens) packed into the same passes.
- ``one_rank(path, inspect)`` / ``spawn_ranks(size, paths, tmp_path, inspect)``: per checkpoint,
  ``{"logits": {seq_id: [len, vocab]}, "inspect": inspect(runner)}`` from one process, or rank 0's
  from ``size`` spawned ranks. A runner that fails to load gives ``"ExceptionType: message"``
  instead (a refusal can be the result a test wants). ``inspect`` must be a module-level function
  (it is pickled into the ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp
from engine_driver import chunked_logits

from fuseserve.config import EngineConfig
from fuseserve.worker.model_runner import ModelRunner

SIZES = {1: 7, 2: 64, 3: 1, 4: 1}  # sequence id -> tokens per pass
Inspect = Callable[[ModelRunner], object] | None


def tp_runner(path, **options) -> ModelRunner:
    """A float32 CPU runner for the checkpoint at ``path`` (the rank is the process's, if any);
    ``options``: more ``EngineConfig`` fields (``lora_modules``, ...)."""
    from transformers import AutoConfig

    engine = EngineConfig(kv_cache_memory="16MiB", block_size=16, device="cpu", dtype="float32", **options)
    return ModelRunner(
        path, AutoConfig.from_pretrained(path), eos_token_ids=[0], progress=False, config=engine
    )


def tp_prompts(vocab: int) -> dict[int, list[int]]:
    """Seeded prompts per sequence id of ``SIZES``: 40, 90, 12 and 5 tokens in ``[1, vocab)``."""
    g = torch.Generator().manual_seed(5)
    return {
        sid: torch.randint(1, vocab, (n,), generator=g).tolist()
        for sid, n in zip(SIZES, (40, 90, 12, 5), strict=True)
    }


def one_rank(
    path, inspect: Inspect = None, options: dict | None = None, loras: dict | None = None
) -> dict | str:
    """Logits (and ``inspect(runner)``) of the checkpoint at ``path`` in this process; ``options``:
    ``tp_runner``'s, ``loras``: sequence id → LoRA adapter (``chunked_logits``)."""
    try:
        runner = tp_runner(path, **(options or {}))
    except Exception as e:  # the refusal is the result
        return f"{type(e).__name__}: {e}"
    logits = chunked_logits(runner, tp_prompts(runner.vocab_size), SIZES, loras)
    return {"logits": logits, "inspect": inspect(runner) if inspect else None}


def _rank_main(
    rank: int, size: int, init_file: str, jobs: list[tuple[str, str]], inspect: Inspect, options, loras
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    try:
        for path, out in jobs:
            result = one_rank(path, inspect, options, loras)
            if rank == 0:
                torch.save(result, out)
    finally:
        dist.destroy_process_group()


def spawn_ranks(
    size: int,
    paths: list[Path],
    tmp_path: Path,
    inspect: Inspect = None,
    options: dict | None = None,
    loras: dict | None = None,
) -> list[dict | str]:
    """Rank 0's ``one_rank`` result per checkpoint in ``paths``, every checkpoint run on ``size``
    spawned ranks (one process group for all of them); ``options`` and ``loras`` as ``one_rank``'s."""
    jobs = [(str(p), str(tmp_path / f"{Path(p).name}.tp{size}.pt")) for p in paths]
    args = (size, str(tmp_path / "init"), jobs, inspect, options, loras)
    mp.spawn(_rank_main, args=args, nprocs=size, join=True)
    return [torch.load(out, weights_only=False) for _, out in jobs]


def assert_logits_close(got: dict, want: dict, atol: float, what: str) -> None:
    """Every sequence's logits in ``got`` within ``atol`` (absolute) of ``want``'s."""
    for sid, logits in want.items():
        torch.testing.assert_close(got[sid], logits, atol=atol, rtol=0, msg=f"{what} sequence {sid}")
