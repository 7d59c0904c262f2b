"""Graceful drain, unit level (no processes): the signal state, when a draining worker may exit, when
a draining scheduler stops, and the ``--drain-timeout`` plumbing of ``fuseserve serve``. The stack
tests (``test_stack_drain.py``) send real signals."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from fuseserve import messages
from fuseserve.drain_signal import DrainSignal
from fuseserve.scheduler.service import scheduler_drain
from fuseserve.worker.registration import wait_drained


def test_first_signal_drains_second_stops_now():
    d = DrainSignal(30)
    assert not d.requested.is_set() and not d.expired()
    d.request("SIGTERM")
    assert d.requested.is_set() and not d.expired() and d.deadline is not None
    d.request("SIGTERM")
    assert d.expired()
    zero = DrainSignal(0)
    zero.request()
    assert zero.expired()  # --drain-timeout 0: hand everything back at once


@pytest.fixture
def no_notice(monkeypatch):
    monkeypatch.setattr(messages, "DRAIN_NOTICE_S", 0.0)


def test_worker_waits_for_its_sequences_to_finish(no_notice):
    runner = SimpleNamespace(seqs={1: object(), 2: object()})
    d = DrainSignal(30)
    d.request()
    threading.Timer(0.2, runner.seqs.clear).start()  # the scheduler frees them as they finish
    assert wait_drained(runner, d) == 0
    assert not d.expired()


def test_worker_hands_back_at_the_deadline_or_second_signal(no_notice):
    runner = SimpleNamespace(seqs={1: object(), 2: object()})
    d = DrainSignal(0)
    d.request()
    assert wait_drained(runner, d) == 2
    d = DrainSignal(30)
    d.request()
    threading.Timer(0.1, d.request).start()
    assert wait_drained(runner, d) == 2


class _Redis:
    def __init__(self, live: list[str]):
        self.live = live

    def scan_iter(self, match, count):
        return [messages.scheduler_live_key(c) for c in self.live]


def _service(owners: dict, live: list[str]):
    return SimpleNamespace(accepting=True, owners=owners, r=_Redis(live), consumer="me")


@pytest.mark.parametrize(
    "owners,live,timeout,why",
    [
        ({}, ["me", "peer"], 30, "nothing unfinished"),
        ({7: object()}, ["me", "peer"], 30, "a peer takes over"),
        ({7: object()}, ["me"], 0, "alone, deadline passed"),
    ],
)
def test_scheduler_stops_reading_and_knows_when_to_stop(owners, live, timeout, why):
    service, d, stop = _service(owners, live), DrainSignal(timeout), threading.Event()
    d.request()
    scheduler_drain.watch(service, d, stop)
    assert stop.is_set() and not service.accepting, why


def test_scheduler_alone_keeps_serving_until_its_requests_finish():
    service, d, stop = _service({7: object()}, ["me"]), DrainSignal(30), threading.Event()
    d.request()
    t = threading.Thread(target=scheduler_drain.watch, args=(service, d, stop))
    t.start()
    assert not stop.wait(0.3) and not service.accepting  # still finishing
    service.owners.clear()
    t.join(5)
    assert stop.is_set()


def test_serve_passes_drain_timeout_to_scheduler_and_workers():
    from fuseserve.cli import build_parser, serve_args
    from fuseserve.launcher import worker_argv

    argv = worker_argv(serve_args(workers=2, drain_timeout=5), "redis://x", 0)
    assert argv[argv.index("--drain-timeout") + 1] == "5"
    parser = build_parser()
    assert parser.parse_args(["scheduler", "--redis-url", "x"]).drain_timeout == messages.DRAIN_TIMEOUT_S
    assert parser.parse_args(["worker", "--redis-url", "x", "--drain-timeout", "2.5"]).drain_timeout == 2.5


def _drain_timeout(argv: list[str]) -> float:
    words = " ".join(argv).split()
    return float(words[words.index("--drain-timeout") + 1])


def test_container_grace_periods_leave_room_for_the_drain():
    """Compose and Kubernetes wait longer than the drain before SIGKILL (else a drain is cut off)."""
    yaml = pytest.importorskip("yaml")
    root = Path(__file__).resolve().parents[2]
    compose = yaml.safe_load((root / "docker-compose.yml").read_text())["services"]
    for name in ("scheduler", "worker"):
        grace = float(compose[name]["stop_grace_period"].rstrip("s"))
        assert grace >= _drain_timeout(compose[name]["command"]) + 5, name
    for name in ("scheduler", "worker"):
        docs = yaml.safe_load_all((root / "deploy/kubernetes/base" / f"{name}.yaml").read_text())
        pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
        grace = pod["terminationGracePeriodSeconds"]
        assert grace >= _drain_timeout(pod["containers"][0]["args"]) + 5, name
