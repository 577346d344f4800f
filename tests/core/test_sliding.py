"""Sliding-window groups: the hit rule, the fixed point, the window bound, the one budget."""

from __future__ import annotations

import pytest

from hybridcache.errors import OutOfSpaceError
from hybridcache.manager import CacheConfig, HybridCacheManager
from tests.core.conftest import tiny_spec
from tests.core.fingerprint import fingerprint

U = 4


def _manager(window: int, state: bool = False, pages: int | None = None, admission: str = "last-token"):
    spec = tiny_spec(state=state, window=window, max_len=1 << 16)
    cfg = CacheConfig(hash_unit=U, admission=admission)
    if pages is None:
        return HybridCacheManager(spec, 1 << 22, cfg)
    probe = HybridCacheManager(spec, 1 << 30, cfg)
    blocks = -(-pages // probe.layout.pages_per_block)
    return HybridCacheManager(spec, blocks * probe.layout.block_bytes, cfg)


def _serve(m: HybridCacheManager, rid: str, tokens: list[int]) -> None:
    res = m.add_request(rid, tokens)
    m.allocate(rid, len(tokens) - res.hit_tokens)
    m.commit(rid, len(tokens))
    m.free(rid)


@pytest.mark.parametrize(
    "window,missing,want",
    [
        (9, set(), 10),  # reach 2 = ceil(8 / 4)
        (9, {7}, 10),  # units 8, 9 are the window of end 10; ceil(9 / 4) = 3 would need 7
        (9, {8}, 8),  # end 10 lacks unit 8; end 8 has units 6, 7
        (9, {7, 8}, 7),  # ends 10, 9, 8 lack a unit; end 7 has 5, 6
        (5, {8}, 10),  # reach 1 = ceil(4 / 4): a window of 5 tokens reads one unit back
        (5, {9}, 9),
        (14, {0}, 10),  # reach 4: units 6..9
        (14, {6}, 6),  # units 2..5 (ends 10, 9, 8, 7 all read unit 6)
        (14, {3, 6}, 3),  # end 6 lacks unit 3; end 3 reads all of [0, 3), cut at the start
    ],
)
def test_window_rule(window, missing, want):
    """A hit end ``e`` needs the units ``[e - ceil((window - 1) / unit), e)`` (the exact
    token rule): dropping a unit's sliding pages removes exactly the ends that read it."""
    m = _manager(window)
    tokens = list(range(41))
    _serve(m, "a", tokens)
    cache = m.coordinator.caches[0]
    m.add_request("probe", tokens + [1])
    digests = m.requests["probe"].hasher.digests
    assert len(cache.entries) == 10  # stateless: every registered unit stays cached
    for u in missing:
        cache.evict(cache.entries[digests[u]])
    m.free("probe")
    assert m.add_request("b", tokens + [1]).hit_tokens == want * U
    m.check_invariants()


def test_fixed_point_with_snapshots():
    """With state, a hit needs a snapshot at its end and the window before it: the
    coordinator lowers the length until the snapshot and the window cache agree."""
    m = _manager(9, state=True, admission="interval:16+last-token")
    tokens = list(range(37))
    _serve(m, "a", tokens)
    cache = m.coordinator.caches[0]
    m.add_request("p", tokens)
    digests = m.requests["p"].hasher.digests
    # Snapshots at units 4, 8, 9 keep the windows [2, 4), [6, 8), [7, 9); the rest was
    # evicted when the request moved on (no hit could read it).
    assert sorted(e.depth for e in cache.entries.values()) == [2, 3, 6, 7, 8]
    assert m.match("p").hit_tokens == 36
    m.free("p")
    cache.evict(cache.entries[digests[8]])
    assert m.add_request("q", tokens).hit_tokens == 32  # end 9 lacks unit 8
    m.free("q")
    cache.evict(cache.entries[digests[7]])
    # End 8 lacks unit 7 too; the window search stops at end 4 and the snapshot there serves.
    assert m.add_request("r", tokens).hit_tokens == 16
    m.check_invariants()


def test_long_request_holds_only_its_window():
    """A request far longer than the arena could hold with every sliding page kept runs
    to the end: pages older than its window are released as it advances, and eviction takes
    them, while its full-attention pages stay."""
    window, pages = 16, 96
    m = _manager(window, pages=pages)
    reach = -(-(window - 1) // U)
    n_units = pages - reach - 4  # full pages + the window + one step: fits only if released
    assert 2 * n_units > m.layout.num_pages
    m.add_request("long", list(range(n_units * U)))
    done = 0
    while done < n_units * U:
        a = m.allocate("long", min(8, n_units * U - done))
        done += a.num_tokens
        m.commit("long", done)
        track = m.requests["long"].slide[0]
        live = sum(1 for p in track.tables[0] if p >= 0)
        assert live <= reach + 2, "more sliding pages kept than the window and the step"
        m.check_invariants()
    assert m.coordinator.caches[0].evictions > 0  # old windows were taken back
    m.free("long")
    m.check_invariants()


def test_refused_allocate_with_a_sliding_group_changes_nothing():
    """A first allocation whose hit window would be held and that asks for more than
    evicting everything gives: every observable and internal count is left as it was."""
    m = _manager(9, state=True, pages=64, admission="last-token+turn-end")
    for k in range(4):
        _serve(m, f"w{k}", list(range(100 * k, 100 * k + 21)))
    assert m.coordinator.evictable_pages
    m.add_request("run", list(range(5000, 5013)))
    m.allocate("run", 13)
    m.add_request("big", list(range(300, 321)) + list(range(9000, 9000 + m.layout.num_pages * U)))
    assert m.match("big").hit_tokens > 0  # its hit would hold sliding pages
    before = fingerprint(m)
    with pytest.raises(OutOfSpaceError):
        m.allocate("big", m.layout.num_pages * U)
    assert fingerprint(m) == before
    m.check_invariants()


def test_evicting_a_snapshot_evicts_the_window_only_it_read():
    """Snapshots at units 4, 8, 9 keep the windows [2, 4), [6, 8), [7, 9). Once the one
    at 8 goes, unit 6 serves no hit end (7 has no snapshot) and goes with it; unit 7 still
    serves end 9 and stays."""
    m = _manager(9, state=True, admission="interval:16+last-token")
    tokens = list(range(37))
    _serve(m, "a", tokens)
    cache = m.coordinator.caches[0]
    m.add_request("p", tokens)
    digests = m.requests["p"].hasher.digests
    m.free("p")
    assert sorted(e.depth for e in cache.entries.values()) == [2, 3, 6, 7, 8]
    m.index.evict_snapshot(m.index.handles[digests[7]])
    assert sorted(e.depth for e in cache.entries.values()) == [2, 3, 7, 8]
    m.check_invariants()
    assert m.add_request("q", tokens).hit_tokens == 36


@pytest.mark.parametrize("extra_blocks", range(0, 6))
def test_slot_count_with_a_held_window_agrees_with_the_take(extra_blocks):
    """No free block and no evictable snapshot: a first allocation's slot can only come
    from emptying a slab, and the slabs holding its hit's window do not count (the hit
    would pin them). At every arena size the count either refuses with nothing changed, or
    says yes and the take succeeds."""
    probe = _manager(9, state=True)
    lay = probe.layout
    assert lay.pages_per_block > 1  # slots need a whole empty block
    spec = tiny_spec(state=True, window=9, max_len=1 << 16)
    cfg = CacheConfig(hash_unit=U, admission="last-token")
    m = HybridCacheManager(spec, (3 + extra_blocks) * lay.block_bytes, cfg)
    _serve(m, "a", list(range(21)))  # a snapshot at 20 and the window [3, 5) before it
    # A running request takes every free block (its pages stay private: not evictable).
    m.add_request("fill", list(range(5000, 5001 + 4 * lay.pages_per_block * (1 + extra_blocks))))
    while m.arena._free_blocks:
        try:
            m.allocate("fill", U)
        except OutOfSpaceError:
            break
        m.commit("fill", m.requests["fill"].num_allocated)
    m.add_request("c", list(range(21)) + [900, 901, 902])  # one unit past the hit
    before = fingerprint(m)
    try:
        a = m.allocate("c", 4)
    except OutOfSpaceError:
        assert fingerprint(m) == before
    else:
        assert a.hit_tokens == 20
    m.check_invariants()


def test_port_shows_sliding_groups_and_events():
    """Through the engine port: the sliding group is an attention group with its block
    table (``-1`` below the window), and its pages come out of the event stream with kind
    ``"sliding"`` (never ``"kv"``, which a tier would store as a unit's KV)."""
    from hybridcache.events import REMOVED, STORED
    from hybridcache.port import EnginePort
    from hybridcache.sliding import SLIDING

    m = _manager(9)
    port = EnginePort(m)
    assert port.attention_groups == ("attn", "swa")
    m.add_request("a", list(range(40)))
    a = m.allocate("a", 40)
    m.commit("a", 40)
    tables = port.block_tables("a")
    assert tables["attn"] == a.block_table["attn"]
    assert tables["swa"][:8] == [-1] * 8 and tables["swa"][8:] == a.block_table["swa"][8:]
    events = port.take_events()
    kv = [e for e in events if e.kind == "kv"]
    slide = [e for e in events if e.kind == SLIDING]
    assert all(e.groups == ("attn",) for e in kv) and sum(len(e.digests) for e in kv) == 10
    assert [e.depth for e in slide if e.action == STORED] == list(range(10))
    assert all(e.groups == ("swa",) for e in slide)
    m.free("a")
    port.clear()
    removed = [e for e in port.take_events() if e.action == REMOVED]
    assert sorted(e.depth for e in removed if e.kind == SLIDING) == list(range(10))


def test_one_token_window_caches_no_sliding_pages():
    """A layer that reads only its own token needs no older KV: nothing is kept, and every
    full-KV length is a hit."""
    m = _manager(1)
    _serve(m, "a", list(range(41)))
    assert not m.coordinator.caches[0].entries
    assert m.add_request("b", list(range(41))).hit_tokens == 40
    m.check_invariants()
