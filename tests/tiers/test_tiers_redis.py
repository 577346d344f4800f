"""RedisTier against a real redis-server: round trips, isolation, TTLs, quotas, batching."""

from __future__ import annotations

import numpy as np
import pytest
import redis
import torch
from tiers_testlib import FINGERPRINT, SECRET, assert_same, entry_for, key, poll

from hybridcache.tiers import Entry, EntryKey, KeyCodec, TenantLimits, TierConfigError

pytestmark = [
    pytest.mark.redis,
    pytest.mark.filterwarnings("ignore:The given buffer is not writable:UserWarning"),
]

ALL_DTYPES = {
    "np_f32": np.linspace(-3, 3, 300, dtype=np.float32).reshape(10, 30),
    "np_f16": np.linspace(-3, 3, 300, dtype=np.float16),
    "np_i8": np.arange(-128, 128, dtype=np.int8),
    "np_u8": np.arange(256, dtype=np.uint8).reshape(16, 16),
    "pt_f32": torch.randn(4, 32, 32, generator=torch.Generator().manual_seed(1)),
    "pt_bf16": torch.randn(12288, 3, generator=torch.Generator().manual_seed(2)).bfloat16(),
    "pt_f16": torch.randn(7, 9, generator=torch.Generator().manual_seed(3)).half(),
    "pt_i8": torch.arange(-100, 100, dtype=torch.int8),
    "pt_u8": torch.arange(0, 250, dtype=torch.uint8),
    "pt_fp8": torch.randn(64, generator=torch.Generator().manual_seed(4)).to(torch.float8_e4m3fn),
    "empty": torch.zeros(0, 5, dtype=torch.bfloat16),
}


@pytest.mark.parametrize("chunk_bytes", [4 << 20, 1000])
def test_round_trip_of_every_dtype_is_exact(redis_url, make_tier, chunk_bytes):
    tier = make_tier(redis_url, chunk_bytes=chunk_bytes)
    k = key("alice", 1)
    original = Entry(ALL_DTYPES, meta={"tokens": 4096})
    assert tier.put(k, original)
    assert tier.flush(10)
    assert_same(tier.get(k), original)
    # A second tier (another engine, same secret) reads it from Redis, not from a queue.
    other = make_tier(redis_url, chunk_bytes=chunk_bytes)
    assert_same(other.get(k), original)
    assert other.stats().hits == 1 and other.stats().bytes_out == original.nbytes


def test_chunks_are_written_under_a_manifest_that_names_them(redis_url, make_tier, redis_server):
    tier = make_tier(redis_url, chunk_bytes=1000)
    k = key("alice", 1)
    tier.put(k, Entry({"a": np.zeros(2500, np.uint8), "b": np.ones(10, np.float32)}), ttl_s=60)
    tier.flush()
    r = redis_server.client()
    name = KeyCodec("hc", SECRET).entry_key(k)
    gen = r.get(name)[:16].decode()
    chunks = [f"{name}:{gen}:{i}" for i in range(4)]  # 3 chunks of a, 1 of b
    assert sorted(n.decode() for n in r.keys("*")) == sorted([name, *chunks])
    assert [len(v) for v in r.mget(chunks)] == [1000, 1000, 500, 40]
    assert k.prefix_hex not in name
    assert min(r.pttl(c) for c in chunks) > r.pttl(name)  # chunks outlive their manifest
    assert len({redis.cluster.key_slot(n.encode()) for n in [name, *chunks]}) == 1


def test_two_tenants_with_identical_prompts_never_share(redis_url, make_tier, redis_server):
    tier = make_tier(redis_url)
    for i in range(20):
        tier.put(key("alice", i), entry_for(key("alice", i)))
    tier.flush()
    bob_keys = [key("bob", i) for i in range(20)]  # same prefix hashes as alice's
    assert tier.get_many(bob_keys) == [None] * 20
    assert tier.contains_many(bob_keys) == [False] * 20
    assert tier.longest_prefix(bob_keys) == 0
    assert all(n.startswith(b"hc:alice:") for n in redis_server.client().keys("*"))
    for i, got in enumerate(tier.get_many([key("alice", i) for i in range(20)])):
        assert_same(got, entry_for(key("alice", i)))


