"""``fuseserve serve``'s processes: its children stop when it is killed outright
(``fuseserve.parent_death``), the Redis password stays out of what it prints, and a taken port is
refused up front."""

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from fuseserve import parent_death
from fuseserve.launcher import Stack, live_view_command
from fuseserve.redis_launcher import RedisServer, find_redis_server

linux_only = pytest.mark.skipif(not parent_death.supported(), reason="PR_SET_PDEATHSIG is Linux only")


def _gone(pid: int, timeout: float = 10.0) -> bool:
    """True once ``pid`` has exited (a zombie nobody reaps counts as exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _parent(code: str, lines: int) -> tuple[subprocess.Popen, list[str]]:
    """A parent process running ``code``, which prints ``lines`` lines then sleeps; returns it and them."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True)
    out = [proc.stdout.readline().strip() for _ in range(lines)]
    return proc, out


@linux_only
def test_a_python_child_gets_sigterm_when_its_parent_is_killed_and_does_not_pass_it_on():
    parent, (child_pid, inherited) = _parent(
        f"""
        import os, subprocess, sys, time
        child = subprocess.Popen(
            [sys.executable, "-c",
             "import os, sys, time; from fuseserve.parent_death import follow_parent; follow_parent(); "
             "print(os.getpid(), os.environ.get({parent_death.PARENT_PID_ENV!r}), flush=True); time.sleep(60)"],
            env={{**os.environ, {parent_death.PARENT_PID_ENV!r}: str(os.getpid())}},
            stdout=subprocess.PIPE, text=True, start_new_session=True)
        pid, inherited = child.stdout.readline().split()
        print(pid, flush=True)
        print(inherited, flush=True)
        time.sleep(60)
    """,
        lines=2,
    )
    try:
        assert inherited == "None"  # the child's own children would not follow this parent
        assert not _gone(int(child_pid), timeout=0.5)  # alive while the parent lives
        parent.send_signal(signal.SIGKILL)
        assert _gone(int(child_pid))
    finally:
        parent.kill()
        parent.wait()


@linux_only
def test_a_child_whose_parent_died_before_it_asked_stops_at_once():
    env = {**os.environ, parent_death.PARENT_PID_ENV: "1"}  # not our parent: it is "already gone"
    code = "from fuseserve.parent_death import follow_parent; follow_parent(); import time; time.sleep(30)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, timeout=30)
    assert proc.returncode == -signal.SIGTERM


@linux_only
@pytest.mark.skipif(find_redis_server() is None, reason="no redis-server")
def test_redis_started_to_follow_its_parent_stops_with_it_and_keeps_its_password_in_a_private_file():
    parent, (pid, url, pw_file) = _parent(
        """
        import time
        from fuseserve.redis_launcher import find_redis_server, start_redis_server
        r = start_redis_server(find_redis_server(), follow_parent=True)
        print(r.process.pid, flush=True)
        print(r.url, flush=True)
        print(r.password_file, flush=True)
        time.sleep(60)
    """,
        lines=3,
    )
    try:
        with open(f"/proc/{pid}/comm") as f:
            assert f.read().strip().startswith("redis-server")  # the prelude exec'd it: same pid
        assert stat.S_IMODE(os.stat(pw_file).st_mode) == 0o600
        with open(pw_file) as f:
            assert RedisServer(url).password == f.read()
        parent.send_signal(signal.SIGKILL)
        assert _gone(int(pid))
    finally:
        parent.kill()
        parent.wait()


def test_the_live_view_hint_reads_the_password_from_its_file_and_never_prints_it(tmp_path):
    (tmp_path / "password").write_text("s3cret")
    stack = Stack()
    stack.redis = RedisServer("redis://:s3cret@127.0.0.1:6379/0", workdir=str(tmp_path))
    line = live_view_command(stack, "http://127.0.0.1:8000")
    assert "s3cret" not in line
    assert line == (
        f'FUSESERVE_REDIS_PASSWORD="$(cat {tmp_path}/password)" '
        "fuseserve top --url http://127.0.0.1:8000 --redis-url redis://127.0.0.1:6379/0"
    )
    stack.redis = RedisServer("redis://:s3cret@10.0.0.5:6379/0")  # $REDIS_URL: no file of ours
    assert "s3cret" not in live_view_command(stack, "http://127.0.0.1:8000")


def test_serve_refuses_a_taken_port_with_a_clear_error():
    import socket

    from fuseserve.cli import serve_args
    from fuseserve.errors import FuseServeError
    from fuseserve.launcher import start_stack

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(FuseServeError, match=f"127.0.0.1:{port} is in use"):
            start_stack(serve_args(port=port, simulate="cpu-smollm2"))
