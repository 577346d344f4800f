"""Bad arguments raise the library's error in the caller's thread, and change nothing."""

from __future__ import annotations

import threading
import time
import warnings

import numpy as np
import pytest
import torch
from tiers_testlib import FINGERPRINT, SECRET, entry_for, key

from hybridcache.config import CacheConfig
from hybridcache.tiers import (
    Entry,
    EntryKey,
    HostTier,
    InvalidEntryError,
    KeyCodec,
    RedisTier,
    TierConfigError,
)
from hybridcache.tiers.health import Breaker
from hybridcache.tiers.unseeded import UnseededCacheWarning, reset_warning, warn_if_unseeded

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable:UserWarning")


def _block(n: int, nbytes: int = 1000) -> Entry:
    return Entry({"kv": np.full(nbytes, n % 251, dtype=np.uint8)})


def _host_state(tier: HostTier) -> tuple:
    s = tier.stats()
    return (
        sorted(k.prefix_hash for k in tier._slots),
        s.entries,
        s.bytes_used,
        s.evictions,
        s.puts,
        s.deletes,
    )


@pytest.mark.parametrize("priority", ["high", None, float("nan"), float("inf"), True, [1]])
def test_host_put_with_a_bad_priority_changes_nothing(priority):
    """Full tier, same key replaced: a refused put must neither evict nor drop the old entry."""
    tier = HostTier(3 * 1200)
    for i in range(3):
        tier.put(key("alice", i), _block(i))
    before = _host_state(tier)
    with pytest.raises(TierConfigError, match="priority"):
        tier.put(key("alice", 0), _block(9), priority=priority)
    with pytest.raises(TierConfigError, match="priority"):
        tier.put(key("alice", 7), _block(7), priority=priority)
    assert _host_state(tier) == before
    assert np.all(tier.get(key("alice", 0)).pieces["kv"] == 0)


def _tiers(redis_url: str | None):
    yield HostTier(1 << 20)
    if redis_url is not None:
        yield RedisTier(redis_url, secret=SECRET)


@pytest.mark.redis
def test_str_keys_and_dict_entries_raise_the_library_error(redis_url):
    for tier in _tiers(redis_url):
        with pytest.raises(TierConfigError, match="EntryKey"):
            tier.put("alice:1", _block(1))
        with pytest.raises(InvalidEntryError, match="Entry"):
            tier.put(key("alice", 1), {"kv": np.zeros(3)})
        for call in (tier.get, tier.contains, tier.delete):
            with pytest.raises(TierConfigError, match="EntryKey"):
                call("alice:1")
        with pytest.raises(TierConfigError, match="sequence"):
            tier.get_many("alice:1")
        with pytest.raises(TierConfigError, match="ttl_s"):
            tier.put(key("alice", 1), _block(1), ttl_s="1h")
        assert tier.stats().puts == 0 and tier.stats().dropped_writes == 0
        tier.close()


@pytest.mark.redis
def test_redis_put_refuses_sparse_and_unsupported_pieces_synchronously(redis_url, redis_server):
    """``Entry`` checks its pieces when built; a piece swapped into its mapping afterwards
    (the mapping is the caller's) is still refused by ``put`` itself, not in the writer."""
    tier = RedisTier(redis_url, secret=SECRET)
    sparse = torch.eye(4).to_sparse()
    with pytest.raises(InvalidEntryError, match="sparse"):
        Entry({"s": sparse})
    for bad in (sparse, np.zeros(4, np.complex64), torch.zeros(2, dtype=torch.complex64)):
        pieces = {"kv": np.zeros(4, np.float32)}
        entry = Entry(pieces)
        pieces["kv"] = bad
        with pytest.raises(InvalidEntryError):
            tier.put(key("alice", 1), entry)
    with pytest.raises(InvalidEntryError, match="chunks"):
        RedisTier(redis_url, secret=SECRET, chunk_bytes=1).put(
            key("alice", 2), Entry({"kv": np.zeros(70_000, np.uint8)})
        )
    assert tier.flush(5)
    assert tier.stats().errors == 0 and tier.stats().pending_writes == 0
    assert redis_server.client().dbsize() == 0
    # Non-contiguous pieces are stored as their C-order bytes, exactly.
    view = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]
    tier.put(key("alice", 3), Entry({"v": view, "t": torch.arange(12.0).reshape(3, 4).T}))
    assert tier.flush(5)
    got = tier.get(key("alice", 3))
    np.testing.assert_array_equal(got.pieces["v"], view)
    assert torch.equal(got.pieces["t"], torch.arange(12.0).reshape(3, 4).T)
    tier.close()


