"""Helpers for the tier tests: redis-server processes, entries derived from their keys, polling."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from hybridcache.tiers import Entry, EntryKey

SECRET = b"test-secret-0123456789abcdef"
FINGERPRINT = "0123456789abcdef"
REDIS_BIN = shutil.which("redis-server") or (
    "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None
)


def key(tenant: str, n: int, fingerprint: str = FINGERPRINT) -> EntryKey:
    """The key of prefix ``n`` of ``tenant`` (the prefix hash is the same for every tenant,
    to check isolation does not rest on the upstream salt alone)."""
    return EntryKey.from_int(tenant, fingerprint, 0x5EED0000 + n)


def entry_for(k: EntryKey, kv_tokens: int = 8, torch_state: bool = True) -> Entry:
    """A small entry whose every byte derives from ``k``: a mix-up cannot go unnoticed."""
    seed = int.from_bytes(k.prefix_hash[-8:], "big") ^ zlib.crc32(k.tenant.encode())
    rng = np.random.default_rng(seed & 0xFFFFFFFF)
    kv = rng.standard_normal((kv_tokens, 2, 16)).astype(np.float16)
    state = torch.from_numpy(rng.standard_normal((2, 8, 8)).astype(np.float32))
    pieces = {"kv": kv, "state": state.to(torch.bfloat16) if torch_state else state.numpy()}
    return Entry(pieces, meta={"tenant": k.tenant, "n": int.from_bytes(k.prefix_hash, "big")})


def assert_same(a: Entry | None, b: Entry) -> None:
    """Same names, types, dtypes, shapes, bytes and metadata."""
    assert a is not None
    assert list(a.pieces) == list(b.pieces)
    assert dict(a.meta) == dict(b.meta)
    for name, x in a.pieces.items():
        y = b.pieces[name]
        assert type(x) is type(y), name
        assert x.dtype == y.dtype and tuple(x.shape) == tuple(y.shape), name
        assert _raw(x) == _raw(y), name


def _raw(x) -> bytes:
    if isinstance(x, torch.Tensor):
        return x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(x).tobytes()


def poll(predicate: Callable[[], bool], timeout_s: float = 10.0, step_s: float = 0.05) -> bool:
    """Wait for ``predicate`` (no fixed sleeps: the test is as fast as the system allows)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step_s)
    return predicate()


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
