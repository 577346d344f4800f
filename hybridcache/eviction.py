"""Choosing victims and allocating under memory pressure, for :class:`~hybridcache.index.PrefixIndex`.

Eviction frees entries until the arena can allocate what is asked. KV pages are evicted in
whole units. A *state slot* needs an empty block, so while one is needed the KV victims are
taken, in rank order, only from slabs that no running request pins (every page in them is
evictable): evicting a page of a pinned slab would destroy a cached entry without bringing a
free block closer. Victims are still single entries of the lowest rank, never whole slabs:
slab mates can be the most valuable entries in the cache (measured: evicting the victim's
whole slab cost up to half the hit rate at small budgets). Pinned-slab entries are set aside
once per allocation (or per :meth:`Evictor.slot_batch`), not rescanned per victim;
when the victim is a snapshot, the slot allocation takes its slot over.

Freeing one state slot takes about a dozen KV units (a snapshot spans that many pages),
mostly successive tails of one run. Where the chooser would take exactly such a stretch one
unit after another, the stretch goes as one range (``_drop_tail_range``): the queue works
out how far the same single choices reach, and the index removes the units at once, with
the same pages freed in the same order and the same ``removed`` events.

Stranded KV (past the last snapshot on its path) ranks at the clock, every such tail alike,
so in a cache full of it equal ranks go in queue order, one unit per run in turn, and each
range stops after one unit. There the victim is read off the KV queue's top without the
chooser's round trip (``_stranded_victim``: the same rules, the same victim).

A slab is unpinned when all its pages are registered (no request's private page: the
index's per-block registered count equals the arena's used count) and none lies in a held
run prefix. The pinned blocks are worked out from the held runs' block segments only when a
slot allocation asks and the holds changed since: holds change on every request, slot
allocations that may take KV are rarer, so no per-block count moves on a hold or release.

The :class:`Evictor` alone chooses victims and allocates with eviction: it holds the policy's
two queues (:mod:`hybridcache.policies`) and its chooser, and the arena they free. The
index keeps the slab counts it maintains at registration and holds (registered pages per
block, held runs) and removes the victims the evictor picks (``evict_kv``,
``evict_snapshot``); the evictor keeps only the pinned-blocks cache.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.arena import Arena
    from hybridcache.index import PrefixIndex, UnitHandle
    from hybridcache.policies import PolicyParts
    from hybridcache.runs import PagesPred, Run


def deepest_unpinned_segment(starts: list[int], blocks: list[int], start: int, held: int,
                             registered: list[int], used: list[int], pinned: set[int]) -> int:
    """The deepest position in ``[held, start]`` whose block segment (``starts``,
    ``blocks``: one group's ``Run.segs``) lies in an unpinned slab: every page of the block
    registered (``registered[b] == used[b]``) and none held (``b not in pinned``); -1: none.

    The units of one segment share their block, so each segment is judged once, at its
    deepest unit, with the test written out: a slot allocation's victim scan
    (``value._deepest``) walks tens of segments per run set aside in a full miniature, and a
    predicate call per segment was a third of its replay."""
    j = bisect_right(starts, start) - 1
    while start >= held and j >= 0:
        b = blocks[j]
        if registered[b] == used[b] and b not in pinned:
            return start
        start = starts[j] - 1  # the deepest unit of the segment before
        j -= 1
    return -1


class SlotBatch:
    """:meth:`Evictor.slot_batch` as a plain context object (no generator per use)."""

    __slots__ = ("evictor", "depth")

    def __init__(self, evictor: Evictor) -> None:
        self.evictor = evictor
        self.depth = 0

    def __enter__(self) -> None:
        if not self.depth:
            self.evictor._aside = []
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1
        if not self.depth:
            ev = self.evictor
            aside, ev._aside = ev._aside, None
            if aside:
                ev.kv_q.put_back(aside)


class LowestFirst:
    """The default victim chooser: the lower of the two queues' tops (priorities of both
    kinds are on one scale)."""

    def __init__(self, kv_q: Any, snap_q: Any) -> None:
        self.kv_q, self.snap_q = kv_q, snap_q

    def choose(self, pred: PagesPred | None, aside: list) -> tuple[str, UnitHandle] | None:
        """The lowest-ranked evictable entry; KV entries must satisfy ``pred`` if given
        (see :meth:`EvictionQueue.first <hybridcache.policy.EvictionQueue.first>` for ``aside``)."""
        b = self.snap_q.peek()
        top = self.kv_q.peek_priority()
        if (top is not None and (b is None or top <= b[0])) or (top is None and pred is not None):
            # Only a KV entry ranked at or below the best snapshot can win; with a
            # predicate, scan for one in an unpinned slab (first() ranks at or above the
            # top). The victim's handle is made only now that KV may win. With no top
            # left, a slot allocation's earlier scans may have set every run aside while
            # their deeper units stay offered: first() still has those.
            a = self.kv_q.peek() if pred is None else self.kv_q.first(pred, aside)
            if a is not None and (b is None or a[0] <= b[0]):
                return "kv", a[1]
        return None if b is None else ("state", b[1])

    def state_victim(self) -> UnitHandle | None:
        """The snapshot :meth:`choose` without a predicate returns next, if its next victim
        is a snapshot (the same comparison: KV wins ties), without making a KV handle;
        ``None`` when it would take KV or nothing."""
        b = self.snap_q.peek()
        if b is None:
            return None
        top = self.kv_q.peek_priority()
        return b[1] if top is None or top > b[0] else None


class Evictor:
    """Chooses victims and allocates pages and slots with eviction (module docstring).

    Args:
        index: removes the victims and keeps the slab counts (see module docstring).
        arena: the memory the victims free.
        parts: the eviction policy's queues and chooser.
    """

    def __init__(self, index: PrefixIndex, arena: Arena, parts: PolicyParts) -> None:
        self._index = index
        self._evict_kv = index.evict_kv
        self._evict_snapshot = index.evict_snapshot
        self.arena = arena
        self.kv_q = parts.kv_queue
        self.snap_q = parts.snapshot_queue
        self.chooser = (parts.chooser or LowestFirst)(self.kv_q, self.snap_q)
        #: Blocks holding a page of a held run prefix, worked out when a slot allocation
        #: asks and ``pinned_stale`` (set by the index whenever holds change).
        self.pinned: set[int] = set()
        self.pinned_stale = True
        self._ppb = max(arena.layout.pages_per_block, 1)
        self._aside: list | None = None  # set while a slot_batch is open
        self._batch = SlotBatch(self)  # one reusable context object (allocate opens two)
        # A slot needs an empty block: with several pages per block, only KV in slabs
        # that no request pins can help (see alloc_slot).
        self._slot_pred = self.in_unpinned_slab if arena.layout.pages_per_block > 1 else None
        if self._slot_pred is not None and hasattr(self.kv_q, "slab_scan"):
            # The same filter over a run's block segments in one call (value._deepest).
            self.kv_q.slab_pred, self.kv_q.slab_scan = self._slot_pred, self.deepest_unpinned
        #: Slot allocations evict a run's tail as one range where the victims are exactly
        #: that (see _drop_tail_range): the default chooser over a queue that ranks run
        #: tails. False evicts unit by unit (the same victims: tests compare the two).
        self.tail_ranges = type(self.chooser) is LowestFirst and hasattr(self.kv_q, "tail_range")
        #: KV units evicted in ranges of more than one unit (how often the range path runs).
        self.range_units = 0
        #: Victims taken without asking the chooser (``_stranded_victim``: how often that runs).
        self.stranded_turns = 0

    def in_unpinned_slab(self, pages: tuple[int, ...]) -> bool:
        """Evicting a KV unit with these pages brings a free block closer: one of its slabs
        holds only evictable pages (no running request's page, cached or private)."""
        if self.pinned_stale:
            self.find_pinned()
        index = self._index
        pinned, reg, used, ppb = self.pinned, index._registered, self.arena.used_per_block, self._ppb
        for p in pages:
            b = p // ppb
            if reg[b] == used[b] and b not in pinned:  # no private page, no held one
                return True
        return False

    def deepest_unpinned(self, starts: list[int], blocks: list[int], start: int, held: int) -> int:
        """:meth:`in_unpinned_slab` asked of one attention group's block segments
        (``Run.segs[0]``) from position ``start`` down to ``held``
        (:func:`deepest_unpinned_segment` over this arena's tables): a ``SegmentScan``."""
        if self.pinned_stale:
            self.find_pinned()
        return deepest_unpinned_segment(starts, blocks, start, held, self._index._registered,
                                        self.arena.used_per_block, self.pinned)

    def find_pinned(self) -> None:
        """The blocks that hold a page of a held run prefix (worked out once per change of
        the holds that a slot allocation sees: a few runs, one step per block segment)."""
        pinned: set[int] = set()
        for run in self._index._held_runs:
            held = run.held
            for starts, blocks in run.segs:
                pinned.update(blocks[: bisect_left(starts, held)])
        for cache in self._index.sliding:  # running requests' windows
            cache.pinned_blocks(pinned)
        self.pinned = pinned
        self.pinned_stale = False

    def evict_one(self) -> bool:
        """Evict the lowest-ranked entry of either kind (what freeing a page needs); returns
        False when nothing is evictable."""
        choice = self.chooser.choose(None, [])  # no predicate: nothing is set aside
        if choice is None:
            return self._evict_sliding()
        self._drop(*choice, keep_slot=False)
        return True

    def _evict_sliding(self, pred: PagesPred | None = None) -> bool:
        """Last resort: the sliding-window page released longest ago (hybridcache.sliding).

        Unheld sliding pages go with their unit's full KV when the policy evicts that; the
        ones left are those of units whose full KV a running request still holds (a long
        request's window moved on) or that serve a snapshot end, so they are taken only
        once no ranked entry is left. Memory stays bounded: they are all evictable.
        ``pred``: only pages of slabs a slot allocation can empty."""
        for cache in self._index.sliding:
            if cache.evict_oldest(pred):
                return True
        return False

    def _drop(self, kind: str, node: UnitHandle, keep_slot: bool) -> int:
        """Evict a chosen victim; returns its slot when ``keep_slot`` and it is a snapshot
        (handed over to the caller, not freed), else -1."""
        if kind == "state":
            self.snap_q.evicted(node)  # a GreedyDual victim ages the clock
            return self._evict_snapshot(node, keep_slot)
        self.kv_q.evicted(node)
        self._evict_kv(node)
        return -1

    def _drop_tail_range(self, node: UnitHandle, pred: PagesPred | None) -> bool:
        """Evict the KV victim ``node`` and the units before it that the chooser would take
        next, one after another, as one range (False: not done, ``node`` is not its run's
        queued tail or the policy ranks otherwise; nothing changed).

        Freeing a state slot takes a dozen KV units in a row, mostly one run's tail: the
        queue works out how far the same choices would go (:meth:`RunValueQueue.tail_range
        <hybridcache.policies.value.RunValueQueue.tail_range>`), stopping after the unit
        whose pages empty a block (the slot the loop waits for), and the index removes them
        at once. Only for the default chooser and a queue that ranks run tails."""
        if not self.tail_ranges or self._index.sliding:
            return False
        run = node.run
        if run is None or node.depth - run.first != len(run.digests) - 1:
            return False
        return self._drop_run_tail(run, pred)

    def _drop_run_tail(self, run: Run, pred: PagesPred | None) -> bool:
        """:meth:`_drop_tail_range` of ``run``'s tail (the victim). One unit goes as
        :meth:`PrefixIndex.evict_tail_range` of one, which is ``evict_kv`` of the tail."""
        used, ppb = self.arena.used_per_block, self._ppb
        left: dict[int, int] = {}

        def empties_block(pages: tuple[int, ...]) -> bool:
            for p in pages:
                b = p // ppb
                n = left.get(b, used[b]) - 1
                left[b] = n
                if not n:
                    return True
            return False

        top = self.snap_q.peek()
        k = self.kv_q.tail_range(run, pred, None if top is None else top[0], empties_block)
        if not k:
            return False
        self._index.evict_tail_range(run, k)
        if k > 1:
            self.range_units += k
        return True

    def alloc_page(self) -> int | None:
        """A page, evicting as needed; ``None`` when nothing more can be evicted."""
        got = self.alloc_pages(1)
        return got[0] if got else None

    def alloc_pages(self, n: int) -> list[int]:
        """``n`` pages, evicting as needed; fewer when nothing more can be evicted.

        Pending spare checkpoints of the step go before any cached entry, other pending
        save points only once nothing is evictable (hybridcache.pending_saves)."""
        out = self.arena.alloc_pages(n)
        if len(out) == n:
            return out  # the usual step: free room
        pend = self._index.pending_saves
        if pend is not None:
            while len(out) < n and pend.withdraw(spares_only=True):
                out += self.arena.alloc_pages(n - len(out))
        while len(out) < n:
            if self._stranded_turns(out, n):
                continue
            choice = self.chooser.choose(None, [])  # evict_one, with a tail range
            if choice is None:
                if not self._evict_sliding() and (pend is None or not pend.withdraw(spares_only=False)):
                    break
            else:
                got = self._take_tail_pages(choice[1], n - len(out)) if choice[0] == "kv" else None
                if got:
                    out += got
                    continue
                self._drop(*choice, keep_slot=False)
            out += self.arena.alloc_pages(n - len(out))
        return out

    def _take_tail_pages(self, node: UnitHandle, want: int) -> list[int] | None:
        """Up to ``want`` pages taken over from the KV victim ``node`` and the units before
        it that single evictions would take next (``None``: not done, nothing changed).

        Once the arena has no free page, each single victim whose page leaves its slab
        non-empty gives that page straight back to the allocation (free, then take: the
        arena ends as it was), so a stretch of such victims hands its pages over without
        the arena: one page per unit, in eviction order. A victim whose page would empty
        its slab frees a whole block, which the allocation then takes from its start: that
        one goes the single way. One attention group only (several groups' pages come back
        in the arena's order, not the victims')."""
        if not self.tail_ranges or self._index.sliding:
            return None
        run = node.run
        if run is None or len(run.pages) != 1 or node.depth - run.first != len(run.digests) - 1:
            return None
        return self._take_run_tail(run, want)

    def _take_run_tail(self, run: Run, want: int) -> list[int] | None:
        """:meth:`_take_tail_pages` of ``run``'s tail (the victim; one attention group). One
        unit goes as :meth:`PrefixIndex.evict_tail_range` of one, its page handed over: what
        freeing it and taking a page does in an arena with no other free page."""
        used, ppb = self.arena.used_per_block, self._ppb
        if used[run.pages[0][-1] // ppb] < 2:
            return None

        def keeps_slab(pages: tuple[int, ...]) -> bool:
            # A guard: the arena has no free page here (the last take came up short), so
            # every KV slab is full and a handed-over page leaves its count as it was;
            # with several pages per block this always holds (one-page blocks stop above).
            return used[pages[0] // ppb] > 1

        taken = [0]

        def enough(pages: tuple[int, ...]) -> bool:
            taken[0] += 1
            return taken[0] >= want

        top = self.snap_q.peek()
        k = self.kv_q.tail_range(run, keeps_slab, None if top is None else top[0], enough, offers=False)
        if not k:
            return None
        if k > 1:
            self.range_units += k
        return self._index.evict_tail_range(run, k, keep_pages=True)

    def _stranded_turns(self, out: list[int], n: int) -> bool:
        """Take pages for ``out`` (up to ``n``) from stranded run tails at the clock while
        each is the victim the chooser would take next, without asking the chooser; False
        when the first one is not (nothing changed).

        KV past the last snapshot ranks at the clock, all such tails alike, so equal ranks
        go in queue order: a page allocation in a cache full of stranded runs takes one
        unit from each in turn (the next unit of a run ranks with the others again), and
        every range (:meth:`_take_run_tail`) stops after one unit. The chooser's round trip
        per unit (both queues' tops, a handle made for the victim and dropped with it) is
        most of such a turn; here the victim is known from the KV queue's top alone
        (:meth:`_stranded_victim`) and taken as the chooser's would be."""
        if not self.tail_ranges or self._index.sliding:
            return False
        took = False
        while len(out) < n:
            run = self._stranded_victim(None)
            got = self._take_run_tail(run, n - len(out)) if run is not None else None
            if not got:
                break
            out += got
            took = True
            self.stranded_turns += 1
        return took

    def _stranded_victim(self, pred: PagesPred | None) -> Run | None:
        """The run whose tail the chooser takes next if that tail is stranded KV at the clock
        (one attention group), else None; ``pred``: a slot allocation's filter, with which
        the chooser also weighs :meth:`RunValueQueue.first`'s offered units (ties go to them)
        and takes only a tail that satisfies it."""
        q = self.kv_q
        run = q.stranded_top()
        if run is None or len(run.pages) != 1:
            return None
        if pred is not None and (q.offered_at_or_below(run) or not pred((run.pages[0][-1],))):
            return None
        top = self.snap_q.peek()
        if top is not None and top[0] < run.qprio:
            return None
        return run

    def alloc_slot(self) -> int | None:
        """A state slot, evicting as needed; ``None`` when nothing more can be evicted
        (or only KV in slabs that running requests pin, which would free no block).
        Pending save points are taken back as :meth:`alloc_pages` does.

        A slot needs an empty block: when snapshots are larger than pages, KV victims come
        only from slabs that no request pins. Pinned-slab KV entries are set aside once for
        the whole loop (or the whole slot_batch), not rescanned for every victim.
        """
        s = self.arena.alloc_slot()
        if s is not None:
            return s
        pend = self._index.pending_saves
        if pend is not None:  # the step's pending spares go first (hybridcache.pending_saves)
            while pend.withdraw(spares_only=True):
                s = self.arena.alloc_slot()
                if s is not None:
                    return s
        pred = self._slot_pred
        batch = self._aside is not None
        aside: list = self._aside if batch else []  # type: ignore[assignment]
        try:
            arena, choose = self.arena, self.chooser.choose
            turns = self.tail_ranges and not self._index.sliding
            while s is None:
                run = self._stranded_victim(pred) if turns else None
                if run is not None and self._drop_run_tail(run, pred):  # as _stranded_turns
                    self.stranded_turns += 1
                    if arena.may_have_slot():
                        s = arena.alloc_slot()
                    continue
                choice = choose(pred, aside)
                if choice is None:
                    if self._evict_sliding(pred) or (pend is not None and pend.withdraw(spares_only=False)):
                        if arena.may_have_slot():
                            s = arena.alloc_slot()
                        continue
                    return None
                kind, node = choice
                if kind == "state":  # _drop's state branch: the slot is taken over
                    self.snap_q.evicted(node)
                    return self._evict_snapshot(node, True)
                if not self._drop_tail_range(node, pred):
                    self._drop(kind, node, keep_slot=True)
                if arena.may_have_slot():
                    s = arena.alloc_slot()
            return s
        finally:
            if aside and not batch:
                self.kv_q.put_back(aside)

    def slot_from_demoted(self) -> int | None:
        """A state slot taken over from the next victim when that is a demoted snapshot (a
        spare checkpoint, a prompt-end state ranked first to evict, or a checkpoint its
        session went past: :mod:`hybridcache.superseded`), else ``None``
        (nothing changed): one wish may replace another, never an entry the admission rules
        made (a ``spare-suffix-start`` point, :mod:`hybridcache.admission`). The default
        chooser names its next victim without taking it (:meth:`LowestFirst.state_victim`);
        a policy's own chooser (``marconi``) may not, so there nothing is taken."""
        chooser = self.chooser
        node = chooser.state_victim() if isinstance(chooser, LowestFirst) else None
        if node is None or not (node.snap_demoted or node.snap_superseded):
            return None
        return self._drop("state", node, keep_slot=True)

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
