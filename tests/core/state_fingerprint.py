"""Everything a manager holds, as plain values: two equal fingerprints mean no observable or
internal count moved (stats, metrics, arena, index, eviction queues, requests)."""

from __future__ import annotations

from dataclasses import asdict

from hybridcache.manager import HybridCacheManager


def _key(item: object) -> object:
    """Queue items are handles (or runs): name them by what they are, not their identity."""
    d = getattr(item, "digest", None)
    if d is not None:
        return d
    digests = getattr(item, "digests", None)
    return tuple(digests) if digests is not None else item


def _queue(q: object) -> tuple:
    out: list = [type(q).__name__, len(q)]  # type: ignore[arg-type]
    od = getattr(q, "_od", None)
    if od is not None:
        out.append([(_key(k), v) for k, v in od.items()])
    eff = getattr(q, "eff", None)
    if eff is not None:
        out.append(sorted((_key(k), v) for k, v in eff.items()))
    live = getattr(q, "_live", None)
    if isinstance(live, dict):
        out.append(sorted((_key(k), tuple(v)) for k, v in live.items()))
    heap = getattr(q, "_heap", None)
    if heap is not None:
        out.append(sorted(tuple(_key(x) for x in e) for e in heap))
    clock = getattr(q, "_clock", None)
    if clock is not None:
        out.append(clock.value)
    return tuple(out)


def fingerprint(m: HybridCacheManager) -> dict[str, object]:
    a, index = m.arena, m.index
    runs = sorted(
        (
            run.first, tuple(run.digests), tuple(map(tuple, run.pages)), sorted(run.holds.items()),
            run.held, sorted(run.hits.items()), sorted(run.rel.items()), run.qseq, run.qprio,
        )
        for run in index.heads.values()
    )
    handles = sorted(
        (d, n.depth, n.snap, n.snap_ref, n.snap_hits, n.snap_flops, n.run is None)
        for d, n in index.handles.items()
    )
    reqs = sorted(
        (
            rid, r.allocated, r.counted, r.units, r.units_allocated, tuple(map(tuple, r.pages)),
            r.slot, tuple(r.draft_slots), sorted(r.saves.items()), r.rolling_slot,
            r.num_allocated, r.num_computed, r.hit_tokens, len(r.holds),
            None if r.restore is None else r.restore.digest,
            tuple(
                (tuple(map(tuple, t.tables)), sorted((u, e.digest) for u, e in t.held.items()), t.lo, t.done)
                for t in r.slide
            ),
        )
        for rid, r in m.requests.items()
    )
    sliding = [
        (c.evictions, sorted((d, e.depth, e.pages, e.ref) for d, e in c.entries.items()), list(c.lru))
        for c in index.sliding
    ]
    return {
        "tick": m.tick,
        "metrics": asdict(m.sync_metrics()),
        "stats": m.stats(),
        "arena": (
            list(a._kind), list(a.used_per_block), list(a._free_blocks),
            [list(x) for x in a._entry_free], list(a._fresh), {k: list(v) for k, v in a._open.items()},
            a.pages_in_use, a.slots_in_use, bytes(a._live[1]), bytes(a._live[2]),
        ),
        "index": (
            index.version, dict(index.evictions), dict(index.evicted_bytes),
            sorted(index.tenant_bytes.items(), key=repr), list(index._registered),
            sorted(index.bare),
            *(getattr(index, k, None) for k in ("kv_units", "snapshots", "pinned_snapshots")),
        ),
        "runs": runs,
        "handles": handles,
        "queues": (_queue(index.kv_q), _queue(index.snap_q)),
        "requests": reqs,
        "sliding": sliding,
    }
