"""Choosing victims and allocating under memory pressure, for :class:`~hybridcache.index.PrefixIndex`.

Eviction frees entries until the arena can allocate what is asked. KV pages are evicted in
whole units. A *state slot* needs an empty block, so while one is needed the KV victims are
taken, in rank order, only from slabs that no running request pins (every page in them is
evictable): evicting a page of a pinned slab would destroy a cached entry without bringing a
free block closer. Victims are still single entries of the lowest rank, never whole slabs:
slab mates can be the most valuable entries in the cache (measured: evicting the victim's
whole slab cost up to half the hit rate at small budgets). Pinned-slab entries are set aside
once per allocation (or per :meth:`EvictingAllocator.slot_batch`), not rescanned per victim;
when the victim is a snapshot, the slot allocation takes its slot over.

A slab is unpinned when all its pages are registered (no request's private page: the
index's per-block registered count equals the arena's used count) and none lies in a held
run prefix. The pinned blocks are worked out from the held runs' block segments only when a
slot allocation asks and the holds changed since: holds change on every request, slot
allocations that may take KV are rarer, so no per-block count moves on a hold or release.

The mixin keeps only that cache: it works on the index's queues, arena and counts.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hybridcache.policy import marconi_ranking

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.index import Node
    from hybridcache.runs import PagesPred


class SlotBatch:
    """:meth:`EvictingAllocator.slot_batch` as a plain context object (no generator per use)."""

    __slots__ = ("index", "depth")

    def __init__(self, index: EvictingAllocator) -> None:
        self.index = index
        self.depth = 0

    def __enter__(self) -> None:
        if not self.depth:
            self.index._aside = []
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1
        if not self.depth:
            index = self.index
            aside, index._aside = index._aside, None
            if aside:
                index.kv_q.put_back(aside)


class EvictingAllocator:
    """Victim choice and allocation with eviction, mixed into the prefix index."""

    # Provided by the index (see PrefixIndex.__init__).
    arena: Any
    eviction: str
    kv_q: Any
    snap_q: Any
    marconi_alpha: float
    marconi_window: int
    _marconi_ranked: list
    _registered: list[int]
    _held_runs: set
    _pinned: set[int]
    _pinned_stale: bool
    _ppb: int
    _aside: list | None
    _batch: SlotBatch
    evict_kv: Callable[[Node], None]
    evict_snapshot: Callable[..., int]

    def _init_eviction(self) -> None:
        """Settings read on every victim choice, fixed once the index is built."""
        self._marconi = self.eviction == "marconi"
        # A slot needs an empty block: with several pages per block, only KV in slabs
        # that no request pins can help (see alloc_slot).
        self._slot_pred = self._in_unpinned_slab if self.arena.layout.pages_per_block > 1 else None

    def _marconi_next(self, pred: PagesPred | None) -> tuple[str, Node] | None:
        """Next entry of the cached Marconi ranking that is still evictable (and, for KV,
        satisfies ``pred``), re-ranking once when the ranking is used up. Entries skipped
        for ``pred`` keep their place at the low end of the ranking."""
        for attempt in range(2):
            ranking, skipped, found = self._marconi_ranked, [], None
            while ranking:
                kind, node = ranking.pop()
                q = self.kv_q if kind == "kv" else self.snap_q
                if node not in q.eff:  # type: ignore[attr-defined]
                    continue
                if pred is not None and kind == "kv" and not pred(node.pages):
                    skipped.append((kind, node))
                    continue
                found = (kind, node)
                break
            ranking.extend(reversed(skipped))
            if found is not None or attempt:
                return found
            ranked = marconi_ranking(
                {"kv": self.kv_q, "state": self.snap_q},  # type: ignore[dict-item]
                self.marconi_alpha,
                self.marconi_window,
            )
            self._marconi_ranked = ranked[::-1]  # pop() from the end = lowest utility
        return None

    def _choose(self, pred: PagesPred | None, aside: list) -> tuple[str, Node] | None:
        """The lowest-ranked evictable entry; KV entries must satisfy ``pred`` if given
        (see :meth:`EvictionQueue.first` for ``aside``)."""
        if self._marconi:
            # Marconi ranks a bounded window of candidates: if none of its KV candidates
            # is in an unpinned slab, take its best entry rather than stall.
            got = self._marconi_next(pred)
            return got if got is not None or pred is None else self._marconi_next(None)
        b = self.snap_q.peek()
        top = self.kv_q.peek_priority()
        if top is not None and (b is None or top <= b[0]):
            # Only a KV entry ranked at or below the best snapshot can win; with a
            # predicate, scan for one in an unpinned slab (first() ranks at or above the
            # top). The victim's handle is made only now that KV may win.
            a = self.kv_q.peek() if pred is None else self.kv_q.first(pred, aside)
            if a is not None and (b is None or a[0] <= b[0]):
                return "kv", a[1]  # type: ignore[return-value]
        return None if b is None else ("state", b[1])  # type: ignore[return-value]

    def _in_unpinned_slab(self, pages: tuple[int, ...]) -> bool:
        """Evicting a KV unit with these pages brings a free block closer: one of its slabs
        holds only evictable pages (no running request's page, cached or private)."""
        if self._pinned_stale:
            self._find_pinned()
        pinned, reg, used, ppb = self._pinned, self._registered, self.arena.used_per_block, self._ppb
        for p in pages:
            b = p // ppb
            if reg[b] == used[b] and b not in pinned:  # no private page, no held one
                return True
        return False

    def _find_pinned(self) -> None:
        """The blocks that hold a page of a held run prefix (worked out once per change of
        the holds that a slot allocation sees: a few runs, one step per block segment)."""
        pinned: set[int] = set()
        for run in self._held_runs:
            held = run.held
            for starts, blocks in run.segs:
                pinned.update(blocks[: bisect_left(starts, held)])
        self._pinned = pinned
        self._pinned_stale = False

    def evict_one(self) -> bool:
        """Evict the lowest-ranked entry of either kind (what freeing a page needs); returns
        False when nothing is evictable."""
        choice = self._choose(None, [])  # no predicate: nothing is set aside
        if choice is None:
            return False
        self._drop(*choice, keep_slot=False)
        return True

    def _drop(self, kind: str, node: Node, keep_slot: bool) -> int:
        """Evict a chosen victim; returns its slot when ``keep_slot`` and it is a snapshot
        (handed over to the caller, not freed), else -1."""
        if kind == "state":
            self.snap_q.evicted(node)  # a GreedyDual victim ages the clock
            return self.evict_snapshot(node, keep_slot)
        self.kv_q.evicted(node)
        self.evict_kv(node)
        return -1

    def alloc_page(self) -> int | None:
        """A page, evicting as needed; ``None`` when nothing more can be evicted."""
        got = self.alloc_pages(1)
        return got[0] if got else None

    def alloc_pages(self, n: int) -> list[int]:
        """``n`` pages, evicting as needed; fewer when nothing more can be evicted."""
        out = self.arena.alloc_pages(n)
        while len(out) < n:
            if not self.evict_one():
                break
            out += self.arena.alloc_pages(n - len(out))
        return out

    def alloc_slot(self) -> int | None:
        """A state slot, evicting as needed; ``None`` when nothing more can be evicted
        (or only KV in slabs that running requests pin, which would free no block).

        A slot needs an empty block: when snapshots are larger than pages, KV victims come
        only from slabs that no request pins. Pinned-slab KV entries are set aside once for
        the whole loop (or the whole slot_batch), not rescanned for every victim.
        """
        s = self.arena.alloc_slot()
        if s is not None:
            return s
        pred = self._slot_pred
        batch = self._aside is not None
        aside: list = self._aside if batch else []  # type: ignore[assignment]
        try:
            arena = self.arena
            while s is None:
                choice = self._choose(pred, aside)
                if choice is None:
                    return None
                got = self._drop(*choice, keep_slot=True)
                if got >= 0:
                    return got  # the evicted snapshot's slot, taken over
                if arena.may_have_slot():
                    s = arena.alloc_slot()
            return s
        finally:
            if aside and not batch:
                self.kv_q.put_back(aside)

    def slot_batch(self) -> SlotBatch:
        """Context: slot allocations inside share one set-aside list: nothing pins or
        unpins a slab in between (no page is allocated or held), so a pinned entry stays
        pinned. Re-entrant; the outermost exit puts the set-aside entries back."""
        return self._batch

    def clear(self) -> int:
        """Evict every evictable entry; returns how many were evicted."""
        n = 0
        while self.evict_one():
            n += 1
        return n
