"""Invariants of the index, the arena and the manager, checked by recounting (SGLang's
``sanity_check``): the stateful tests call them after every step, and an engine may call
:meth:`hybridcache.port.EnginePort.check_invariants` when debugging. Each check raises
``AssertionError`` naming the broken invariant. O(size of the cache): not for hot paths.

The invariants are written at the fields they constrain (``PrefixIndex.__init__``,
``Run.__init__``, ``Arena.__init__``); this module recounts them.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from hybridcache.hashing import hash_function
from hybridcache.runs import block_segments, tokens_chain

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.index import PrefixIndex
    from hybridcache.manager import HybridCacheManager


def check_index(index: PrefixIndex) -> None:
    """Runs, handles, per-block counts and the counters that size allocations."""
    arena = index.arena
    arena.check_invariants()
    ppb = index._ppb
    registered = [0] * arena.layout.num_blocks
    seen: dict[bytes, tuple] = {}
    tenant: dict[object, int] = {}
    pages: list[int] = []
    units = held = 0
    for head, run in index.heads.items():
        n = len(run.digests)
        assert n > 0 and run.digests[0] == head, "a head maps to a run that starts elsewhere"
        assert all(len(p) == n for p in run.pages), "a run's page lists differ in length"
        assert run.held == max(run.holds, default=0) <= n, "held is the deepest hold end"
        assert all(c > 0 for c in run.holds.values()), "hold counts are positive"
        assert max([*run.hits, *run.rel], default=0) <= n, "hit/release ends within the run"
        assert run.segs == [block_segments(p, ppb) for p in run.pages], "block segments of the pages"
        for pos, d in enumerate(run.digests):
            assert d not in seen, "a unit in two runs"
            seen[d] = (run, pos)
        for group in run.pages:
            for p in group:
                registered[p // ppb] += 1
            pages += group
        units += n
        held += run.held
        tenant[run.tenant] = tenant.get(run.tenant, 0) + n * index.node_kv_bytes
    for cache in index.sliding:
        for entry in cache.entries.values():
            for p in entry.pages:
                registered[p // ppb] += 1
    assert len(pages) == len(set(pages)), "a page registered twice"
    assert all(arena._live[1][p] for p in pages), "a registered page is free in the arena"
    assert index._registered == registered, "registered pages per block (full and sliding)"
    assert index._held_runs == {r for r in index.heads.values() if r.held}, "held runs"
    assert index.kv_units == units, "unit counter"
    assert sum(r.held for r in index._held_runs) == held, "held units"
    slots: list[int] = []
    pinned = 0
    for d, node in index.handles.items():
        assert node.digest == d and node.snap_ref >= 0
        if node.run is None:
            assert node.snap >= 0 and d in index.bare, "a handle without KV or snapshot"
        else:
            run, pos = seen[d]
            assert node.run is run and node.depth == run.first + pos, "a handle names the wrong run"
            assert d not in index.bare
        if node.snap >= 0:
            slots.append(node.snap)
            pinned += node.snap_ref > 0
            tenant[node.tenant] = tenant.get(node.tenant, 0) + index.snap_bytes
            # hybridcache.superseded: a snapshot is a member of the cohort that registered it.
            assert node.snap_cohort is None or d in node.snap_cohort[1:], "cohort membership"
    assert set(index.bare) <= set(index.handles)
    assert len(slots) == len(set(slots)), "a slot registered twice"
    assert all(arena._live[2][s] for s in slots), "a registered slot is free in the arena"
    assert index.snapshots == len(slots) and index.pinned_snapshots == pinned, "snapshot counters"
    assert 0 <= index.floor_evictions <= index.evictions["state"], "floor evictions are state evictions"
    for cache in index.sliding:  # sliding entries count for the tenant that registered them
        for e in cache.entries.values():
            tenant[e.tenant] = tenant.get(e.tenant, 0) + cache.entry_bytes
    have = {t: b for t, b in index.tenant_bytes.items() if b}
    assert have == {t: b for t, b in tenant.items() if b}, "bytes per tenant"
    sliding_pages: list[int] = []
    for cache in index.sliding:
        cache.check_invariants()
        sliding_pages += [p for e in cache.entries.values() for p in e.pages]
    assert not set(sliding_pages) & set(pages), "a page cached as full and sliding KV"
    _check_branches(index)


def _check_branches(index: PrefixIndex) -> None:
    """``branches`` counts, per unit, the runs whose head follows it (the stranded-KV rule
    reads it); ``_branch_of`` names that unit for each such head, and only live heads."""
    assert set(index._branch_of) <= set(index.heads), "a branch counted for a head that is gone"
    assert index.branches == Counter(index._branch_of.values()), "runs branching off a unit"


def check_manager(m: HybridCacheManager, engine_pages: int = 0, engine_slots: int = 0) -> None:
    """The index's invariants, and every page and slot in use is owned exactly once: by a
    cached entry, by one live request, or by the engine (``engine_pages`` reserved,
    ``engine_slots`` taken over; see :class:`~hybridcache.port.EnginePort`)."""
    index = m.index
    check_index(index)
    if index.seen is not None:
        index.seen.sanity_check()
    fn, ub = hash_function(m.config.hash_algo), m.unit * 4
    assert all(tokens_chain(r, fn, ub) for r in index.heads.values()), "a run's tokens are not its units'"
    pages = [p for run in index.heads.values() for g in run.pages for p in g]
    slots = [n.snap for n in index.handles.values() if n.snap >= 0]
    refs: dict[int, int] = {}  # id(sliding entry) -> live requests holding it
    for cache in index.sliding:
        pages += [p for e in cache.entries.values() for p in e.pages]
    for req in m.requests.values():
        for cache, track in zip(index.sliding, req.slide):
            pages += track.private_pages()
            for u, e in track.held.items():
                assert cache.entries.get(e.digest) is e, "a request holds an evicted sliding entry"
                assert track.lo <= u and all(t[u] == p for t, p in zip(track.tables, e.pages))
                refs[id(e)] = refs.get(id(e), 0) + 1
            assert all(p == -1 for t in track.tables for p in t[: track.lo]), "a released page kept"
        for t in req.pages:
            pages += t[req.units : req.units_allocated]
            pages += [t[i] for i in req.dup_pages]
        slots += [s for s in (req.slot, req.rolling_slot) if s >= 0]
        if req.pending_rolling is not None:
            slots.append(req.pending_rolling[1])
        slots += req.draft_slots
        slots += req.saves.values()
    for cache in index.sliding:
        assert all(e.ref == refs.get(id(e), 0) for e in cache.entries.values()), "sliding refs"
    assert len(pages) == len(set(pages)), "a page shared"
    assert len(pages) + engine_pages == m.arena.pages_in_use, "a page leaked"
    assert len(slots) == len(set(slots)), "a slot shared"
    assert len(slots) + engine_slots == m.arena.slots_in_use, "a slot leaked"
