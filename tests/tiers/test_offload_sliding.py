"""Offload tiers with a sliding-window group: tiers store and load a unit's full KV and
snapshots only (never a sliding page as a unit's KV), and a prefix is loaded only up to an
end whose window is on the device; the coordinator's rule decides the hit after a load.

The oracle is :mod:`offload_testlib`'s: every page and snapshot holds a pattern derived
from its unit digest (sliding pages their own pattern), so bytes from the wrong unit or
group cannot pass."""

from __future__ import annotations

import pytest
import torch
from offload_testlib import (
    U,
    assert_device_holds,
    check_arena,
    digests_of,
    kv_pattern,
    pattern,
    snap_pattern,
    snap_span,
)

from hybridcache.kernels.storage import ArenaStorage
from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.spec import (
    AttentionGroupSpec,
    FlopModel,
    ModelSpec,
    StateGroupSpec,
    StateTensorSpec,
)
from hybridcache.tiers import HostTier
from hybridcache.tiers.offload import OffloadCoordinator

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable:UserWarning")

PROMPT = list(range(100, 140))  # 10 units; interval:8 puts snapshots at units 2, 4, 6, 8, 10
WINDOW = 9  # reach 2 units at U = 4: a hit at unit e needs the sliding pages of e-2, e-1


def sliding_spec(state: bool) -> ModelSpec:
    attn = (
        AttentionGroupSpec("full", "full", num_layers=2, num_kv_heads=1, head_dim=16, dtype="float16"),
        AttentionGroupSpec("swa", "sliding", num_layers=2, num_kv_heads=1, head_dim=16,
                           dtype="float16", window=WINDOW),
    )
    st = (StateGroupSpec("kda", "kda", num_layers=2,
                         tensors=(StateTensorSpec("recurrent", (2, 8, 8), "float32"),)),)
    return ModelSpec("offload-sliding", attn, st if state else (),
                     FlopModel(hidden_size=64, num_attention_layers=4, num_recurrent_layers=2),
                     max_model_len=4096)


def engine(state: bool):
    spec = sliding_spec(state)
    m = HybridCacheManager(spec, 1 << 20, CacheConfig(hash_unit=U, admission="interval:8+turn-end"))
    st = ArenaStorage(m.layout, spec)
    host = HostTier(1 << 24)
    return m, st, host, OffloadCoordinator(m, st, [host])


def swa_pattern(m: HybridCacheManager, digest: bytes) -> torch.Tensor:
    return pattern(b"swa" + digest, m.layout.page_payload["swa"])


