"""OffloadCoordinator over a real Redis: direct and behind a spilling HostTier, tenants,
corrupt values found during a load, a killed server, and a second engine resuming."""

from __future__ import annotations

import logging

import pytest
from offload_testlib import U, assert_device_holds, check_arena, digests_of, make_engine, serve
from test_offload import PROMPT

from hybridcache.tiers import HostTier
from hybridcache.tiers.offload import OffloadCoordinator

pytestmark = [
    pytest.mark.redis,
    pytest.mark.filterwarnings("ignore:The given buffer is not writable:UserWarning"),
]


def demoted_session(tiers, tenant=None, **kw):
    """An engine that served PROMPT and then lost its whole device cache to the tiers."""
    m, st = make_engine(**kw)
    coord = OffloadCoordinator(m, st, tiers)
    serve(m, st, "a", PROMPT, tenant=tenant, coordinator=coord)
    m.clear()
    assert coord.flush(10)
    assert not m.index.nodes
    return m, st, coord


def test_redis_tier_round_trips_the_device_bytes(redis_url, make_tier):
    redis = make_tier(redis_url)
    m, st, coord = demoted_session([redis])
    assert redis.stats().puts == coord.metrics.demoted_entries == 15
    hit, plan = serve(m, st, "b", PROMPT + [7] * 6, coordinator=coord)
    assert hit == 40 and plan is not None and plan.entries_by_tier == {"0:RedisTier": 11}
    assert coord.metrics.tier_hits == {"0:RedisTier": 11}
    m.add_request("c", PROMPT + [7] * 6)  # b's entries are on the device now
    assert_device_holds(m, st, digests_of(m, PROMPT), 10)
    check_arena(m)


def test_host_tier_spills_to_redis_and_loads_read_both(redis_url, make_tier):
    redis = make_tier(redis_url)
    m0, _ = make_engine()
    kv = sum(m0.layout.page_payload.values())
    host = HostTier(6 * (kv + 1024))  # room for ~6 KV units: the rest spills
    m, st, coord = demoted_session([host, redis])
    assert coord.metrics.spilled_entries == host.stats().evictions > 0
    assert coord.flush(10)
    m.add_request("b", PROMPT + [7] * 6)
    plan = coord.prefetch("b")
    assert plan is not None and plan.hit_tokens == 40 and plan.complete
    assert set(plan.entries_by_tier) == {"0:HostTier", "1:RedisTier"}
    assert sum(plan.entries_by_tier.values()) == 11
    assert_device_holds(m, st, digests_of(m, PROMPT), 10)
    check_arena(m)


def test_tenants_share_nothing_through_redis(redis_url, make_tier):
    redis = make_tier(redis_url)
    m, st, coord = demoted_session([redis], tenant="alice")
    hit, plan = serve(m, st, "b", PROMPT + [7] * 6, tenant="bob", coordinator=coord)
    assert (hit, plan) == (0, None)
    assert coord.metrics.tier_hits == {}
    hit, plan = serve(m, st, "c", PROMPT + [7] * 6, tenant="alice", coordinator=coord)
    assert hit == 40 and plan is not None


def test_a_corrupt_value_in_redis_ends_the_prefix_at_the_snapshot_below(
    redis_url, make_tier, redis_server
):
    redis = make_tier(redis_url)
    m, st, coord = demoted_session([redis])
    d = digests_of(m, PROMPT)
    r = redis_server.client()
    name = redis.codec.entry_key(coord.keys.kv(None, d[6]))
    gen = r.get(name)[:16].decode()
    chunk = f"{name}:{gen}:0"
    value = bytearray(r.get(chunk))
    value[3] ^= 0x01
    r.set(chunk, bytes(value))
    m.add_request("b", PROMPT + [7] * 6)
    plan = coord.prefetch("b")
    assert plan is not None and plan.hit_tokens == 6 * U and not plan.complete
    assert redis.stats().corrupt == 1 and r.get(name) is None  # deleted by the tier
    assert_device_holds(m, st, d, 6)
    check_arena(m)


def test_redis_killed_means_misses_and_no_exception(own_redis, make_tier, caplog):
    redis = make_tier(own_redis.url)
    m, st, coord = demoted_session([redis])
    own_redis.kill()
    with caplog.at_level(logging.WARNING):
        m.add_request("b", PROMPT + [7] * 6)
        assert coord.prefetch("b") is None
        m.free("b", finished=False)
        hit, plan = serve(m, st, "c", PROMPT + [7] * 6, coordinator=coord)  # engine goes on
        assert (hit, plan) == (0, None)
        m.clear()  # demotions while down: dropped in the background, no exception
    assert coord.metrics.prefetch_errors == 0 and coord.metrics.demote_errors == 0
    assert redis.stats().errors > 0
    check_arena(m)


def test_a_second_engine_resumes_the_session_from_redis(redis_url, make_tier):
    """Agents move between engines: one demoted, another (same model, same secret) loads."""
    m1, _, _ = demoted_session([make_tier(redis_url)])
    m2, st2 = make_engine()
    coord2 = OffloadCoordinator(m2, st2, [make_tier(redis_url)])
    hit, plan = serve(m2, st2, "b", PROMPT + [7] * 6, coordinator=coord2)
    assert hit == 40 and plan is not None and plan.kv_units == tuple(range(10))
    m2.add_request("c", PROMPT + [7] * 6)
    assert_device_holds(m2, st2, digests_of(m2, PROMPT), 10)
