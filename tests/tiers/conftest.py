"""Fixtures for the tier tests: real redis-server processes on loopback, and entry builders.

Every server runs with persistence off (``--save '' --appendonly no``) in a temporary
directory, on a free port, with a unix socket beside it; tests that need Redis are skipped
with a clear reason when the ``redis-server`` binary is missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from tiers_testlib import SECRET

from hybridcache.tiers import RedisTier

REDIS_BIN = shutil.which("redis-server") or (
    "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process; can be killed and restarted on the same port."""

    def __init__(self, workdir: Path, port: int | None = None, extra: tuple[str, ...] = ()):
        if REDIS_BIN is None:
            pytest.skip("redis-server binary not found (Debian package: redis-server)")
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.unix_path = str(workdir / "redis.sock")
        self.extra = extra
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.unix_path}"

    def args(self) -> list[str]:
        return [
            REDIS_BIN,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--unixsocket", self.unix_path,
            "--unixsocketperm", "700",
            "--loglevel", "warning",
            *self.extra,
        ]  # fmt: skip

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(self.args(), stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited: {(self.workdir / 'redis.log').read_text()}"
                )
            try:
                if self.client().ping():
                    return self
            except (redis.ConnectionError, redis.TimeoutError):
                time.sleep(0.02)
        raise RuntimeError("redis-server did not answer PING in time")

    def client(self, **kwargs) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2, **self.client_options, **kwargs)

    @property
    def client_options(self) -> dict:
        """Extra redis-py options this server needs (TLS servers override it)."""
        return {}

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-run, like a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[RedisServer]:
    """One server shared by the tests that do not need to kill it."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of the shared server, emptied before the test."""
    redis_server.client().flushall()
    return redis_server.url


@pytest.fixture
def own_redis(tmp_path) -> Iterator[RedisServer]:
    """A server of the test's own, for tests that kill, pause or restart it."""
    server = RedisServer(tmp_path / "own-redis").start()
    yield server
    server.stop()


@pytest.fixture
def make_tier() -> Iterator[Callable[..., RedisTier]]:
    """Factory of RedisTier instances, all closed at teardown."""
    tiers: list[RedisTier] = []

    def make(url: str, **kwargs) -> RedisTier:
        kwargs.setdefault("secret", SECRET)
        kwargs.setdefault("retry_interval_s", 0.05)
        tier = RedisTier(url, **kwargs)
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()
