"""One worker as N tensor-parallel ranks: rank 0 speaks to the scheduler, ranks 1..N-1 follow.

``start`` spawns the follower processes, joins them in one ``torch.distributed`` group (gloo on CPU,
NCCL on CUDA; ``parallel`` holds the sharded layers) and returns rank 0's ``TensorParallelRunner``,
which the gRPC servicer uses like a ``ModelRunner``: before each pass it broadcasts the plan, with
each decode entry's input token filled in (only rank 0 samples, so only it knows them), and every
rank runs the same ragged forward on its shard. The scheduler sees one worker; the KV budget and block
accounting are per worker (each rank holds its KV heads for the same blocks).

A rank that dies takes the worker down: rank 0 watches its followers and exits the process when one
is gone (the scheduler then recomputes the worker's sequences elsewhere), and followers exit when
rank 0's broadcast fails or their parent is gone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fuseserve.errors import FuseServeError, InvalidParameterError, WorkerLostError
from fuseserve.types import StepPlan, StepResult
from fuseserve.worker.model_runner import ModelRunner
from fuseserve.worker.multi_pass_run import run_passes
from fuseserve.worker.torch_thread import on_torch_thread

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(seconds=120)
WATCH_INTERVAL_S = 0.5
RANK_LOST_EXIT_CODE = 3


def _init_group(rank: int, size: int, init_file: str, device: str | None) -> None:
    backend = "nccl" if device and device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT
    )


class TensorParallelRunner:
    """Rank 0's ``ModelRunner`` plus the broadcast that keeps ranks 1..N-1 in step with it.

    Same interface as ``ModelRunner`` (``step``, ``run_pass``, ``free``, ``info``, ``seqs``, ...).
    exit_on_loss: a lost rank ends the process (the worker: the scheduler then recomputes its
    sequences elsewhere); False (the pipeline, in the user's process): the followers are stopped and
    every later call raises ``WorkerLostError``, so the engine fails its requests instead.
    """

    def __init__(self, runner: ModelRunner, followers: list, exit_on_loss: bool = True):
        self.runner = runner
        self.followers = followers
        self.exit_on_loss = exit_on_loss
        self.lost: str | None = None  # why a rank was lost (exit_on_loss False)
        self._closed = False
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def step(self, plan: StepPlan) -> StepResult:
        """Run ``plan``'s passes on rank 0 (``multi_pass_run.run_passes``), each broadcast as one pass."""
        self._check_ranks()
        return run_passes(self, plan, self._step_pass)

    def _step_pass(self, plan: StepPlan) -> StepResult:
        plan = dataclasses.replace(self._with_decode_tokens(plan), num_passes=1)
        self._broadcast(("pass", plan, False))
        return self._in_step(self.runner.step_pass, plan)

    def run_pass(self, plan: StepPlan, all_logits: bool = False):
        self._check_ranks()
        plan = self._with_decode_tokens(plan)
        self._broadcast(("pass", plan, all_logits))
        return self._in_step(self.runner.run_pass, plan, all_logits)

    def _in_step(self, fn, *args):
        """Run one pass on rank 0. A typed error (a bad plan, found before any collective, on every
        rank alike) goes back to the caller; anything else (a collective failed: a rank is gone)
        leaves the ranks out of step, so the worker stops."""
        try:
            return fn(*args)
        except FuseServeError:
            raise
        except Exception:
            log.exception("tensor-parallel pass failed")
            self._exit("a tensor-parallel pass failed")

    def free(self, seq_ids: list[int]) -> None:
        self._check_ranks()
        self._broadcast(("free", list(seq_ids), None))
        self.runner.free(seq_ids)

    def close(self) -> None:
        """Stop the followers (they leave their loop) and wait for them."""
        if self._closed:
            return
        self._closed = True
        self._broadcast(("stop", None, None))
        for p in self.followers:
            p.join(timeout=10)
        dist.destroy_process_group()

    def _with_decode_tokens(self, plan: StepPlan) -> StepPlan:
        chunks = []
        for c in plan.chunks:
            seq = self.runner.seqs.get(c.seq_id)
            if not c.token_ids and seq is not None and seq.last_token is not None:
                c = dataclasses.replace(c, token_ids=[seq.last_token])
            chunks.append(c)
        return dataclasses.replace(plan, chunks=chunks)

    def _broadcast(self, op: tuple) -> None:
        try:
            dist.broadcast_object_list([op], src=0)
        except Exception:  # a follower is gone: the worker cannot run a pass any more
            log.exception("tensor-parallel broadcast failed")
            self._exit("a tensor-parallel rank stopped answering")

    def _watch(self) -> None:
        while not self._closed:
            for rank, p in enumerate(self.followers, 1):
                if not p.is_alive() and not self._closed:
                    self._lose(f"tensor-parallel rank {rank} exited with code {p.exitcode}")
            time.sleep(WATCH_INTERVAL_S)

    def _check_ranks(self) -> None:
        if self.lost is not None:
            raise WorkerLostError(self.lost)

    def _exit(self, why: str):
        """A rank is lost on the calling thread's pass: raises ``WorkerLostError`` (exit_on_loss False)."""
        self._lose(why)
        raise WorkerLostError(why)

    def _lose(self, why: str) -> None:
        """Stop the followers; end the process (exit_on_loss), else remember why."""
        for p in self.followers:
            if p.is_alive():
                p.kill()
        if self.exit_on_loss:
            log.error("%s; the worker stops (its sequences move to other workers)", why)
            os._exit(RANK_LOST_EXIT_CODE)
        log.error("%s; the model runner stops", why)
        self.lost, self._closed = why, True
        if dist.is_initialized():  # this process goes on: later runners must not see a 2-rank group
            dist.destroy_process_group()


def load_runner(
    model_path,
    hf_config,
    eos_token_ids: list[int],
    config,
    size: int = 1,
    threads: int | None = None,
    progress: bool = True,
    exit_on_loss: bool = True,
):
    """The model runner of one worker or pipeline: a ``ModelRunner``, or with ``size`` > 1 rank 0's
    ``TensorParallelRunner`` (followers spawned with ``threads`` torch threads each; None: torch's;
    ``exit_on_loss``: see ``TensorParallelRunner``), built on the process's torch thread and returned
    as an ``OnTorchThread`` proxy: every method runs there (``fuseserve.worker.torch_thread``).

    Raises ``InvalidParameterError`` for ``size`` < 1, else what ``ModelRunner`` raises.
    """
    if not isinstance(size, int) or size < 1:
        raise InvalidParameterError("tensor_parallel_size", size, "an integer >= 1")
    if size == 1:
        return on_torch_thread(ModelRunner, model_path, hf_config, eos_token_ids, config, progress=progress)
    return on_torch_thread(
        start, model_path, hf_config, eos_token_ids, config, size, threads, progress, exit_on_loss
    )


def start(
    model_path,
    hf_config,
    eos_token_ids: list[int],
    config,
    size: int,
    threads: int | None = None,
    progress: bool = True,
    exit_on_loss: bool = True,
):
    """Spawn ranks 1..``size``-1, join them as rank 0, load rank 0's shard; returns its runner.

    Raises what ``ModelRunner`` raises (each follower loads its own shard the same way).
    """
    init_file = os.path.join(tempfile.mkdtemp(prefix="fuseserve-tp-"), "store")
    ctx = mp.get_context("spawn")
    followers = [
        ctx.Process(
            target=_follower_main,
            args=(rank, size, init_file, str(model_path), eos_token_ids, config, threads, os.getpid()),
            name=f"fuseserve-tp-rank{rank}",
            daemon=True,
        )
        for rank in range(1, size)
    ]
    for p in followers:
        p.start()
    _init_group(0, size, init_file, config.device)
    runner = ModelRunner(model_path, hf_config, eos_token_ids, config, progress=progress)
    return TensorParallelRunner(runner, followers, exit_on_loss)


def _follower_main(rank, size, init_file, model_path, eos_token_ids, config, threads, parent_pid) -> None:
    from transformers import AutoConfig

    if threads:
        torch.set_num_threads(threads)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    _init_group(rank, size, init_file, config.device)
    runner = ModelRunner(
        model_path, AutoConfig.from_pretrained(model_path), eos_token_ids, config, progress=False
    )
    follow(runner)
    dist.destroy_process_group()


def follow(runner: ModelRunner) -> None:
    """Ranks 1..N-1: run every pass and free that rank 0 broadcasts, until it says stop.

    Only rank 0 samples. A failed broadcast (rank 0 gone) ends the process.
    """
    while True:
        box = [None]
        try:
            dist.broadcast_object_list(box, src=0)
        except Exception:
            log.error("tensor-parallel rank 0 is gone; this rank exits")
            os._exit(RANK_LOST_EXIT_CODE)
        op, arg, all_logits = box[0]
        if op == "stop":
            return
        try:
            if op == "free":
                runner.free(arg)
            else:
                runner.run_pass(arg, all_logits)
        except FuseServeError:  # a bad plan fails on rank 0 too, before any collective; stay in step
            log.exception("tensor-parallel follower: %s failed", op)
        except Exception:  # out of step with the other ranks: stop (rank 0 notices and stops too)
            log.exception("tensor-parallel follower: %s failed; this rank exits", op)
            os._exit(RANK_LOST_EXIT_CODE)


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(WATCH_INTERVAL_S)
    os._exit(RANK_LOST_EXIT_CODE)
