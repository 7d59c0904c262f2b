"""How fast a peer takes over a SIGKILLed scheduler's workers and requests.

A local stack (``fuseserve.serve``) with 2 schedulers and 2 simulated workers (``--simulate``: the
control plane is what is measured). Each round: 8 greedy streams run; the scheduler holding worker-0's
lease is SIGKILLed while it drives requests; we poll Redis and the workers every 5 ms for

- **workers**: seconds until each of its workers is driven by the peer (the worker's fence grows:
  the peer took the lease and reset it, its plans follow);
- **requests**: seconds until none of the request entries is pending for the dead scheduler any more
  (the peer claimed them all);

then every stream must finish without an error (the gateway drops tokens already sent). The killed
scheduler is restarted between rounds. Prints each round and the medians.

``python -m benchmarks.takeover [--rounds 5] [--lease-ttl 1.5]``
"""

from __future__ import annotations

import argparse
import concurrent.futures
import signal
import statistics
import sys
import time
from pathlib import Path

import grpc
import redis
from tqdm import tqdm

from fuseserve import messages
from fuseserve.proto import worker_pb2 as pb
from fuseserve.proto import worker_pb2_grpc as pb_grpc
from fuseserve.redis_launcher import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from stack_harness import MODEL, ask_streamed, openai_client, wait_for  # noqa: E402

POLL_S = 0.005


def _fence(r: redis.Redis, wid: str) -> int:
    rec = messages.WorkerRecord.decode(r.get(messages.worker_key(wid)))
    with grpc.insecure_channel(rec.address) as channel:
        return pb_grpc.WorkerStub(channel).Health(pb.HealthRequest(), timeout=5).fence


def _pending_of(r: redis.Redis, consumer: str) -> int:
    pending = r.xpending(messages.REQUESTS, messages.SCHEDULER_GROUP)
    return sum(c["pending"] for c in pending["consumers"] if c["name"] == consumer)


def _holders(r: redis.Redis) -> dict[str, str]:
    """worker id → the consumer holding its lease."""
    keys = list(r.scan_iter(match=messages.worker_lease_key("*")))
    return {k.rsplit(":", 1)[1]: v for k, v in zip(keys, r.mget(keys) if keys else [], strict=True) if v}


def one_round(stack, url: str, r: redis.Redis, max_tokens: int) -> tuple[float, float]:
    """One kill: ``(seconds until the peer drives every worker of the dead one, seconds until it
    holds every request of the dead one)``."""
    wait_for(lambda: len(set(_holders(r).values())) == 2, 60, "both schedulers holding a worker")
    client = openai_client(url, max_retries=0)
    progress: list = []
    prompts = [f"Takeover round, stream {i}:" for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
        futures = [ex.submit(ask_streamed, client, p, max_tokens, progress) for p in prompts]
        victim = _holders(r)["worker-0"]
        wait_for(lambda: len(progress) >= 8 and _pending_of(r, victim) > 0, 60, "the victim driving requests")
        workers = [w for w, holder in _holders(r).items() if holder == victim]
        fences = {w: _fence(r, w) for w in workers}
        pid = int(victim.rsplit("-", 2)[1])  # consumer names are host-pid-suffix
        name, proc = next((n, p) for n, p in stack.procs if p.pid == pid)
        proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        driven, claimed = None, None
        while driven is None or claimed is None:
            now = time.monotonic() - t0
            if driven is None and all(_fence(r, w) > fences[w] for w in workers):
                driven = now
            if claimed is None and _pending_of(r, victim) == 0:
                claimed = now
            if now > 60:
                raise RuntimeError("no takeover within 60 s")
            time.sleep(POLL_S)
        for f in futures:
            text, n = f.result(timeout=300)
            assert n == max_tokens, f"a stream ended early: {n} tokens"
    proc.wait()
    stack.supervise()  # restarts the killed scheduler for the next round
    return driven, claimed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--lease-ttl", type=float, default=messages.LEASE_TTL_S)
    p.add_argument(
        "--max-tokens", type=int, default=300, help="tokens per stream (long enough to outlast the kill)"
    )
    args = p.parse_args(argv)
    import fuseserve

    with fuseserve.serve(
        MODEL, workers=2, schedulers=2, port=free_port(), simulate="a100-llama2-7b", lease_ttl=args.lease_ttl
    ) as server:
        r = redis.Redis.from_url(server.stack.redis.url, decode_responses=True)
        rounds = []
        for _ in tqdm(range(args.rounds), desc="takeover rounds", unit="kill"):
            rounds.append(one_round(server.stack, server.url, r, args.max_tokens))
    print(f"lease TTL {args.lease_ttl:g} s, heartbeat {messages.LeaseTimings(args.lease_ttl).beat_s:g} s")
    for i, (driven, claimed) in enumerate(rounds):
        print(
            f"round {i}: workers driven by the peer after {driven:.2f} s, requests claimed after {claimed:.2f} s"
        )
    print(
        f"median of {len(rounds)}: workers {statistics.median(d for d, _ in rounds):.2f} s, "
        f"requests {statistics.median(c for _, c in rounds):.2f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
