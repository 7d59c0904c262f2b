"""The gRPC floor under the scheduler: client CPU per stream round trip, with nothing of fuseserve in it.

The scheduler sends each worker one plan and reads one result per pass over a ``grpc.aio`` stream
(``services/scheduler/service/grpc_worker.py``). This measures what that costs the CLIENT process alone:
``--streams`` channels (one per worker), each with one bidirectional stream to an echo server in
another process that waits ``--delay-ms`` before it answers (a pass). Every client stream writes a
``--payload``-byte message, reads the answer, then spins ``--busy-ms`` of Python CPU (the work the
scheduler does per result: postprocess, plan, publish), and repeats.

Reported per configuration: the client process's CPU time (user + system, all threads) per round
trip minus the busy work itself, i.e. what gRPC, asyncio and the kernel cost per worker-step, and
round trips/s. A scheduler cannot spend less than this per worker-step with one plan per pass.
Each configuration runs in a fresh process, so ``--experiments`` (values of gRPC's
``GRPC_EXPERIMENTS`` environment variable, read when gRPC loads) compare side by side.
``--transports grpc,tcp`` adds the same round trips as length-prefixed frames over plain asyncio TCP
streams (no HTTP/2, no gRPC threads): the floor of a lighter transport, for comparison; ``zmq``
the same over pyzmq's DEALER / ROUTER sockets (pyzmq is not a fuseserve dependency).

``python -m benchmarks.grpc_floor [--busy-ms 0,0.3] [--experiments ";-event_engine_client"]
[--transports grpc,tcp,zmq]`` writes ``results/grpc_floor.jsonl``; ~6 s per configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from collections.abc import Callable

from tqdm import tqdm

METHOD = "/fuseserve.bench.Echo/Stream"


def _ident(b: bytes) -> bytes:
    return b


async def _serve_grpc(port: int, delay_s: float, ready) -> None:
    import grpc

    async def echo(requests, context):
        async for msg in requests:
            if delay_s:
                await asyncio.sleep(delay_s)
            yield msg

    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(echo, _ident, _ident)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("fuseserve.bench.Echo", {"Stream": handler}),)
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    ready.set()
    await server.wait_for_termination()


async def _serve_tcp(port: int, delay_s: float, ready) -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readexactly(4)
                body = await reader.readexactly(int.from_bytes(head, "little"))
                if delay_s:
                    await asyncio.sleep(delay_s)
                writer.write(head + body)
        except asyncio.IncompleteReadError:
            writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", port)
    ready.set()
    await server.serve_forever()


async def _serve_zmq(port: int, delay_s: float, ready) -> None:
    import zmq
    import zmq.asyncio

    sock = zmq.asyncio.Context().socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")
    ready.set()

    async def answer(frames: list) -> None:
        if delay_s:
            await asyncio.sleep(delay_s)
        await sock.send_multipart(frames)

    while True:  # each client stream sends its next message only after the answer: in order per stream
        asyncio.get_running_loop().create_task(answer(await sock.recv_multipart()))


_SERVERS = {"grpc": _serve_grpc, "tcp": _serve_tcp, "zmq": _serve_zmq}


def _server_main(transport: str, port: int, delay_s: float, ready) -> None:
    asyncio.run(_SERVERS[transport](port, delay_s, ready))


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


async def _open_grpc(port: int, streams: int) -> tuple[list, Callable]:
    """One channel and stream per worker; each round trip is a ``write`` then a ``read``."""
    import grpc

    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(streams)]
    calls = [
        ch.stream_stream(METHOD, request_serializer=_ident, response_deserializer=_ident)() for ch in channels
    ]

    def round_trip(call):
        async def once(message: bytes) -> None:
            await call.write(message)
            await call.read()

        return once

    async def close() -> None:
        for ch in channels:
            await ch.close()

    return [round_trip(c) for c in calls], close


async def _open_tcp(port: int, streams: int) -> tuple[list, Callable]:
    """One TCP connection per worker, length-prefixed frames over asyncio streams (no HTTP/2)."""
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(streams)]

    def round_trip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        async def once(message: bytes) -> None:
            writer.write(len(message).to_bytes(4, "little") + message)
            head = await reader.readexactly(4)
            await reader.readexactly(int.from_bytes(head, "little"))

        return once

    async def close() -> None:
        for _, writer in conns:
            writer.close()

    return [round_trip(r, w) for r, w in conns], close


async def _open_zmq(port: int, streams: int) -> tuple[list, Callable]:
    """One DEALER socket per worker to the server's ROUTER (pyzmq's asyncio sockets; libzmq's I/O thread)."""
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    socks = []
    for _ in range(streams):
        sock = ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{port}")
        socks.append(sock)

    def round_trip(sock):
        async def once(message: bytes) -> None:
            await sock.send(message)
            await sock.recv()

        return once

    async def close() -> None:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()

    return [round_trip(s) for s in socks], close


_CLIENTS = {"grpc": _open_grpc, "tcp": _open_tcp, "zmq": _open_zmq}