@pytest.mark.parametrize("bad", ["alice\n", "alice\r\n", "\nalice", "al ice", "x" * 65, ""])
def test_names_must_match_fully(bad):
    with pytest.raises(TierConfigError):
        EntryKey(bad, FINGERPRINT, b"\x01")
    with pytest.raises(TierConfigError):
        EntryKey("alice", bad, b"\x01")
    with pytest.raises(TierConfigError):
        KeyCodec(bad, SECRET)


def test_generation_must_match_fully():
    from hybridcache.tiers.errors import EntryFormatError
    from hybridcache.tiers.redis_layout import unpack_manifest

    with pytest.raises(EntryFormatError):
        unpack_manifest(b"0123456789abcde\n" + b"HCTE")


def test_tier_tenants_with_a_trailing_newline_are_hashed():
    from hybridcache.tiers.offload_io import tier_tenant

    assert tier_tenant("alice") == "alice"
    assert tier_tenant("alice\n").startswith("t-")


@pytest.mark.redis
def test_a_str_secret_is_its_utf8_bytes(redis_url, monkeypatch):
    text = "s3cret-with-32-characters-long!!"
    assert len(text) == 32
    as_str = RedisTier(redis_url, secret=text)
    as_bytes = RedisTier(redis_url, secret=text.encode())
    k = key("alice", 1)
    assert as_str.codec.entry_key(k) == as_bytes.codec.entry_key(k)
    as_bytes.put(k, entry_for(k))
    assert as_bytes.flush(5)
    assert as_str.get(k) is not None  # same MAC keys too
    monkeypatch.setenv("HYBRIDCACHE_TIER_SECRET", text)
    from_env = RedisTier(redis_url)
    assert from_env.get(k) is not None
    for tier in (as_str, as_bytes, from_env):
        tier.close()
    with pytest.raises(TierConfigError, match="at least 16 bytes"):
        RedisTier(redis_url, secret="short")
    with pytest.raises(TierConfigError, match="str or bytes"):
        RedisTier(redis_url, secret=12345678901234567890)
    with pytest.raises(TierConfigError, match="verify_reads"):
        RedisTier(redis_url, secret=text, verify_reads=False)


def test_breaker_never_probes_in_the_callers_thread():
    """While open, ``allow`` answers at once even when a probe blocks for seconds."""
    release = threading.Event()
    started = []

    def slow_probe() -> None:
        started.append(threading.current_thread().name)
        release.wait(10)
        raise ConnectionError("still down")

    import logging

    breaker = Breaker("test", 0.01, logging.getLogger("test"), probe=slow_probe)
    breaker.failure(ConnectionError("down"))
    t0 = time.perf_counter()
    answers = []
    for _ in range(200):
        answers.append(breaker.allow())
        time.sleep(0.001)
    elapsed = time.perf_counter() - t0
    release.set()
    assert not any(answers)
    assert breaker.probes == 1, "one probe at a time"
    assert started and started[0] == "hybridcache-tier-probe"
    assert elapsed < 2.0  # 200 calls + 200 x 1 ms sleeps: no call waited on the probe


def test_breaker_closes_when_the_background_probe_succeeds():
    import logging

    breaker = Breaker("test", 0.01, logging.getLogger("test"), probe=lambda: True)
    breaker.failure(ConnectionError("down"))
    time.sleep(0.02)
    assert breaker.allow() is False  # starts the probe, answers at once
    deadline = time.monotonic() + 5
    while breaker.is_open and time.monotonic() < deadline:
        time.sleep(0.005)
    assert breaker.allow() is True


def test_an_empty_hash_seed_warns_once_for_shared_tiers(redis_url=None):
    reset_warning()
    host = HostTier(1 << 10)
    assert warn_if_unseeded("", [host]) is False  # in-process only: nothing to warn about
    shared = object.__new__(RedisTier)  # any non-host tier
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert warn_if_unseeded(CacheConfig().hash_seed, [host, shared]) is True
        assert warn_if_unseeded("", [shared]) is False  # once per process
    assert [w.category for w in caught] == [UnseededCacheWarning]
    reset_warning()
    assert warn_if_unseeded("a-secret-seed", [shared]) is False
