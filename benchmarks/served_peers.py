"""Served throughput: ``fuseserve serve`` vs ``vllm serve``, the same requests through the OpenAI API.

Each system is started as a user would (``fuseserve serve --dtype D``; vLLM's CPU build from its own
venv, ``benchmarks/peers.py`` ``VllmPeer``, skipped with the reason where it is missing), timed from
start to its ``/health`` answering, warmed with one short request, then driven by the same closed
loop (``benchmarks/workload.py``): ``--requests`` requests from ``--clients`` clients, prompts ~
Normal(``--prompt-mean``, 0.3 x mean) tokens sliced from the repository's text, ``--output-mean``
tokens each, greedy with EOS ignored, streamed from ``/v1/completions``. Printed per system: total
(prompt + generated) tokens/s, mean TTFT, p95 inter-token latency, start-up seconds, the load average
around the run, and each server process's CPU over the run (cores, CPU ms per token; from ``/proc``); ``--rounds N`` alternates the systems N times. Only one server runs at a time.

    python -m benchmarks.served_peers [--dtype float32] [--systems fuseserve,vllm] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks.metrics import scale_sla, summarize
from benchmarks.offline_peers import cpu_flags
from benchmarks.peers import VllmPeer, openai_send
from benchmarks.workload import BenchRequest, closed_loop, make_requests
from fuseserve.redis_launcher import free_port

SERVED_NAME = "smollm2-135m-instruct"


def wait_healthy(url: str, proc: subprocess.Popen, limit_s: float) -> float:
    """Seconds until ``url`` answers 200; raises ``RuntimeError`` if ``proc`` exits or ``limit_s`` passes."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{url} did not answer within {limit_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL after 60 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def tree_cpu_seconds(root: int) -> dict[int, tuple[str, float]]:
    """``{pid: (command line, user + system CPU seconds)}`` of process ``root`` and its descendants,
    from ``/proc`` (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        kids = [pid for pid, (ppid, _) in stats.items() if ppid == parent and pid not in tree]
        tree.update(kids)
        frontier += kids
    out = {}
    for pid in tree & stats.keys():
        try:
            cmd = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        out[pid] = (cmd, stats[pid][1])
    return out


def cpu_by_process(before: dict, after: dict, wall_s: float, tokens: int) -> list[dict]:
    """Per server process alive over the run: CPU seconds in it, cores (CPU / wall) and CPU ms per
    token (prompt + generated), the busiest first."""
    rows = []
    for pid, (cmd, cpu) in after.items():
        if pid in before:
            used = cpu - before[pid][1]
            rows.append({"process": _role(cmd), "pid": pid, "cpu_s": round(used, 2),
                         "cores": round(used / wall_s, 3), "cpu_ms_per_token": round(1e3 * used / tokens, 3)})  # fmt: skip
    return sorted(rows, key=lambda r: -r["cpu_s"])


def _role(cmd: str) -> str:
    """A short name for a server process from its command line (a peer's: its first words)."""
    if "redis-server" in cmd:
        return "redis"
    if "fuseserve.cli" in cmd:
        for key in ("worker", "scheduler", "gateway"):
            if f" {key} " in f"{cmd} ":
                return key
        return "serve (gateway + scheduler)"
    return " ".join(Path(w).name for w in cmd.split()[:3])[:48] or "?"


def server_cmd(system: str, model_dir: Path, port: int, dtype: str, extra: list[str]):
    """(argv, env) that start ``system`` on ``port``; ``extra``: more ``fuseserve serve`` flags."""
    if system == "vllm":
        peer = VllmPeer()
        return peer.serve_cmd(peer.model_dir(model_dir), port, dtype, SERVED_NAME), peer.env()
    argv = [sys.executable, "-m", "fuseserve.cli", "serve", "--model", str(model_dir), "--port", str(port)]
    argv += ["--dtype", dtype, "--served-model-name", SERVED_NAME]
    return argv + extra, dict(os.environ)


def run_system(system: str, a: argparse.Namespace, model_dir: Path, requests: list[BenchRequest]) -> dict:
    """Start ``system``, drive ``requests``, stop it; a summary record (or one with ``error``)."""
    if system == "vllm" and (reason := VllmPeer().unavailable_reason()):
        return {"system": system, "error": reason}
    port = free_port()
    argv, env = server_cmd(system, model_dir, port, a.dtype, a.fuseserve_args.split())
    log_path = Path(a.logs) / f"{system}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        start_s = wait_healthy(f"http://127.0.0.1:{port}/health", proc, a.start_limit_s)
        send = openai_send(f"http://127.0.0.1:{port}/v1", SERVED_NAME)
        short = BenchRequest(requests[0].prompt_token_ids[:32], "", 4)
        asyncio.run(closed_loop([short], send, 1))
        load0 = os.getloadavg()[0]
        cpu0 = tree_cpu_seconds(proc.pid)
        res = asyncio.run(closed_loop(requests, send, a.clients))
        rec = summarize(res.traces, res.wall_seconds, scale_sla(factor=16.0))
        rec |= {"system": system, "start_s": start_s, "loadavg": [load0, os.getloadavg()[0]]}
        tokens = sum(len(r.prompt_token_ids) + r.max_new_tokens for r in requests)
        rec["cpu"] = cpu_by_process(cpu0, tree_cpu_seconds(proc.pid), res.wall_seconds, tokens)
        rec["errors"] = sorted({str(t.error) for t in res.traces if not t.ok})[:3]
    except RuntimeError as e:
        rec = {"system": system, "error": f"{e} (log: {log_path})"}
    finally:
        stop(proc)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--systems", default="fuseserve,vllm")
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16, the same for every system")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--prompt-mean", type=int, default=200)
    ap.add_argument("--output-mean", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--fuseserve-args",
        default="",
        help="more `fuseserve serve` flags, e.g. '--threads 1 --token-budget 256'",
    )
    ap.add_argument("--start-limit-s", type=float, default=900.0)
    ap.add_argument("--logs", default="/tmp", help="folder for each server's log")
    ap.add_argument("--out", default=None, help="JSON lines of the records")
    a = ap.parse_args()

    from fuseserve.model_source import resolve_model

    source = resolve_model(a.model, progress=False)
    requests = make_requests(source.load_tokenizer(), a.requests, a.prompt_mean, a.output_mean, seed=a.seed)
    print(f"{cpu_flags()}; {len(requests)} requests, {a.clients} clients, dtype {a.dtype}", flush=True)
    records = []
    for rnd in range(a.rounds):
        for system in a.systems.split(","):
            rec = run_system(system, a, Path(source.path), requests) | {"round": rnd, "dtype": a.dtype}
            records.append(rec)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
            if "error" in rec:
                print(f"round {rnd} {system:>9}: skipped: {rec['error']}", flush=True)
                continue
            print(
                f"round {rnd} {system:>9}: {rec['total_tokens_per_s']:.1f} tok/s total, "
                f"TTFT mean {rec['mean_ttft_s']:.2f} s, ITL p95 {rec['token_latency_p95_s']:.3f} s, "
                f"start {rec['start_s']:.0f} s, failed {rec['num_failed']}, "
                f"load {rec['loadavg'][0]:.2f}-{rec['loadavg'][1]:.2f}",
                flush=True,
            )
            for row in rec["cpu"]:
                print(
                    f"  {row['process']:>28}: {row['cores']:.2f} cores, {row['cpu_ms_per_token']:.2f} ms CPU per token"
                )
            for err in rec["errors"]:
                print(f"  failed: {err}", flush=True)


if __name__ == "__main__":
    main()
