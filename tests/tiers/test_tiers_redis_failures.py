"""Fail closed, never wrong: corrupt data, a killed, paused or full server."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from tiers_testlib import RedisServer, assert_same, entry_for, free_port, key, poll

from hybridcache.tiers import Entry

pytestmark = [
    pytest.mark.redis,
    pytest.mark.filterwarnings("ignore:The given buffer is not writable:UserWarning"),
]
LOGGER = "hybridcache.tiers.redis"


def _stored(tier, redis_server, k, chunk_bytes_entry=None):
    entry = chunk_bytes_entry or entry_for(k)
    tier.put(k, entry)
    assert tier.flush(10)
    return redis_server.client(), tier.codec.entry_key(k), entry


def _chunks(r, name):
    """The chunk keys the manifest at ``name`` names (generation prefix + index)."""
    gen = r.get(name)[:16].decode()
    return sorted(n.decode() for n in r.keys(f"{name}:{gen}:*"))


def _assert_dropped(tier, r, name, k, corrupt=1):
    assert tier.get(k) is None
    assert tier.stats().corrupt == corrupt
    assert r.keys("*") == [], "a corrupt entry must be deleted, chunks included"
    assert tier.get(k) is None and not tier.contains(k)


def test_overwritten_bytes_are_a_miss_and_the_entry_is_deleted(redis_url, make_tier, redis_server):
    tier = make_tier(redis_url)
    k = key("alice", 1)
    r, name, _ = _stored(tier, redis_server, k)
    first = _chunks(r, name)[0]
    r.setrange(first, 100, b"\xff\xfe")  # overwrite bytes in place
    _assert_dropped(tier, r, name, k)
    assert tier.stats().misses == 2 and tier.stats().hits == 0


def test_truncated_piece_is_a_miss(redis_url, make_tier, redis_server):
    tier = make_tier(redis_url)
    k = key("alice", 1)
    r, name, _ = _stored(tier, redis_server, k)
    last = _chunks(r, name)[-1]
    r.set(last, r.get(last)[:-3])
    _assert_dropped(tier, r, name, k)


def test_corrupt_manifest_is_a_miss(redis_url, make_tier, redis_server):
    tier = make_tier(redis_url)
    k = key("alice", 1)
    r, name, _ = _stored(tier, redis_server, k)
    manifest = bytearray(r.get(name))
    manifest[30] ^= 0x10
    r.set(name, bytes(manifest))
    assert tier.get(k) is None and tier.stats().corrupt == 1
    assert r.exists(name) == 0  # its chunks cannot be named any more: they expire (TTL)


def test_manifest_present_but_a_piece_missing_is_a_miss(redis_url, make_tier, redis_server):
    tier = make_tier(redis_url, chunk_bytes=100)
    k = key("alice", 1)
    entry = Entry({"kv": np.arange(100, dtype=np.float32), "state": np.ones(8, np.float32)})
    r, name, _ = _stored(tier, redis_server, k, entry)
    chunks = _chunks(r, name)
    assert len(chunks) == 5  # 4 chunks of kv + 1 of state
    r.unlink(chunks[2])
    _assert_dropped(tier, r, name, k)


def test_bad_generation_foreign_values_and_wrong_types_are_misses(
    redis_url, make_tier, redis_server
):
    tier = make_tier(redis_url)
    a, b, c = key("alice", 1), key("alice", 2), key("alice", 3)
    r, name_a, _ = _stored(tier, redis_server, a)
    _, name_b, _ = _stored(tier, redis_server, b)
    r.set(name_a, b"0" * 16 + r.get(name_a)[16:])  # manifest names chunks that do not exist
    r.set(name_b, b"some value another program wrote")
    r.hset(tier.codec.entry_key(c), "x", "a hash, not a manifest")
    assert tier.get_many([a, b, c]) == [None, None, None]
    assert tier.stats().corrupt == 3
    assert r.exists(name_a, name_b, tier.codec.entry_key(c)) == 0


def test_a_corrupt_entry_replaced_meanwhile_is_not_deleted(redis_url, make_tier, redis_server):
    """The conditional drop only deletes the manifest that was read."""
    from hybridcache.tiers.redis_io import BadEntry

    tier = make_tier(redis_url)
    k = key("alice", 1)
    r, name, entry = _stored(tier, redis_server, k)
    stale = BadEntry(k, name, b"an older manifest", [], "test")
    tier._drop(r, stale)
    assert_same(tier.get(k), entry)
    assert tier.stats().corrupt == 0


def test_server_killed_mid_run_gives_misses_then_recovers(own_redis, make_tier, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    tier = make_tier(own_redis.url, retry_interval_s=0.05)
    keys = [key("alice", i) for i in range(10)]
    for k in keys[:5]:
        tier.put(k, entry_for(k))
    tier.flush()
    assert tier.longest_prefix(keys) == 5

    own_redis.kill()
    for k in keys[5:] * 3:  # every call type, many times: misses, never an exception
        assert tier.get(keys[1]) is None
        assert tier.get_many(keys[:3]) == [None] * 3
        assert tier.contains_many(keys[:3]) == [False] * 3
        assert tier.longest_prefix(keys) == 0
        tier.put(k, entry_for(k))  # reads of k may be served from the queue: not checked
        tier.delete(keys[0])
    assert tier.flush(30)
    stats = tier.stats()
    assert stats.errors >= 1 and stats.dropped_writes >= 1 and stats.hits == 0
    down = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(down) == 1, "one warning per outage, not one per call"

    own_redis.start()  # same port, empty (no persistence)
    k = keys[7]

    def written_and_read() -> bool:
        tier.put(k, entry_for(k))
        tier.flush(10)
        return tier.get(k) is not None

    assert poll(written_and_read, timeout_s=20)
    assert_same(tier.get(k), entry_for(k))
    assert any("reachable again" in r.getMessage() for r in caplog.records)


def test_paused_server_times_out_into_misses_and_bounded_drops(own_redis, make_tier):
    tier = make_tier(own_redis.url, socket_timeout=1.0, retry_interval_s=60, max_pending_writes=2)
    k0 = key("alice", 0)
    tier.put(k0, entry_for(k0))
    tier.flush()
    own_redis.pause()
    try:
        accepted = [tier.put(key("alice", i), entry_for(key("alice", i))) for i in range(1, 21)]
        # The writer is stuck on the paused server: it holds 2 writes, the rest is dropped.
        assert accepted.count(True) <= 2
        assert tier.get(k0) is None  # a timeout (or the open breaker): a miss
        assert tier.flush(30)
        stats = tier.stats()
        assert stats.errors >= 1 and stats.dropped_writes >= 18
    finally:
        own_redis.resume()
    assert poll(tier.ping, timeout_s=10)
    assert_same(tier.get(k0), entry_for(k0))


def test_server_down_at_start_then_up(tmp_path, make_tier):
    server = RedisServer(tmp_path / "late", port=free_port())
    tier = make_tier(server.url, retry_interval_s=0.05)
    k = key("alice", 1)
    assert tier.get(k) is None
    tier.put(k, entry_for(k))
    assert tier.flush(10)
    assert tier.stats().errors >= 1
    server.start()
    try:

        def works() -> bool:
            tier.put(k, entry_for(k))
            tier.flush(10)
            return tier.get(k) is not None

        assert poll(works, timeout_s=20)
    finally:
        server.stop()


def test_out_of_memory_refusals_are_counted_not_raised(own_redis, make_tier, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    tier = make_tier(own_redis.url)
    small = key("alice", 1)
    tier.put(small, entry_for(small))
    tier.flush()
    r = own_redis.client()
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", r.info("memory")["used_memory"] + 100_000)
    for i in range(3):
        tier.put(key("alice", 10 + i), Entry({"x": np.zeros(4 << 20, np.uint8)}))
    assert tier.flush(30)
    assert tier.stats().errors >= 1 and tier.stats().dropped_writes >= 1
    assert_same(tier.get(small), entry_for(small))  # reads still work
    refused = [rec for rec in caplog.records if "refused" in rec.getMessage()]
    assert len(refused) == 1
