"""Fixtures for the tier tests: real redis-server processes on loopback (see tiers_testlib).

Every server runs with persistence off (``--save '' --appendonly no``) in a temporary
directory, on a free port, with a unix socket beside it; tests that need Redis are skipped
with a clear reason when the ``redis-server`` binary is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from tiers_testlib import SECRET, RedisServer

from hybridcache.tiers import RedisTier


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
