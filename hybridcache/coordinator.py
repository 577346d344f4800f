"""The coordinator of attention-group caches: one hit length that every group can serve.

A model's groups are served by one cache each kind: full attention (and MLA) by the prefix
index's runs (:mod:`hybridcache.index`, :mod:`hybridcache.runs`), recurrent state by its
snapshots, and every distinct sliding window by a :class:`~hybridcache.sliding.SlidingWindowCache`.
A hit of ``L`` units needs full KV for units ``[0, L)``, the sliding pages of each window
cache for its units ``[L - reach, L)`` only, and (with state groups) a snapshot at ``L``.

Each cache answers "the longest hit at most ``L`` that I can serve"; the answers are not
prefix-closed for sliding windows and snapshots, so, as vLLM's
``HybridKVCacheCoordinator.find_longest_cache_hit``, the coordinator lowers ``L`` to each
cache's answer in turn until none lowers it (a fixed point: every answer is at most its
input, so it ends, and the end is the longest length all of them accept).

A model with only full-attention / MLA groups (plus state groups) has no coordinator: the
manager's fast path is the index alone, exactly as before sliding windows existed.

This module also keeps a running request's sliding pages: its window held, and everything
older released as the request advances (:meth:`GroupCoordinator.advance`), so that a long
request's sliding pages in use are bounded by its window (plus the step being computed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from hybridcache.metrics import SlidingMetrics
from hybridcache.sliding import SlidingUnit, SlidingWindowCache
from hybridcache.spec import AttentionKind

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.index import PrefixIndex, UnitHandle
    from hybridcache.requests import Request
    from hybridcache.spec import ModelSpec


def build_coordinator(spec: ModelSpec, index: PrefixIndex, unit: int) -> GroupCoordinator | None:
    """The coordinator for ``spec``'s sliding-window groups, one cache per distinct window
    (attached to ``index``); ``None`` when the model has none (the fast path)."""
    windows: dict[int, list[str]] = {}
    for g in spec.attention_groups:
        if g.kind is AttentionKind.SLIDING:
            windows.setdefault(g.window, []).append(g.name)  # type: ignore[arg-type]
    if not windows:
        return None
    caches = [SlidingWindowCache(names, w, unit, index) for w, names in windows.items()]
    index.sliding.extend(caches)
    return GroupCoordinator(index, caches, unit, spec.has_state)


class SlideTrack:
    """A request's pages in one sliding-window cache.

    ``tables[g][u]`` is the page of unit ``u`` in group ``g`` (``-1``: released, below
    ``lo``, vLLM's null block). Units in ``held`` are cached entries the request holds
    (its hit window, and units it registered); the other units in ``[lo, len)`` are its
    private pages. ``done``: units below it were offered to the cache at a commit.
    """

    __slots__ = ("tables", "held", "lo", "done")

    def __init__(self, groups: int) -> None:
        self.tables: list[list[int]] = [[] for _ in range(groups)]
        self.held: dict[int, SlidingUnit] = {}
        self.lo = 0
        self.done = 0

    def private_pages(self) -> list[int]:
        """The pages the request owns (not cached)."""
        held = self.held
        return [
            p for t in self.tables for u, p in enumerate(t[self.lo :], self.lo) if u not in held and p >= 0
        ]


class GroupCoordinator:
    """Hit lengths across groups, and the sliding-window pages of running requests.

    Args:
        index: the full-attention cache and snapshots (its evictor allocates pages).
        caches: one sliding-window cache per distinct window.
        unit: tokens per hash unit.
        has_state: the model has state groups (a hit needs a snapshot at its end).
    """

    def __init__(
        self, index: PrefixIndex, caches: Sequence[SlidingWindowCache], unit: int, has_state: bool
    ) -> None:
        self.index = index
        self.caches = tuple(caches)
        self.unit = unit
        self.has_state = has_state
        self.names = tuple(n for c in self.caches for n in c.names)
        self.groups = len(self.names)
        #: Sliding pages running requests let go of because their window moved past them.
        self.released_pages = 0
        #: First allocations whose hit was shorter than full KV (and a snapshot) allowed
        #: because a window cache lacked a unit, and the tokens they lost that way.
        self.window_limited_requests = 0
        self.window_limited_tokens = 0

    def set_quota(self, quota: Callable[[str | None], int | None]) -> None:
        """Charge sliding entries to tenant quotas (``quota(tenant)``: bytes, ``None``:
        unlimited): a registration past the quota is refused, as a run's units are."""
        for c in self.caches:
            c.quota = quota

    def metrics(self) -> SlidingMetrics:
        """The sliding-window counters and occupancy, now."""
        caches = self.caches
        return SlidingMetrics(
            sliding_pages_cached=sum(len(c.entries) * c.groups for c in caches),
            sliding_pages_held=sum(len(c.held) * c.groups for c in caches),
            sliding_pages_released_by_window=self.released_pages,
            sliding_evictions=sum(c.evictions for c in caches),
            sliding_quota_rejections=sum(c.quota_rejections for c in caches),
            window_limited_requests=self.window_limited_requests,
            window_limited_tokens=self.window_limited_tokens,
        )

    # ------------------------------------------------------------------ the hit
    def longest_hit(self, digests: Sequence[bytes], kv_units: int) -> tuple[int, UnitHandle | None]:
        """``(units, snapshot)``: the longest hit of at most ``kv_units`` units (full KV is
        prefix-closed: every shorter length has it) that has a snapshot at its end (models
        with state) and every window cache's window before it; the fixed point above."""
        end, node = kv_units, None
        deepest = self.index.deepest_snapshot
        while True:
            if self.has_state:
                end, node = deepest(digests, end)
            e = end
            for c in self.caches:
                e = c.longest_end(digests, e)
            if e == end:
                return end, node
            end = e

    def unheld_hit_pages(self, digests: Sequence[bytes], units: int) -> list[int]:
        """The evictable pages that holding a hit of ``units`` would pin (count, then take)."""
        out: list[int] = []
        for c in self.caches:
            entries = c.entries
            for u in range(c.first_needed(units), units):
                entry = entries[digests[u]]
                if not entry.ref:
                    out += entry.pages
        return out

    @property
    def evictable_pages(self) -> int:
        return sum(c.evictable_pages for c in self.caches)

    def window_tables(self, digests: Sequence[bytes], units: int) -> dict[str, list[int]] | None:
        """The sliding groups' block tables a hit of ``units`` reads (``-1`` below each
        window, as a request's tables), or ``None`` if a window cache lacks a unit of it."""
        out: dict[str, list[int]] = {}
        for c in self.caches:
            lo = c.first_needed(units)
            entries = [c.entries.get(digests[u]) for u in range(lo, units)]
            if any(e is None for e in entries):
                return None
            for g, name in enumerate(c.names):
                out[name] = [-1] * lo + [e.pages[g] for e in entries]  # type: ignore[union-attr]
        return out

    def hold_windows(self, digests: Sequence[bytes], ends: Iterable[int]) -> list[tuple[SlidingWindowCache, SlidingUnit]]:
        """Hold the cached sliding entries of the windows before each of ``ends`` (units;
        missing ones skipped), so that allocations cannot evict them: an import that loads
        a gap below a device window relies on that window. Undo with :meth:`release_windows`."""
        held: list[tuple[SlidingWindowCache, SlidingUnit]] = []
        for c in self.caches:
            units: set[int] = set()
            for e in ends:
                units.update(range(c.first_needed(e), min(e, len(digests))))
            for u in sorted(units):
                entry = c.entries.get(digests[u])
                if entry is not None:
                    c.hold(entry)
                    held.append((c, entry))
        return held

    @staticmethod
    def release_windows(held: Sequence[tuple[SlidingWindowCache, SlidingUnit]]) -> None:
        """Release holds taken by :meth:`hold_windows` (the entries become evictable)."""
        for c, entry in held:
            c.release(entry)

    # ------------------------------------------------------------------ a request
    def begin(self, req: Request, units: int) -> None:
        """First allocation: hold the hit's window in every cache."""
        digests = req.hasher.digests
        kv = req.kv_hit_tokens // self.unit
        unlimited = self.index.deepest_snapshot(digests, kv)[0] if self.has_state else kv
        if unlimited > units:  # full KV (and a snapshot) reached further: a window was missing
            self.window_limited_requests += 1
            self.window_limited_tokens += (unlimited - units) * self.unit
        req.slide = tracks = []
        for c in self.caches:
            tr = SlideTrack(c.groups)
            tr.lo = tr.done = lo = c.first_needed(units)
            tr.tables = [[-1] * lo for _ in range(c.groups)]
            for u in range(lo, units):
                entry = c.entries[digests[u]]
                c.hold(entry)
                tr.held[u] = entry
                for t, p in zip(tr.tables, entry.pages):
                    t.append(p)
            tracks.append(tr)

    def alloc_pages(self, units: int, undo: list[int]) -> list[list[list[int]]] | None:
        """``units`` new pages per group of every cache, evicting as needed (each page goes
        to ``undo`` as taken); ``None`` when memory ran out."""
        alloc = self.index.alloc_pages
        out: list[list[list[int]]] = []
        for c in self.caches:
            per_group = []
            for _ in range(c.groups):
                pages = alloc(units)
                undo.extend(pages)
                if len(pages) < units:
                    return None
                per_group.append(pages)
            out.append(per_group)
        return out

    def extend(self, req: Request, new: list[list[list[int]]]) -> None:
        for tr, per_group in zip(req.slide, new):
            for t, pages in zip(tr.tables, per_group):
                t += pages

    def tables(self, req: Request) -> dict[str, list[int]]:
        """The request's block tables of the sliding groups (copies; ``-1``: released)."""
        return {n: list(t) for tr, c in zip(req.slide, self.caches) for n, t in zip(c.names, tr.tables)}

    def advance(self, req: Request, computed: int) -> None:
        """After a commit: cache the units the request registered (full KV) and release
        what its next token no longer reads (tokens before ``computed - window + 1``)."""
        digests, tenant = req.hasher.digests, req.tenant
        for c, tr in zip(self.caches, req.slide):
            held = tr.held
            new_lo = max((computed - c.window + 1) // self.unit, 0)
            start = max(tr.done, tr.lo)
            if new_lo > tr.lo:  # units in [start, new_lo) are registered as they are released
                self.released_pages += (new_lo - tr.lo) * c.groups
                self._release(c, tr, req, tr.lo, new_lo, start, req.units)
                tr.lo = new_lo
            for u in range(max(start, new_lo), req.units):  # registered, still in the window
                if u not in held:
                    entry = c.register(digests[u], u, tenant, tuple(t[u] for t in tr.tables))
                    if entry is not None:
                        held[u] = entry
            tr.done = max(tr.done, req.units)

    def trim(self, req: Request, keep_units: int) -> None:
        """Speculative decoding rolled back: free private pages past ``keep_units``."""
        free_page = self.index.arena.free_page
        for tr in req.slide:
            for t in tr.tables:
                for p in t[keep_units:]:
                    free_page(p)
                del t[keep_units:]

    def free(self, req: Request) -> None:
        """The request ends: release every held entry, free every private page."""
        for c, tr in zip(self.caches, req.slide):
            self._release(c, tr, req, tr.lo, len(tr.tables[0]) if tr.tables else 0)
        req.slide = []

    def rollback(self, req: Request) -> None:  # pragma: no cover - the count rules it out
        for c, tr in zip(self.caches, req.slide):
            for entry in tr.held.values():
                c.release(entry)
        req.slide = []

    def _release(
        self, c: SlidingWindowCache, tr: SlideTrack, req: Request, lo: int, hi: int,
        reg_lo: int = 0, reg_hi: int = 0,
    ) -> None:
        """Let go of units ``[lo, hi)``: private pages are freed, except those of units in
        ``[reg_lo, reg_hi)`` (registered in full attention by this commit), which are cached
        unheld as held entries are; held entries stay cached (evictable) if a hit can
        still use them, else are evicted now.

        Without state every unit boundary with full KV is a possible hit end, so every
        released entry stays. With state a hit end needs a snapshot, so an entry stays
        only if a snapshot end (cached, or the request's turn end still to be registered)
        lies within ``reach`` units after it: caching the rest would only make eviction
        find them later.
        """
        free_page = self.index.arena.free_page
        if not c.reach:  # a window of one token: no hit reads an older unit
            keep: list[bool] | None = [False] * (hi - lo)
        else:
            keep = self._snapshot_reach(c, req, lo, hi) if self.has_state else None
        held, digests = tr.held, req.hasher.digests
        for u in range(lo, hi):
            entry = held.pop(u, None)
            if entry is None:
                if reg_lo <= u < reg_hi and (keep is None or keep[u - lo]):
                    pages = tuple(t[u] for t in tr.tables)
                    if c.register(digests[u], u, req.tenant, pages, held=False) is not None:
                        for t in tr.tables:
                            t[u] = -1
                        continue  # the pages are the cache's now
                for t in tr.tables:
                    p = t[u]
                    if p >= 0:
                        free_page(p)
            else:
                c.release(entry)
                if keep is not None and not keep[u - lo] and not entry.ref:
                    c.evict(entry)
            for t in tr.tables:
                t[u] = -1

    def _snapshot_reach(self, c: SlidingWindowCache, req: Request, lo: int, hi: int) -> list[bool]:
        """For each unit in ``[lo, hi)``: whether a snapshot end ``e`` with
        ``e - reach <= u < e`` exists on the request's path (one sweep from the right)."""
        digests, handles, unit = req.hasher.digests, self.index.handles, self.unit
        top = min(hi + c.reach, len(digests))
        rb = req.rolling_boundary
        out = [False] * (hi - lo)
        nearest = -1  # the lowest snapshot end above the unit being looked at
        for e in range(top, lo, -1):
            node = handles.get(digests[e - 1])
            if (node is not None and node.snap >= 0) or e * unit == rb:
                nearest = e
            u = e - 1
            if u < hi and nearest > u and nearest - c.reach <= u:
                out[u - lo] = True
        return out
