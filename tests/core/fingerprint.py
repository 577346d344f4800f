"""Everything a refused call must leave as it was, as one comparable value.

Observable (``stats()``, metrics, arena occupancy, request ids) and internal (every field
of every live request, the index's dicts and counters, per-block free lists): a refused
call that changed any of them broke the promise that bad input changes nothing.
"""

from __future__ import annotations

import dataclasses

from hybridcache.hashing import TokenHasher
from hybridcache.index import Node
from hybridcache.manager import HybridCacheManager
from hybridcache.requests import Request

#: Request fields left out: ``walk`` is a cache of the last index walk (recomputed on
#: demand, not state).
_SKIP = {"walk"}


def _freeze(v: object) -> object:
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((repr(k), _freeze(x)) for k, x in v.items()))
    if isinstance(v, set):
        return tuple(sorted(repr(x) for x in v))
    if isinstance(v, TokenHasher):
        return (v.root, tuple(v.digests), v._tail, v.num_tokens, v.unit)
    if isinstance(v, Node):
        return (id(v), v.snap, v.snap_ref, v.snap_hits, v.depth)
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return _freeze(dataclasses.asdict(v))
    if isinstance(v, (int, float, str, bytes, bool)) or v is None:
        return v
    slots = getattr(type(v), "__slots__", None)
    if slots == ("tables", "held", "lo", "done"):  # a request's sliding-window pages
        return (_freeze(v.tables), _freeze({u: e.digest for u, e in v.held.items()}), v.lo, v.done)
    return id(v)  # a run: identity (its contents are in the index part)


def fingerprint(m: HybridCacheManager) -> tuple:
    idx, arena = m.index, m.arena
    requests = tuple(
        (repr(rid), tuple((s, _freeze(getattr(r, s))) for s in Request.__slots__ if s not in _SKIP))
        for rid, r in m.requests.items()
    )
    runs = tuple(
        (id(run), _freeze([getattr(run, s) for s in type(run).__slots__ if s != "fork"]))
        for run in idx.heads.values()
    )
    blocks = (
        tuple(arena._kind), tuple(arena.used_per_block), tuple(arena._free_blocks),
        bytes(arena._live[1]), bytes(arena._live[2]),
    )
    sliding = tuple(
        (c.evictions, tuple(sorted((d, e.depth, e.pages, e.ref) for d, e in c.entries.items())), tuple(c.lru))
        for c in idx.sliding
    )
    return (
        sliding,
        _freeze(m.stats()),
        _freeze(dataclasses.asdict(m.sync_metrics())),
        _freeze(arena.stats()),
        arena.pages_in_use,
        arena.slots_in_use,
        blocks,
        requests,
        runs,
        len(idx.handles),
        len(idx.bare),
        _freeze(idx.tenant_bytes),
        _freeze(idx.evictions),
        _freeze(idx.evicted_bytes),
        idx.version,
        m.tick,
        _freeze(m._seen),
    )
