"""HostTier: exact round trips, LRU and priority eviction, quotas, TTLs, and properties."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiers_testlib import assert_same, entry_for, key

from hybridcache.tiers import Entry, HostTier, TenantLimits, TierConfigError

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable:UserWarning")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def block(n: int, nbytes: int = 1000) -> Entry:
    """An entry of ``nbytes`` payload whose bytes name ``n``."""
    return Entry({"kv": np.full(nbytes, n % 251, dtype=np.uint8)})


def unit_size(tenant: str = "alice", nbytes: int = 1000) -> int:
    """Bytes the tier accounts for one ``block`` of ``tenant``."""
    tier = HostTier(1 << 30)
    tier.put(key(tenant, 0), block(0, nbytes))
    return tier.stats().bytes_used


def test_round_trip_numpy_and_torch_and_read_only_views():
    tier = HostTier(1 << 20)
    k = key("alice", 1)
    original = entry_for(k)
    assert tier.put(k, original)
    got = tier.get(k)
    assert_same(got, original)
    assert not got.pieces["kv"].flags.writeable
    assert tier.get(key("alice", 2)) is None
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.puts, stats.entries) == (1, 1, 1, 1)
    assert stats.bytes_in == stats.bytes_out == original.nbytes
    assert tier.pin_memory == torch.cuda.is_available()


def test_caller_may_reuse_its_buffers_after_put():
    tier = HostTier(1 << 20)
    arr = np.arange(100, dtype=np.float32)
    tier.put(key("alice", 1), Entry({"a": arr}))
    arr[:] = -1  # the host tier copied the bytes
    np.testing.assert_array_equal(tier.get(key("alice", 1)).pieces["a"], np.arange(100))


def test_lru_eviction_keeps_recently_used():
    u = unit_size()
    tier = HostTier(3 * u)
    for i in range(3):
        tier.put(key("alice", i), block(i))
    tier.get(key("alice", 0))
    tier.put(key("alice", 3), block(3))
    assert tier.contains_many([key("alice", i) for i in range(4)]) == [True, False, True, True]
    assert tier.stats().evictions == 1 and tier.stats().bytes_used == 3 * u


def test_priority_eviction_takes_lowest_value_first():
    u = unit_size()
    tier = HostTier(3 * u)
    tier.put(key("alice", 0), block(0), priority=5.0)
    tier.put(key("alice", 1), block(1))
    tier.put(key("alice", 2), block(2))
    tier.put(key("alice", 3), block(3))  # evicts 1: lowest priority, oldest
    tier.put(key("alice", 4), block(4))  # evicts 2
    present = tier.contains_many([key("alice", i) for i in range(5)])
    assert present == [True, False, False, True, True]


def test_tenant_quota_evicts_within_the_tenant_only():
    ua, ub = unit_size("alice"), unit_size("bob")
    tier = HostTier(10 * ua, limits=TenantLimits(tenant_quotas={"alice": 2 * ua}))
    for i in range(2):
        tier.put(key("bob", i), block(i))
    for i in range(5):
        assert tier.put(key("alice", i), block(i))
        assert tier.usage("alice") <= 2 * ua
    assert tier.contains_many([key("alice", i) for i in range(5)]) == [False] * 3 + [True] * 2
    assert tier.contains_many([key("bob", 0), key("bob", 1)]) == [True, True]
    assert tier.usage("bob") == 2 * ub


def test_too_large_entries_are_refused_and_counted():
    u = unit_size()
    tier = HostTier(4 * u, limits=TenantLimits(tenant_quotas={"alice": u}))
    assert not tier.put(key("alice", 1), block(1, 5000))
    assert tier.stats().quota_rejections == 1
    assert not tier.put(key("bob", 1), block(1, 50_000))
    assert tier.stats().dropped_writes == 1
    assert tier.stats().entries == 0


def test_replacing_a_key_accounts_it_once():
    tier = HostTier(1 << 20)
    tier.put(key("alice", 1), block(1, 1000))
    tier.put(key("alice", 1), block(2, 2000))
    assert tier.stats().entries == 1
    assert tier.get(key("alice", 1)).pieces["kv"][0] == 2
    assert tier.stats().bytes_used == tier.usage("alice")


def test_ttl_per_tenant_and_per_session():
    clock = FakeClock()
    limits = TenantLimits(default_ttl_s=100, tenant_ttls={"bob": 10})
    tier = HostTier(1 << 20, limits=limits, clock=clock)
    tier.put(key("alice", 1), block(1))  # tenant default: 100 s
    tier.put(key("alice", 2), block(2), ttl_s=2)  # this session: 2 s
    tier.put(key("bob", 1), block(1))  # bob: 10 s
    clock.now += 2.5
    assert tier.contains_many([key("alice", 1), key("alice", 2), key("bob", 1)]) == [
        True,
        False,
        True,
    ]
    clock.now += 10
    assert tier.get(key("bob", 1)) is None and tier.get(key("alice", 1)) is not None
    clock.now += 100
    assert tier.purge_expired() == 1
    assert tier.stats().expirations == 3 and tier.stats().bytes_used == 0


def test_verify_reads_catches_writes_into_returned_tensors():
    tier = HostTier(1 << 20, verify_reads=True)
    k = key("alice", 1)
    tier.put(k, Entry({"t": torch.zeros(16)}))
    got = tier.get(k).pieces["t"]
    got += 1  # torch cannot mark it read-only; the checksum still catches it
    assert tier.get(k) is None
    assert tier.stats().corrupt == 1 and not tier.contains(k)


def test_on_evict_receives_room_evictions_only_with_their_bytes(caplog):
    clock = FakeClock()
    size = unit_size()
    spilled: list[tuple] = []
    tier = HostTier(
        2 * size,
        limits=TenantLimits(default_ttl_s=100),
        clock=clock,
        on_evict=lambda k, e, ttl, prio: spilled.append((k, e, ttl, prio)),
    )
    tier.put(key("alice", 0), block(0), priority=1.5)
    tier.put(key("alice", 1), block(1), priority=2.0)
    clock.now += 40
    tier.put(key("alice", 2), block(2), priority=3.0)  # evicts 0, the lowest priority
    assert [(k, ttl, p) for k, _, ttl, p in spilled] == [(key("alice", 0), 60.0, 1.5)]
    assert_same(spilled[0][1], block(0))
    tier.delete(key("alice", 1))
    tier.put(key("alice", 2), block(7))  # a replacement is not an eviction
    clock.now += 200
    assert tier.purge_expired() == 1  # nor is an expiry
    assert len(spilled) == 1

    def broken(*args):
        raise RuntimeError("spill target down")

    tier.on_evict = broken
    tier.put(key("alice", 3), block(3))
    tier.put(key("alice", 4), block(4))
    tier.put(key("alice", 5), block(5))  # evicts; the hook's error is logged, not raised
    assert tier.contains(key("alice", 5))
    assert "on_evict failed" in caplog.text


def test_longest_prefix_counts_leading_complete_entries():
    tier = HostTier(1 << 22)
    keys = [key("alice", i) for i in range(100)]
    for k in keys[:37]:
        tier.put(k, block(0, 10))
    tier.put(keys[50], block(0, 10))  # after a gap: not part of the prefix
    assert tier.longest_prefix(keys) == 37
    assert tier.longest_prefix(keys[:20]) == 20
    assert tier.longest_prefix([]) == 0


def test_bad_configuration_is_refused():
    with pytest.raises(TierConfigError):
        HostTier(-1)
    with pytest.raises(TierConfigError):
        HostTier(100).put(key("alice", 1), block(1), ttl_s=-3)


def test_concurrent_use_never_mixes_entries():
    tier = HostTier(40 * unit_size())
    errors: list[str] = []

    def worker(t: int) -> None:
        for i in range(300):
            k = key("alice", (t * 7 + i) % 60)
            n = int.from_bytes(k.prefix_hash, "big") % 251
            if i % 3:
                got = tier.get(k)
                if got is not None and not (got.pieces["kv"] == n).all():
                    errors.append(f"{k} returned bytes of another entry")
            else:
                tier.put(k, block(n))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert tier.stats().bytes_used <= tier.capacity_bytes


# ---------------------------------------------------------------------- properties

TENANTS = ["alice", "bob", "carol"]
op = st.one_of(
    st.tuples(
        st.just("put"),
        st.sampled_from(TENANTS),
        st.integers(0, 11),
        st.integers(1, 3000),
        st.sampled_from([0.0, 1.0, 5.0]),
        st.sampled_from([None, 1.0, 30.0]),
    ),
    st.tuples(st.just("get"), st.sampled_from(TENANTS), st.integers(0, 11)),
    st.tuples(st.just("delete"), st.sampled_from(TENANTS), st.integers(0, 11)),
    st.tuples(st.just("tick"), st.floats(0.0, 20.0)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op, max_size=60),
    capacity=st.integers(0, 12_000),
    quotas=st.fixed_dictionaries({t: st.one_of(st.none(), st.integers(0, 6000)) for t in TENANTS}),
)
def test_budget_and_quotas_always_hold_and_hits_are_exact(ops, capacity, quotas):
    clock = FakeClock()
    limits = TenantLimits(tenant_quotas={t: q for t, q in quotas.items() if q is not None})
    tier = HostTier(capacity, limits=limits, clock=clock)
    model: dict = {}  # key -> payload byte written last
    for item in ops:
        if item[0] == "tick":
            clock.now += item[1]
            continue
        k = key(item[1], item[2])
        if item[0] == "put":
            _, _, _, size, prio, ttl = item
            fill = (size + item[2]) % 251
            stored = tier.put(
                k, Entry({"kv": np.full(size, fill, np.uint8)}), ttl_s=ttl, priority=prio
            )
            model[k] = (fill, size) if stored else None
            if stored:  # a stored entry is readable right away
                assert tier.contains(k)
        elif item[0] == "get":
            got = tier.get(k)
            if got is not None:  # never stale, never another key's bytes
                fill, size = model[k]
                assert got.pieces["kv"].shape == (size,) and (got.pieces["kv"] == fill).all()
        else:
            tier.delete(k)
            model[k] = None
            assert not tier.contains(k)
        stats = tier.stats()
        assert stats.bytes_used <= capacity
        for tenant, quota in quotas.items():
            if quota is not None:
                assert tier.usage(tenant) <= quota
        assert sum(tier.usage(t) for t in TENANTS) == tier.stats().bytes_used
