"""Count, then take: whether an allocation can be served, decided before anything changes.

vLLM's ``KVCacheManager`` asks ``get_num_blocks_to_allocate`` before it allocates; this
module is that question for an arena where KV pages and state slots share blocks. An
allocation that cannot be served must change nothing: no entry evicted (and so no tier
demotion), no hit held and released again (which would refresh its recency), no counter
moved. :func:`fits` answers from counters the index and arena keep as they go, so a call is
O(1) unless the answer needs the set of slabs that no request pins (then one pass over the
blocks, only when free blocks and evictable snapshots alone cannot supply the slots).

What the take phase does, and so what is counted (``manager.allocate``): the state slots
first (the running slot, then the draft slots), each with eviction that takes KV only from
slabs holding nothing but evictable pages (a slot needs an empty block); then the pages,
with eviction of anything. Evicting everything evictable is the most either phase can do,
so the supply of each phase is what the arena would hold after that:

- slots, one slot per block (the usual case, state >= one page): free blocks, evictable
  snapshots (the slot is taken over) and unpinned slabs; each slot costs exactly one
  block, which the pages then cannot use;
- slots, several per block (state smaller than a page, so a block is one page): free
  entries of state blocks, evictable snapshots, and ``slots_per_block`` per free block or
  evictable page; each slot costs the pages at most one block (counted so: the answer may
  refuse an allocation that an order-dependent take would just have served, never the
  reverse);
- pages: free entries of KV slabs, evictable pages, and a slab's worth per free block or
  block of evictable snapshots.

The hit that a first allocation would hold is counted as held, and its restored snapshot
as pinned, without holding or pinning them. Where the engine allows it, the step's pending
save points count like evictable snapshots: the take withdraws them before it gives up
(hybridcache.pending_saves).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hybridcache.arena import KV

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.index import PrefixIndex, UnitHandle
    from hybridcache.runs import Hold


class Room:
    """:func:`fits` for one index, with the arena's geometry bound once: the quick answers
    (free blocks alone; free entries and evictable snapshots) cost a few attribute reads,
    and only a step they cannot settle pays for the full count."""

    __slots__ = ("index", "arena", "free_blocks", "ppb", "spb", "num_blocks", "groups")

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.arena = arena = index.arena
        self.free_blocks = arena._free_blocks  # the arena's free-block stack (same list)
        lay = arena.layout
        self.ppb, self.spb, self.num_blocks = lay.pages_per_block, lay.slots_per_block, lay.num_blocks
        self.groups = index.kv_groups + sum(c.groups for c in index.sliding)

    def fits(
        self, page_units: int, slots: int, holds: Sequence[Hold] = (), restore: UnitHandle | None = None,
        slide_hold: Sequence[int] = (), *, take_back: bool = True,
    ) -> bool:
        """See :func:`fits`."""
        pages, ppb = page_units * self.groups, self.ppb
        free = len(self.free_blocks)
        if slots <= free and pages + slots * ppb <= free * ppb:
            return True
        if self.spb <= 1:
            # A quick yes without the KV count (the restored snapshot, if any, counted as
            # pinned whether or not it is already).
            index, arena = self.index, self.arena
            ev = index.snapshots - index.pinned_snapshots - (restore is not None)
            kv_free = (self.num_blocks - free - arena.slots_in_use) * ppb - arena.pages_in_use
            if slots <= free + ev and pages <= kv_free + ppb * (free + ev - slots):
                return True
        return fits(self.index, page_units, slots, holds, restore, slide_hold, take_back=take_back)


def fits(
    index: PrefixIndex,
    page_units: int,
    slots: int,
    holds: Sequence[Hold] = (),
    restore: UnitHandle | None = None,
    slide_hold: Sequence[int] = (),
    *,
    take_back: bool = True,
) -> bool:
    """Whether ``slots`` state slots, then ``page_units`` units of KV pages (one page per
    attention group each, sliding-window groups included), can be allocated with eviction
    once ``holds`` are held, ``restore``'s snapshot is pinned and the evictable
    sliding-window pages ``slide_hold`` (a first allocation's hit window) are held (module
    docstring). Unheld sliding-window pages count as evictable pages (eviction takes them
    last), and a slab is unpinned only if its sliding pages are unheld too. Changes nothing.

    The slots a batching engine's step may take back (:mod:`hybridcache.pending_saves`)
    are counted only when the answer is no without them: counting them walks the live
    requests; ``take_back=False`` never counts them (a step's optional save points, taken
    before its pages, must leave the pages room that needs no save point taken back: the
    latest grant, the step's own, would go first)."""
    if _fits(index, page_units, slots, holds, restore, slide_hold, ()):
        return True
    pend = index.pending_saves
    if pend is None or not take_back:
        return False
    back = pend.slots()
    return bool(back) and _fits(index, page_units, slots, holds, restore, slide_hold, back)


def _fits(
    index: PrefixIndex, page_units: int, slots: int, holds: Sequence[Hold], restore: UnitHandle | None,
    slide_hold: Sequence[int], back: Sequence[int],
) -> bool:
    """:func:`fits` with the slots ``back`` counted as evictable snapshots."""
    arena = index.arena
    lay = arena.layout
    sliding = index.sliding
    pages = page_units * (index.kv_groups + sum(c.groups for c in sliding))
    ppb, spb = lay.pages_per_block, lay.slots_per_block
    free_blocks = len(arena._free_blocks)
    if slots <= free_blocks and pages + slots * ppb <= free_blocks * ppb:
        return True  # the usual step: free blocks alone hold it, no eviction
    ev_snaps = index.snapshots - index.pinned_snapshots
    if restore is not None and restore.snap >= 0 and restore.snap_ref == 0:
        ev_snaps -= 1
    ev_snaps += len(back)
    if spb <= 1:
        # One slot per block: a quick yes from free entries, free blocks and evictable
        # snapshots alone (the usual answer once the cache is full), before KV is counted.
        free_pages = (lay.num_blocks - free_blocks - arena.slots_in_use) * ppb - arena.pages_in_use
        if slots <= free_blocks + ev_snaps and pages <= free_pages + ppb * (free_blocks + ev_snaps - slots):
            return True
    extra_held = 0
    held_units = sum(run.held for run in index._held_runs)  # the live requests' runs
    for run, end in holds:
        if end > run.held:
            extra_held += end - run.held
    ev_pages = (index.kv_units - held_units - extra_held) * index.kv_groups
    if sliding:
        ev_pages += sum(c.evictable_pages for c in sliding) - len(slide_hold)
    if spb > 1:  # small state: a block is one page
        if slots > arena.free_slot_entries + ev_snaps + spb * (free_blocks + ev_pages):
            return False
        if pages <= ev_pages + free_blocks - slots:
            return True
        return pages <= ev_pages + free_blocks + _evictable_state_blocks(index, back) - slots
    if slots:
        supply = free_blocks + ev_snaps
        if slots > supply:
            supply += ev_pages if ppb <= 1 else _unpinned_slabs(index, holds, slide_hold)
            if slots > supply:
                return False
    if not pages:
        return True
    page_supply = arena.free_page_entries + ev_pages + ppb * (free_blocks + ev_snaps - slots)
    return pages <= page_supply


def _unpinned_slabs(index: PrefixIndex, holds: Sequence[Hold], slide_hold: Sequence[int] = ()) -> int:
    """KV slabs whose every page is registered and unheld once ``holds`` and the sliding
    pages ``slide_hold`` are held too."""
    ev = index.evictor
    if ev.pinned_stale:
        ev.find_pinned()
    pinned = set(ev.pinned)
    for run, end in holds:
        for starts, blocks in run.segs:
            pinned.update(blocks[: bisect_left(starts, end)])
    ppb = max(index.arena.layout.pages_per_block, 1)
    pinned.update(p // ppb for p in slide_hold)
    arena, reg = index.arena, index._registered
    used = arena.used_per_block
    return sum(
        1
        for b in range(arena.layout.num_blocks)
        if arena.block_kind(b) == KV and reg[b] == used[b] and b not in pinned
    )


def _evictable_state_blocks(index: PrefixIndex, back: Sequence[int]) -> int:
    """State blocks whose every used slot holds an evictable snapshot or is one of ``back``
    (slots a step may take back; several slots per block): evicting them empties the block
    for pages."""
    arena = index.arena
    spb = arena.layout.slots_per_block
    evictable = [0] * arena.layout.num_blocks
    for node in index.handles.values():
        if node.snap >= 0 and node.snap_ref == 0:
            evictable[node.snap // spb] += 1
    for s in back:
        evictable[s // spb] += 1
    used = arena.used_per_block
    return sum(1 for b, n in enumerate(evictable) if n and n == used[b])