async def _client(
    transport: str, port: int, streams: int, payload: int, busy_s: float, seconds: float
) -> dict:
    message = b"x" * payload
    trips, close = await _CLIENTS[transport](port, streams)
    count, busy = [0], [0.0]

    async def run(once, until: float) -> None:
        while time.monotonic() < until:
            await once(message)
            count[0] += 1
            t = time.thread_time()
            _spin(busy_s)
            busy[0] += time.thread_time() - t

    await asyncio.gather(*(run(once, time.monotonic() + 1.0) for once in trips))  # warm-up
    count[0], busy[0] = 0, 0.0
    cpu0, t0 = time.process_time(), time.monotonic()
    await asyncio.gather(*(run(once, time.monotonic() + seconds) for once in trips))
    cpu, wall = time.process_time() - cpu0, time.monotonic() - t0
    await close()
    n = count[0]
    return {
        "round_trips": n,
        "round_trips_per_s": n / wall,
        "cpu_ms_per_round_trip": 1e3 * (cpu - busy[0]) / n,
        "busy_ms_per_round_trip": 1e3 * busy[0] / n,
    }


def run_one(cfg: dict) -> dict:
    """One configuration in this process: start the echo server, run the client, return its numbers."""
    transport, port = cfg["transport"], cfg["port"]
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    server = ctx.Process(
        target=_server_main, args=(transport, port, cfg["delay_ms"] / 1e3, ready), daemon=True
    )
    server.start()
    try:
        if not ready.wait(30):
            raise RuntimeError("the echo server did not start")
        out = asyncio.run(
            _client(transport, port, cfg["streams"], cfg["payload"], cfg["busy_ms"] / 1e3, cfg["seconds"])
        )
    finally:
        server.kill()
    return cfg | out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--streams", type=int, default=8, help="client channels / streams, one per worker (default 8)"
    )
    ap.add_argument("--delay-ms", type=float, default=8.0, help="server wait before each answer (default 8)")
    ap.add_argument(
        "--busy-ms", default="0,0.3", help="comma-separated Python CPU per round trip (default 0,0.3)"
    )
    ap.add_argument(
        "--payload",
        type=int,
        default=100,
        help="message bytes (default 100: an 8-sequence decode plan is ~100 B)",
    )
    ap.add_argument(
        "--seconds", type=float, default=5.0, help="measured seconds per configuration (default 5)"
    )
    ap.add_argument(
        "--experiments",
        default="",
        help="semicolon-separated GRPC_EXPERIMENTS values to compare (default: one run with none set); "
        "e.g. ';-event_engine_client' runs with none, then with the EventEngine client off",
    )
    ap.add_argument(
        "--transports",
        default="grpc",
        help="comma-separated: grpc (a grpc.aio stream, as the scheduler uses), tcp (length-prefixed frames "
        "over asyncio TCP streams, no HTTP/2: what a lighter transport would cost), zmq (pyzmq DEALER/ROUTER "
        "sockets; needs pyzmq, not a fuseserve dependency); default grpc",
    )
    ap.add_argument("--out", default="benchmarks/results/grpc_floor.jsonl")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a configuration as JSON (the child process)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(json.loads(a.one))))
        return
    from benchmarks.metrics import write_jsonl
    from fuseserve.redis_launcher import free_port

    transports = a.transports.split(",")
    if any(t not in _CLIENTS for t in transports):
        ap.error(f"--transports: a comma-separated list of {', '.join(_CLIENTS)}, not {a.transports!r}")
    if "zmq" in transports:
        try:
            import zmq  # noqa: F401
        except ImportError:
            ap.error("--transports zmq needs pyzmq, which fuseserve does not install: pip install pyzmq")
    configs = [
        {
            "streams": a.streams,
            "delay_ms": a.delay_ms,
            "busy_ms": float(b),
            "payload": a.payload,
            "seconds": a.seconds,
            "transport": t,
            "grpc_experiments": e if t == "grpc" else "",
        }
        for t in transports
        for e in (a.experiments.split(";") if t == "grpc" else [""])
        for b in a.busy_ms.split(",")
    ]
    print(
        f"{'transport':<9} {'GRPC_EXPERIMENTS':<24} {'busy ms':>7} {'rt/s':>6} {'CPU ms/rt (beyond busy)':>24}"
    )
    for cfg in tqdm(configs, desc="configurations", leave=False):
        env = dict(os.environ)
        env.pop("GRPC_EXPERIMENTS", None)
        if cfg["grpc_experiments"]:
            env["GRPC_EXPERIMENTS"] = cfg["grpc_experiments"]
        one = json.dumps(cfg | {"port": free_port()})
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.grpc_floor", "--one", one],
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise SystemExit(f"configuration {cfg} failed:\n{proc.stderr}")
        rec = json.loads(proc.stdout.strip().splitlines()[-1])
        rec |= {"cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]}
        write_jsonl(a.out, rec)
        tqdm.write(
            f"{cfg['transport']:<9} {cfg['grpc_experiments'] or '-':<24} {cfg['busy_ms']:>7.2f} {rec['round_trips_per_s']:>6.0f} "
            f"{rec['cpu_ms_per_round_trip']:>24.3f}"
        )
    print(f"records: {a.out}")


if __name__ == "__main__":
    main()
