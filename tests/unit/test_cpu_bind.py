"""Binding the worker's torch threads to CPUs (``--cpu-bind``): which CPUs, and that they are bound."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fuseserve.cli import serve_args
from fuseserve.errors import InvalidParameterError
from fuseserve.launcher import worker_argv, worker_cpus
from fuseserve.worker.torch_thread import bind_cpus

ALLOWED = sorted(os.sched_getaffinity(0))


def test_bind_cpus_auto_none_and_lists():
    assert bind_cpus("none", len(ALLOWED)) == []
    assert bind_cpus("auto", len(ALLOWED)) == ALLOWED  # the worker owns every CPU it may run on
    assert bind_cpus("auto", len(ALLOWED) + 1) == []  # more threads than CPUs: the kernel places them
    assert bind_cpus(",".join(map(str, ALLOWED)), 1) == ALLOWED[:1]
    for bad in ("x", "0,,1", "0_1", " 1", "-1", str(max(ALLOWED) + 1)):
        with pytest.raises(InvalidParameterError):
            bind_cpus(bad, 1)
    for short in (str(ALLOWED[0]), f"{ALLOWED[0]},{ALLOWED[0]}"):  # fewer distinct CPUs than threads
        with pytest.raises(InvalidParameterError):
            bind_cpus(short, 2)


def test_serve_gives_each_worker_its_own_cpus(monkeypatch):
    n = len(ALLOWED)
    assert worker_cpus(1, n, 0) == ALLOWED
    assert [worker_cpus(n, 1, i) for i in range(n)] == [[c] for c in ALLOWED]
    assert worker_cpus(n + 1, 1, 0) == []  # more workers than CPUs: none bound
    line = worker_argv(serve_args(workers=1, threads=n), "redis://x", 0)
    assert line[line.index("--cpu-bind") + 1] == ",".join(map(str, ALLOWED))
    line = worker_argv(serve_args(workers=1, threads=n + 1), "redis://x", 0)
    assert line[line.index("--cpu-bind") + 1] == "none"
    # in a cpuset (taskset, a container) smaller than the machine: threads and CPUs from the cpuset
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {ALLOWED[-1]})
    line = worker_argv(serve_args(workers=1), "redis://x", 0)
    assert line[line.index("--threads") + 1] == "1" and line[line.index("--cpu-bind") + 1] == str(ALLOWED[-1])


BIND = """
import json, os, torch
from fuseserve.worker.torch_thread import bind_threads, torch_thread
cpus = [int(c) for c in os.environ["CPUS"].split(",")]
torch_thread().call(torch.set_num_threads, len(cpus))
mine = sorted(torch_thread().call(os.sched_getaffinity, 0))
print(json.dumps([bind_threads(cpus), sorted(torch_thread().call(os.sched_getaffinity, 0)), mine, sorted(os.sched_getaffinity(0))]))
"""


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two CPUs")
def test_bind_threads_pins_each_intra_op_thread_and_not_the_caller():
    """In a child process (binding is for the life of its threads): each of the torch thread's two
    OpenMP threads runs on its CPU, the torch thread on the first; the main thread keeps every CPU."""
    from fuseserve.kernels import cpu_stack

    if not cpu_stack.available():
        pytest.skip("the C++ layer stack does not build here")
    cpus = ALLOWED[-2:][::-1]  # the last two, in reverse: not just the default order
    env = {**os.environ, "CPUS": ",".join(map(str, cpus))}
    out = subprocess.run([sys.executable, "-c", BIND], env=env, capture_output=True, text=True, check=True)
    bound, torch_thread_after, torch_thread_before, main_cpus = json.loads(
        out.stdout.strip().splitlines()[-1]
    )
    assert torch_thread_before == ALLOWED
    assert bound == cpus
    assert torch_thread_after == [cpus[0]]
    assert main_cpus == ALLOWED