def test_an_entry_moved_under_another_tenants_key_is_refused(redis_url, make_tier, redis_server):
    """Even if two keys collided, the header's tenant check stops a cross-tenant read."""
    tier = make_tier(redis_url)
    alice, bob = key("alice", 1), key("bob", 1)
    tier.put(alice, entry_for(alice))
    tier.flush()
    r = redis_server.client()
    r.rename(tier.codec.entry_key(alice), tier.codec.entry_key(bob))
    assert tier.get(bob) is None
    assert tier.stats().corrupt == 1
    assert r.exists(tier.codec.entry_key(bob)) == 0  # deleted


def test_other_model_fingerprint_is_another_key(redis_url, make_tier):
    tier = make_tier(redis_url)
    tier.put(key("alice", 1), entry_for(key("alice", 1)))
    tier.flush()
    assert tier.get(key("alice", 1, fingerprint="feedfacefeedface")) is None
    other_secret = make_tier(redis_url, secret=SECRET + b"x")
    assert other_secret.get(key("alice", 1)) is None


def test_ttl_per_session_and_per_tenant(redis_url, make_tier):
    tier = make_tier(redis_url, limits=TenantLimits(tenant_ttls={"bob": 1.0}))
    short, kept, bob = key("alice", 1), key("alice", 2), key("bob", 1)
    tier.put(short, entry_for(short), ttl_s=1.0)
    tier.put(kept, entry_for(kept))
    tier.put(bob, entry_for(bob))
    tier.flush()
    assert tier.contains_many([short, kept, bob]) == [True, True, True]
    assert poll(lambda: tier.contains_many([short, bob]) == [False, False], timeout_s=10)
    assert tier.get(short) is None and tier.get(bob) is None
    assert_same(tier.get(kept), entry_for(kept))