def serve_all(m, st, rid, tokens, coordinator=None) -> int:
    """One request computed in one step past its hit: full pages, sliding pages and save
    points written with their digests' patterns; returns the hit (tokens)."""
    m.add_request(rid, tokens)
    if coordinator is not None:
        coordinator.prefetch(rid)
    hit = m.match(rid).hit_tokens
    a = m.allocate(rid, len(tokens) - hit)
    digests = m.requests[rid].hasher.digests
    for name, make in (("full", lambda d: kv_pattern(m, d, 0)), ("swa", lambda d: swa_pattern(m, d))):
        for i, page in enumerate(a.block_table[name]):
            if hit // U <= i < len(digests) and page >= 0:
                st.page_bytes_view(page)[: m.layout.page_payload[name]].copy_(make(digests[i]))
    for sp in a.save_points:
        st.slot_bytes_view(sp.slot)[: snap_span(m)].copy_(snap_pattern(m, digests[sp.boundary // U - 1]))
    m.commit(rid, len(tokens))
    m.free(rid, finished=True)
    return hit


def assert_windows_hold(m, st, digests, end: int) -> None:
    """The sliding pages of the window before ``end`` are cached with their patterns."""
    cache = m.coordinator.caches[0]
    for u in range(cache.first_needed(end), end):
        entry = cache.entries[digests[u]]
        got = st.page_bytes_view(entry.pages[0])[: m.layout.page_payload["swa"]]
        assert torch.equal(got, swa_pattern(m, digests[u])), f"sliding page of unit {u}"


def evict_full_kv(m, digests, u: int) -> None:
    """Evict one unit's full KV (its sliding pages go with it), as pressure would."""
    m.index.evict_kv(m.index.nodes[digests[u]])
    assert digests[u] not in m.coordinator.caches[0].entries


@pytest.mark.parametrize("state", [False, True])
def test_sliding_pages_are_never_stored_as_a_units_kv(state):
    m, st, host, coord = engine(state)
    serve_all(m, st, "a", PROMPT, coord)
    m.clear()
    d = digests_of(m, PROMPT)
    met = coord.metrics
    assert met.demote_errors == 0 and met.demoted_kv == 10 and met.demote_skipped_sliding > 0
    for i in range(10):
        e = host.get(coord.keys.kv(None, d[i]))
        assert e is not None and set(e.pieces) == {"kv.full"}, f"unit {i}"
        assert torch.equal(e.pieces["kv.full"], kv_pattern(m, d[i], 0))
    check_arena(m)


def test_a_gap_below_a_device_window_is_loaded_and_hits_exactly():
    """Unit 3's full KV went to the host; units 4..9 (and the window 8, 9) stayed: the
    load fills the gap and the hit reaches unit 10 with every byte the oracle's."""
    m, st, host, coord = engine(False)
    serve_all(m, st, "a", PROMPT, coord)
    d = digests_of(m, PROMPT)
    evict_full_kv(m, d, 3)
    m.add_request("b", PROMPT + [7] * 6)
    assert m.match("b").hit_tokens == 3 * U
    plan = coord.prefetch("b")
    assert plan is not None and plan.kv_units == (3,) and plan.hit_tokens == 10 * U
    assert m.match("b").hit_tokens == 10 * U
    assert_device_holds(m, st, d, 10)
    assert_windows_hold(m, st, d, 10)
    m.allocate("b", 6)
    m.commit("b", 46)
    m.check_invariants()
    m.free("b")
    check_arena(m)


def test_a_gap_inside_the_last_window_is_not_loaded():
    """Unit 8's full and sliding pages are gone: no end past 8 has its window on the device,
    so nothing is loaded (a load would be refused: no wrong hit, but wasted memory)."""
    m, st, host, coord = engine(False)
    serve_all(m, st, "a", PROMPT, coord)
    d = digests_of(m, PROMPT)
    evict_full_kv(m, d, 8)
    m.add_request("b", PROMPT + [7] * 6)
    assert coord.prefetch("b") is None
    assert coord.metrics.loaded_kv == 0 and coord.metrics.prefetch_window_limited == 1
    assert m.match("b").hit_tokens == 8 * U
    m.free("b")
    check_arena(m)


def test_with_state_only_snapshot_ends_with_a_device_window_are_loaded():
    """Snapshots at 2, 4, 6, 8, 10 keep every unit's sliding pages. Unit 4's KV goes to the
    host: end 6 lost its window, 8 and 10 kept theirs, so the load reaches 10. Then unit 8
    goes too: the window of 10 is incomplete, and no end past the device hit (8) is left."""
    m, st, host, coord = engine(True)
    serve_all(m, st, "a", PROMPT, coord)
    d = digests_of(m, PROMPT)
    evict_full_kv(m, d, 4)
    m.add_request("b", PROMPT + [7] * 6)
    assert m.match("b").hit_tokens == 4 * U
    plan = coord.prefetch("b")
    assert plan is not None and plan.kv_units == (4,) and plan.hit_tokens == 10 * U
    assert m.match("b").hit_tokens == 10 * U
    assert_device_holds(m, st, d, 10)
    assert_windows_hold(m, st, d, 10)
    m.free("b")
    m.check_invariants()
    evict_full_kv(m, d, 8)
    m.add_request("c", PROMPT + [7] * 6)
    assert coord.prefetch("c") is None and coord.metrics.loaded_kv == 1
    assert m.match("c").hit_tokens == 8 * U
    m.free("c")
    check_arena(m)


def test_an_import_under_pressure_keeps_the_device_window_it_relies_on():
    """Unit 3's full KV is on the host, the window of end 10 (units 8, 9) on the device
    only, and the arena is full with nothing evictable but that window. The import may not
    evict the window for the gap's page (the load would be wasted and the window lost for
    good): nothing loads. Once memory frees, the load fills the gap and hits unit 10 with
    every byte the oracle's."""
    m, st, host, coord = engine(False)
    serve_all(m, st, "a", PROMPT, coord)
    d = digests_of(m, PROMPT)
    evict_full_kv(m, d, 3)
    cache = m.coordinator.caches[0]
    for u in range(8):  # only the window of end 10 is left evictable
        if d[u] in cache.entries:
            cache.evict(cache.entries[d[u]])
    pressure = []
    while (p := m.arena.alloc_page()) is not None:
        pressure.append(p)
    m.add_request("b", PROMPT + [7] * 6)
    assert coord.prefetch("b") is None
    assert coord.metrics.loaded_kv == 0 and coord.metrics.load_discarded == 0
    assert_windows_hold(m, st, d, 10)  # the import released its holds: evictable again
    assert all(cache.entries[d[u]].ref == 0 for u in (8, 9))
    for p in pressure:
        m.arena.free_page(p)
    m.free("b")
    m.add_request("c", PROMPT + [7] * 6)
    plan = coord.prefetch("c")
    assert plan is not None and plan.kv_units == (3,) and plan.hit_tokens == 10 * U
    assert m.match("c").hit_tokens == 10 * U
    assert_device_holds(m, st, d, 10)
    assert_windows_hold(m, st, d, 10)
    m.free("c")
    m.check_invariants()
    check_arena(m)
