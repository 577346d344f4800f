"""OffloadCoordinator over HostTier: demotion on eviction, exact restores, the prefix stopping
at the last complete snapshot, tenants, the demotion rule, memory pressure."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from offload_testlib import (
    U,
    assert_device_holds,
    check_arena,
    digests_of,
    hybrid_spec,
    kv_pattern,
    make_engine,
    serve,
    snap_pattern,
    snap_span,
)

from hybridcache.errors import OutOfSpaceError
from hybridcache.tiers import Entry, HostTier, TierConfigError
from hybridcache.tiers.offload import OffloadCoordinator
from hybridcache.tiers.offload_policy import DemotionPolicy

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable:UserWarning")

PROMPT = list(range(100, 140))  # 10 units; interval:8 puts snapshots at units 2, 4, 6, 8, 10


def engine_with_host(capacity=1 << 24, **kw):
    m, st = make_engine(**kw)
    host = HostTier(capacity)
    return m, st, host, OffloadCoordinator(m, st, [host])


def test_eviction_demotes_kv_and_snapshots_with_their_bytes():
    m, st, host, coord = engine_with_host()
    serve(m, st, "a", PROMPT, coordinator=coord)
    m.clear()
    d = digests_of(m, PROMPT)
    for i in range(10):
        e = host.get(coord.keys.kv(None, d[i]))
        assert e is not None, f"unit {i}"
        for g, name in enumerate(m.groups):
            assert torch.equal(e.pieces[f"kv.{name}"], kv_pattern(m, d[i], g))
    for b in (2, 4, 6, 8, 10):
        e = host.get(coord.keys.snap(None, d[b - 1]))
        assert e is not None and torch.equal(e.pieces["state"], snap_pattern(m, d[b - 1]))
    assert not host.contains(coord.keys.snap(None, d[2]))  # no snapshot at unit 3
    met = coord.metrics
    assert (met.demoted_kv, met.demoted_snapshots) == (10, 5)
    assert met.demoted_bytes == 10 * coord.io.kv_bytes + 5 * snap_span(m)


def test_prefetch_restores_exactly_the_evicted_bytes():
    m, st, host, coord = engine_with_host()
    serve(m, st, "a", PROMPT, coordinator=coord)
    d = digests_of(m, PROMPT)
    before = {}
    for i in range(10):
        node = m.index.nodes[d[i]]
        before[i] = [st.page_bytes_view(p).clone() for p in node.pages]
    snap_before = st.slot_bytes_view(m.index.nodes[d[9]].snap)[: snap_span(m)].clone()
    m.clear()
    assert not m.index.nodes

    m.add_request("b", PROMPT + [7] * 6)
    assert m.match("b").hit_tokens == 0
    plan = coord.prefetch("b")
    assert plan is not None
    assert (plan.device_hit_tokens, plan.hit_tokens, plan.planned_tokens) == (0, 40, 40)
    assert plan.kv_units == tuple(range(10)) and plan.snapshot_boundary == 40
    assert plan.entries_by_tier == {"0:HostTier": 11} and plan.complete
    assert plan.bytes_loaded == 10 * coord.io.kv_bytes + snap_span(m)
    assert m.match("b").hit_tokens == 40
    for i in range(10):
        node = m.index.nodes[d[i]]
        for g, name in enumerate(m.groups):
            n = m.layout.page_payload[name]
            assert torch.equal(st.page_bytes_view(node.pages[g])[:n], before[i][g][:n])
    node = m.index.nodes[d[9]]
    assert torch.equal(st.slot_bytes_view(node.snap)[: snap_span(m)], snap_before)
    # The ten loaded units are one run: held and walked as one stretch, not unit by unit.
    units, holds = m.index.kv_path(d, 10)
    assert units == 10 and len(holds) == 1
    # Loaded entries are ordinary cached entries: the request runs from the hit.
    a = m.allocate("b", 6)
    assert a.start == 40 and a.state_copies.src == (node.snap,)
    m.commit("b", 46)
    m.free("b")
    assert coord.metrics.prefetch_hit_tokens == 40
    check_arena(m)


def test_a_missing_kv_unit_stops_at_the_last_snapshot_below_it():
    m, st, host, coord = engine_with_host()
    serve(m, st, "a", PROMPT, coordinator=coord)
    m.clear()
    d = digests_of(m, PROMPT)
    host.delete(coord.keys.kv(None, d[5]))
    m.add_request("b", PROMPT + [7] * 6)
    plan = coord.prefetch("b")
    assert plan is not None and plan.hit_tokens == 4 * U and plan.kv_units == (0, 1, 2, 3)
    assert m.match("b").hit_tokens == 4 * U
    assert d[4] not in m.index.nodes  # KV past the snapshot is not registered
    assert_device_holds(m, st, d, 4)
    check_arena(m)


def test_a_missing_snapshot_falls_back_to_the_one_below():
    m, st, host, coord = engine_with_host()
    serve(m, st, "a", PROMPT, coordinator=coord)
    m.clear()
    d = digests_of(m, PROMPT)
    host.delete(coord.keys.snap(None, d[9]))
    m.add_request("b", PROMPT + [7] * 6)
    plan = coord.prefetch("b")
    assert plan is not None and plan.hit_tokens == 8 * U and plan.snapshot_boundary == 8 * U
    assert d[8] not in m.index.nodes and d[9] not in m.index.nodes
    assert_device_holds(m, st, d, 8)
    check_arena(m)


def test_corrupt_kv_found_during_the_load_keeps_only_complete_snapshots():
    """The probe sees every entry; the load finds unit 7 corrupt (checksum) and a snapshot
    that does not fit the layout: what was loaded past the last complete snapshot is freed."""
    m, st = make_engine()
    host = HostTier(1 << 24, verify_reads=True)
    coord = OffloadCoordinator(m, st, [host])
    serve(m, st, "a", PROMPT, coordinator=coord)
    m.clear()
    d = digests_of(m, PROMPT)
    host.get(coord.keys.kv(None, d[7])).pieces["kv.full"][0] ^= 0xFF  # a flipped byte
    wrong = Entry(
        {"state": torch.zeros(snap_span(m) - 8, dtype=torch.uint8)}, {"k": "state", "d": 5}
    )
    host.put(coord.keys.snap(None, d[5]), wrong)
    m.add_request("b", PROMPT + [7] * 6)
    plan = coord.prefetch("b")
    assert plan is not None and plan.hit_tokens == 4 * U and not plan.complete
    assert plan.planned_tokens == 10 * U
    met = coord.metrics
    assert met.load_invalid == 1 and met.load_discarded == 3  # units 4-6 loaded, dropped
    assert met.prefetch_partial == 1
    assert not host.contains(coord.keys.snap(None, d[5]))  # the misfit was deleted
    assert not host.contains(coord.keys.kv(None, d[7]))  # the tier dropped the corrupt one
    assert_device_holds(m, st, d, 4)
    check_arena(m)


def test_device_kv_plus_a_tier_snapshot_makes_a_hit():
    """KV still on the device, only the snapshot evicted: just the snapshot is loaded."""
    m, st, host, coord = engine_with_host()
    serve(m, st, "a", PROMPT, coordinator=coord)
    d = digests_of(m, PROMPT)
    for i in (1, 3, 5, 7, 9):
        m.index.evict_snapshot(m.index.nodes[d[i]])
    m.add_request("b", PROMPT + [7] * 6)
    assert m.match("b").hit_tokens == 0
    plan = coord.prefetch("b")
    assert plan is not None and plan.kv_units == () and plan.snapshot_boundary == 40
    assert plan.bytes_loaded == snap_span(m)
    assert_device_holds(m, st, d, 10)
    check_arena(m)


def test_two_tenants_never_load_each_others_entries():
    m, st, host, coord = engine_with_host()
    serve(m, st, "a", PROMPT, tenant="alice", coordinator=coord)
    m.clear()
    m.add_request("b", PROMPT + [7] * 6, tenant="bob")
    assert coord.prefetch("b") is None
    assert coord.metrics.tier_hits == {}
    m.free("b", finished=False)
    m.add_request("c", PROMPT + [7] * 6, tenant="alice")
    plan = coord.prefetch("c")
    assert plan is not None and plan.hit_tokens == 40
    assert_device_holds(m, st, digests_of(m, PROMPT, "alice"), 10)
    # Alice's bytes under Bob's key would not fit his chain: every key differs.
    d_bob, d_alice = digests_of(m, PROMPT, "bob"), digests_of(m, PROMPT, "alice")
    assert not any(host.contains(coord.keys.kv("bob", x)) for x in d_bob + d_alice)
    check_arena(m)


def test_the_rule_drops_a_never_hit_tail_past_the_last_snapshot():
    tokens, out = list(range(200, 230)), tuple(range(10))  # snapshot at unit 7; units 7-9 tail
    m, st, host, coord = engine_with_host(admission="last-token")
    serve(m, st, "a", tokens, output=out, coordinator=coord)
    m.clear()
    d = digests_of(m, tokens + list(out))
    assert [host.contains(coord.keys.kv(None, x)) for x in d] == [True] * 7 + [False] * 3
    assert coord.metrics.demote_skipped_policy == 3
    m2, st2 = make_engine(admission="last-token")
    host2 = HostTier(1 << 24)
    coord2 = OffloadCoordinator(m2, st2, [host2], policy=DemotionPolicy(kv="all"))
    serve(m2, st2, "a", tokens, output=out, coordinator=coord2)
    m2.clear()
    assert all(host2.contains(coord2.keys.kv(None, x)) for x in d)


def test_untracked_paths_keep_their_kv_and_loaded_entries_are_not_written_twice():
    m, st, host, coord = engine_with_host(admission="last-token")
    tokens = list(range(200, 230))
    serve(m, st, "a", tokens, output=tuple(range(10)))  # no prefetch: path unknown
    m.clear()
    assert coord.metrics.demote_skipped_policy == 0 and coord.metrics.demoted_kv == 10
    puts = host.stats().puts
    hit, plan = serve(m, st, "b", tokens + [1, 2, 3], coordinator=coord)
    assert hit == 28 and plan is not None
    m.clear()
    assert host.stats().puts == puts + 2  # b's own last unit and its snapshot
    assert coord.metrics.demote_skipped_stored == 8  # 7 loaded units + the loaded snapshot


def test_models_without_state_or_without_attention():
    for spec, units in ((hybrid_spec(state=False), 10), (hybrid_spec(attention=False), 10)):
        m, st = make_engine(spec=spec)
        host = HostTier(1 << 24)
        coord = OffloadCoordinator(m, st, [host])
        serve(m, st, "a", PROMPT, coordinator=coord)
        m.clear()
        assert not m.index.nodes
        hit, plan = serve(m, st, "b", PROMPT + [7] * 6, coordinator=coord)
        assert plan is not None and hit == units * U == plan.hit_tokens
        check_arena(m)


def test_memory_pressure_gives_a_partial_load_at_a_snapshot():
    m, st = make_engine(capacity=1 << 20)
    host = HostTier(1 << 26)
    coord = OffloadCoordinator(m, st, [host])
    long = list(range(1000, 1000 + 160))  # 40 units, a snapshot every 2
    serve(m, st, "a", long, coordinator=coord)
    m.clear()
    small, small_st = make_engine(capacity=4 * m.layout.block_bytes)  # 4 slots or 6 units
    coord_small = OffloadCoordinator(small, small_st, [host])
    assert coord_small.fingerprint == coord.fingerprint  # same layout: same keys
    small.add_request("b", long + [1] * 4)
    plan = coord_small.prefetch("b")
    assert plan is not None and not plan.complete and plan.planned_tokens == 160
    assert 0 < plan.hit_tokens < 160 and plan.hit_tokens % (2 * U) == 0
    assert small.match("b").hit_tokens == plan.hit_tokens
    assert coord_small.metrics.prefetch_errors == 0
    assert_device_holds(small, small_st, digests_of(small, long), plan.hit_tokens // U)
    check_arena(small)


def test_close_detaches_and_bad_configuration_raises():
    m, st, host, coord = engine_with_host()
    coord.close()
    coord.close()  # idempotent
    assert host.on_evict is None  # the tier's own hook was never reassigned
    with pytest.raises(TierConfigError):
        OffloadCoordinator(m, st, [])
    other, other_st = make_engine(capacity=1 << 21)
    with pytest.raises(TierConfigError):
        OffloadCoordinator(m, other_st, [host])
    with pytest.raises(TierConfigError):
        DemotionPolicy(kv="some")


SHARED = [list(range(500 + 40 * k, 540 + 40 * k)) for k in range(3)]


@settings(max_examples=30, derandomize=True, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(
                st.just("serve"),
                st.integers(0, 2),  # shared prefix
                st.integers(0, 12),  # unique suffix length
                st.sampled_from([None, "alice"]),
                st.integers(0, 9),  # output tokens
            ),
            st.tuples(st.just("clear")),
            st.tuples(st.just("drop"), st.integers(0, 1 << 30)),
        ),
        min_size=1,
        max_size=14,
    ),
    blocks=st.integers(10, 24),
    host_kib=st.sampled_from([4, 16, 1 << 14]),
)
def test_random_traffic_loads_only_exact_bytes_at_complete_snapshots(ops, blocks, host_kib):
    """Whatever mix of traffic, device loss and tier loss: every hit after a prefetch is
    backed by exactly the bytes computed for it, and nothing leaks."""
    probe_m, _ = make_engine()
    m, st_ = make_engine(
        capacity=blocks * probe_m.layout.block_bytes, admission="interval:8+turn-end"
    )
    host = HostTier(host_kib << 10)
    coord = OffloadCoordinator(m, st_, [host])
    for n, op in enumerate(ops):
        if op[0] == "clear":
            m.clear()
        elif op[0] == "drop":
            present = sorted(host._slots, key=lambda k: k.prefix_hash)  # noqa: SLF001
            if present:
                host.delete(present[op[1] % len(present)])
        else:
            _, shared, extra, tenant, out = op
            tokens = SHARED[shared] + [900 + n] * extra
            rid = f"r{n}"
            m.add_request(rid, tokens, tenant=tenant)
            plan = coord.prefetch(rid)
            hit = m.match(rid).hit_tokens
            if plan is not None:
                assert plan.hit_tokens == hit and hit % U == 0
            assert_device_holds(m, st_, m.requests[rid].hasher.digests, hit // U)
            m.free(rid, finished=False)
            try:
                serve(
                    m, st_, rid, tokens, tenant=tenant, output=tuple(range(out)), coordinator=coord
                )
            except OutOfSpaceError:  # the arena cannot hold this request: the engine's call
                m.free(rid, finished=False)
    met = coord.metrics
    assert met.prefetch_errors == met.demote_errors == met.load_invalid == 0
    check_arena(m)