def test_quota_is_shared_by_engines_and_evicts_the_oldest(redis_url, make_tier, redis_server):
    one = entry_for(key("alice", 0))
    size = _stored_size(one)
    limits = TenantLimits(tenant_quotas={"alice": 3 * size + size // 2})
    engine_a = make_tier(redis_url, limits=limits)
    engine_b = make_tier(redis_url, limits=limits)
    keys = [key("alice", i) for i in range(6)]
    for i, k in enumerate(keys):
        (engine_a if i % 2 else engine_b).put(k, entry_for(k))
        engine_a.flush()
        engine_b.flush()
        assert engine_a.usage("alice") <= 3 * size + size // 2
    assert engine_a.contains_many(keys) == [False, False, False, True, True, True]
    assert engine_a.usage("alice") == engine_b.usage("alice") == 3 * size
    # evicted entries went whole: 3 manifests + their chunks + the two ledger keys remain
    assert len(redis_server.client().keys("*")) == 3 * (1 + 2) + 2
    # bob has no quota and is not affected by alice's quota
    for i in range(6):
        engine_a.put(key("bob", i), entry_for(key("bob", i)))
    engine_a.flush()
    assert engine_a.contains_many([key("bob", i) for i in range(6)]) == [True] * 6
    assert engine_a.usage("bob") is None


def test_quota_refuses_an_entry_larger_than_the_quota(redis_url, make_tier):
    tier = make_tier(redis_url, limits=TenantLimits(default_quota=1000))
    big = key("alice", 1)
    assert tier.put(big, Entry({"x": np.zeros(5000, np.uint8)}))  # queued...
    tier.flush()
    assert tier.get(big) is None  # ...but refused by the ledger
    assert tier.stats().quota_rejections == 1


def test_quota_bytes_come_back_on_delete_and_expiry(redis_url, make_tier, redis_server):
    tier = make_tier(redis_url, limits=TenantLimits(default_quota=1 << 20))
    a, b = key("alice", 1), key("alice", 2)
    tier.put(a, entry_for(a))
    tier.put(b, entry_for(b), ttl_s=1.0)
    tier.flush()
    size = _stored_size(entry_for(a))
    assert tier.usage("alice") == 2 * size
    tier.delete(a)
    tier.flush()
    assert tier.usage("alice") == size
    assert poll(lambda: tier.usage("alice") == 0, timeout_s=10)
    # drift repair: an entry removed behind the tier's back
    tier.put(a, entry_for(a))
    tier.flush()
    redis_server.client().unlink(tier.codec.entry_key(a))
    assert tier.usage("alice") == size
    assert tier.reconcile_quota("alice") == size and tier.usage("alice") == 0


def test_reads_see_own_pending_writes_and_deletes(redis_url, make_tier):
    tier = make_tier(redis_url)
    k = key("alice", 1)
    tier.put(k, entry_for(k))
    assert_same(tier.get(k), entry_for(k))  # queued or written: either way a hit
    tier.delete(k)
    assert tier.get(k) is None and not tier.contains(k)
    tier.flush()
    assert tier.get(k) is None
    tier.put(k, entry_for(k))
    tier.flush()
    assert tier.contains(k)


def test_longest_prefix_and_batched_reads(redis_url, make_tier):
    tier = make_tier(redis_url)
    keys = [key("alice", i) for i in range(200)]
    for k in keys[:123]:
        tier.put(k, entry_for(k))
    tier.put(keys[150], entry_for(keys[150]))
    tier.flush()
    assert tier.longest_prefix(keys) == 123
    got = tier.get_many(keys[120:126])
    assert [g is not None for g in got] == [True] * 3 + [False] * 3
    for k, g in zip(keys[120:123], got, strict=False):
        assert_same(g, entry_for(k))


def test_overwrites_leave_no_orphan_chunks(redis_url, make_tier, redis_server):
    engines = [make_tier(redis_url, chunk_bytes=1000) for _ in range(2)]
    k = key("alice", 1)
    for i in range(20):  # two engines overwrite the same key with different layouts
        engines[i % 2].put(k, Entry({"a": np.full(500 * (i % 5 + 1), i, np.uint8)}))
        if i % 3 == 0:
            engines[0].flush()
    for e in engines:
        e.flush()
    got = engines[0].get(k)
    assert got is not None and len(set(got.pieces["a"].tolist())) == 1
    n_chunks = -(-got.pieces["a"].size // 1000)
    assert len(redis_server.client().keys("*")) == 1 + n_chunks
    engines[1].delete(k)
    engines[1].flush()
    assert redis_server.client().keys("*") == []


def test_configuration_errors_raise(redis_url, monkeypatch):
    from hybridcache.tiers import RedisTier

    monkeypatch.delenv("HYBRIDCACHE_TIER_SECRET", raising=False)
    with pytest.raises(TierConfigError, match="secret"):
        RedisTier(redis_url)
    with pytest.raises(TierConfigError, match="scheme"):
        RedisTier("http://localhost", secret=SECRET)
    with pytest.raises(TierConfigError):
        RedisTier(redis_url, secret=SECRET, decode_responses=True)
    monkeypatch.setenv("HYBRIDCACHE_TIER_SECRET", SECRET.decode())
    tier = RedisTier(client=redis.Redis.from_url(redis_url))
    assert tier.get(EntryKey("a", FINGERPRINT, b"\x01")) is None
    tier.close()


def _stored_size(entry: Entry) -> int:
    """Bytes the ledger accounts for ``entry`` under a 'alice' key (header + payload)."""
    from hybridcache.tiers import EntryAuth, encode

    return encode(key("alice", 0), entry, EntryAuth(SECRET), chunk_bytes=4 << 20).stored_bytes


def test_put_after_close_is_dropped_not_raised(redis_url, make_tier):
    tier = make_tier(redis_url)
    tier.close()
    assert not tier.put(key("alice", 1), entry_for(key("alice", 1)))
    assert tier.stats().dropped_writes == 1
