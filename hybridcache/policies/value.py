"""``value`` (the default): GreedyDual-Size-Frequency.

Priority = ``L + max(hits, 1) * flops / bytes`` (:func:`greedy_dual_priority`), where
``flops`` are the prefill FLOPs the entry saves, ``bytes`` what it holds and ``L`` the
aging clock (the priority of the last victim). It keeps cheap-to-hold, expensive-to-
recompute, often-used entries and still ages out what is not touched; O(log n). Snapshots
are ranked per entry (:class:`ValueQueue`), KV units per run, by their tails
(:class:`RunValueQueue`), on one shared :class:`Clock`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING

from hybridcache.policies import PolicyParts, PolicySettings, register_policy
from hybridcache.policy import EvictionQueue

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.index import UnitHandle
    from hybridcache.runs import PagesPred, Run, SegmentScan, UnitOf


#: Weightings of value eviction (a knob the adaptive policy turns, hybridcache.adaptive):
#: ``gdsf`` hits x FLOPs per byte (the default), ``gds`` FLOPs per byte only, ``recency``
#: the manager tick of an entry's last release as its priority, KV and state alike: LRU
#: over both kinds, the stranded-KV rule kept (stranded tails and demoted snapshots sit at
#: the clock, the last victim's tick, below every live entry). Not ``clock + 1``: GreedyDual
#: with uniform costs ties every entry released since the last eviction, and the ties went
#: by queue, not by age (SGLang's setting with it was 0.01-0.07 below SGLang's ``lru`` on
#: agentic sessions at 1-2 GiB; by tick the two agree to 0.02 or better). Among stranded
#: tails ``recency`` goes as ``lru`` does, the one found stranded last first (its whole run
#: before any other: SGLang deletes the KV a lost state strands at once), not one unit of
#: each in turn as the other weightings: with few states (``min_seen=2``) most KV is
#: stranded, and taking a unit of each shortened every document's prefix (vLLM's align
#: admission on docs at 1 GiB, seed 9: 0.309 by turns, 0.457 this way, as under ``lru``).
WEIGHTINGS = ("gdsf", "gds", "recency")
#: A release number is ``tick << TICK_SHIFT | count``: ticks and counts never decrease, so
#: the numbers order exactly as the counts do (releases within one tick keep their order)
#: while the tick of a unit's last release stays readable (``number >> TICK_SHIFT``) when
#: the live cache changes eviction policy (hybridcache.policy_switch).
TICK_SHIFT = 40


def greedy_dual_priority(clock: float, hits: int, flops: float, per_byte: float) -> float:
    """GreedyDual-Size-Frequency: ``clock + max(hits, 1) * flops * per_byte``.

    ``per_byte`` is ``1 / (bytes * scale)``: the entry's bytes and the FLOPs per byte of one
    priority unit. The only place the priority is written: both queues call it.
    """
    return clock + (hits if hits > 1 else 1) * flops * per_byte


class Clock:
    """GreedyDual aging clock shared by the two value queues of one manager."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0


class ValueQueue(EvictionQueue):
    """GreedyDual-Size-Frequency priority heap with lazy updates (O(log n) amortised); it
    ranks snapshots (KV units are ranked per run by :class:`~hybridcache.runs.RunValueQueue`,
    on the same :class:`Clock`).

    Neither a pin nor a hit touches the heap: ``hold`` is a no-op and ``add`` of a live entry
    only records its new priority. The heap is corrected when an entry reaches the top: an
    entry that is held (``evictable`` is false) leaves the queue until it is added again, and
    one whose recorded priority grew is pushed back with it.
    """

    #: Frequency weighting, as :attr:`RunValueQueue.freq`.
    freq = True
    #: Rank by the tick of the last release (the ``recency`` weighting), as
    #: :attr:`RunValueQueue.uniform`.
    uniform = False

    def __init__(self, clock: Clock, scale: float, evictable: Callable[[object], bool]) -> None:
        self._clock = clock
        self._scale = scale  # FLOPs per byte -> priority units
        self._evictable = evictable
        self._heap: list[tuple[float, int, object]] = []
        # item -> [current priority, heap seq]: mutable, so a hit updates it in place.
        self._live: dict[object, list] = {}
        self._seq = 0

    def add(self, item, tick, flops, nbytes, hits):
        if self.uniform:
            prio = float(tick)
        else:
            prio = greedy_dual_priority(
                self._clock.value, hits if self.freq else 1, flops, 1.0 / (nbytes or 1) / self._scale
            )
        live, heap = self._live, self._heap
        cur = live.get(item)
        if cur is not None:
            if prio > cur[0]:
                cur[0] = prio
            return
        self._seq += 1
        live[item] = [prio, self._seq]
        heapq.heappush(heap, (prio, self._seq, item))
        if len(heap) > 4 * len(live) + 4096:  # too many stale entries: rebuild
            self._heap = [(p, q, it) for it, (p, q) in live.items()]
            heapq.heapify(self._heap)

    def discard(self, item):
        self._live.pop(item, None)

    def hold(self, item):
        pass  # checked lazily when the entry reaches the top

    def _clean(self) -> None:
        heap, live, evictable = self._heap, self._live, self._evictable
        while heap:
            prio, seq, item = heap[0]
            cur = live.get(item)
            if cur is None or cur[1] != seq:
                heapq.heappop(heap)
            elif not evictable(item):
                heapq.heappop(heap)
                del live[item]
            elif cur[0] > prio:
                self._seq += 1
                cur[1] = self._seq
                heapq.heapreplace(heap, (cur[0], self._seq, item))
            else:
                return

    def peek(self):
        self._clean()
        if not self._heap:
            return None
        prio, _, item = self._heap[0]
        return prio, item

    def floor(self):
        return self._clock.value if self._live else None

    def demote(self, item, floor):
        # Every queued priority is >= the clock (GreedyDual adds to it): the clock is the
        # bottom. The entry's old heap item goes stale (its sequence number changes).
        cur = self._live.get(item)
        if cur is not None:
            self._seq += 1
            cur[0], cur[1] = min(self._clock.value, floor), self._seq
            heapq.heappush(self._heap, (cur[0], self._seq, item))

    def evicted(self, item) -> None:
        """``item`` was chosen as a victim (maybe not the top one): drop it and age the
        clock to its priority, as GreedyDual does for every victim."""
        cur = self._live.pop(item, None)
        if cur is not None and cur[0] > self._clock.value:
            self._clock.value = cur[0]

    def __len__(self):
        return len(self._live)


def _deepest(run: Run, pred: PagesPred, start: int, scan: SegmentScan | None = None) -> int:
    """The deepest unpinned position at or above ``start`` whose pages satisfy ``pred``
    (-1: none). ``scan``: ``pred`` walked over the run's block segments in one call
    (:meth:`Evictor.deepest_unpinned <hybridcache.eviction.Evictor.deepest_unpinned>`,
    the slot filter's: it judges pages by their blocks, so with one attention group each
    segment is judged once); without it, or with several groups, ``pred`` is asked unit
    by unit."""
    held = run.held
    if scan is not None and len(run.pages) == 1 and run.segs[0][0]:
        starts, blocks = run.segs[0]
        return scan(starts, blocks, start, held)
    for pos in range(start, held - 1, -1):
        if pred(run.unit_pages(pos)):
            return pos
    return -1


class RunValueQueue:
    """GreedyDual-Size-Frequency over KV units, one heap entry per run (its tail).

    Priority of a unit = ``base + max(hits, 1) * flops / bytes`` in the same units as
    :class:`ValueQueue` (which ranks the snapshots on the shared
    :class:`Clock`), where ``base`` is the clock when the unit last
    became evictable. A run's tail has the lowest priority of the run (module docstring),
    so the heap holds tails only. Entries are lazy: :meth:`touch` pushes a fresh entry when
    a tail's priority may have changed, and stale or pinned ones are dropped at the top.
    """

    #: The index's handle maker, set by the index as on every queue: only the victims that
    #: :meth:`peek` and :meth:`first` return get a handle, not every queued unit.
    unit: UnitOf
    #: Set by the index for models with state: whether a run's tail unit (or, given a
    #: position, the unit there once the units past it went) is KV past the last
    #: snapshot on its path (it serves no hit until a state exists there). Such a
    #: tail is ranked at the clock, below every entry, so stranded KV goes first and a
    #: usable entry is never evicted while it stays.
    stranded: Callable[..., bool] | None = None
    #: Frequency weighting (GreedyDual-Size-Frequency); False ranks by size and recency
    #: only (GreedyDual-Size): a knob the adaptive policy turns (hybridcache.adaptive).
    freq = True
    #: Rank by the tick of the last release only (``recency`` weighting, :data:`WEIGHTINGS`).
    uniform = False
    #: Set by the evictor: its slot filter and that filter's walk over a run's block
    #: segments, which a scan with that filter uses (``_deepest``).
    slab_pred: PagesPred | None = None
    slab_scan: SegmentScan | None = None

    def __init__(self, clock: Clock, scale: float, nbytes: int) -> None:
        """Args:
            clock: the aging clock shared with the snapshot queue.
            scale: FLOPs per byte of one priority unit.
            nbytes: bytes of one KV unit.
        """
        self._clock = clock
        self._per = 1.0 / (nbytes or 1) / scale
        # (priority, release number, entry id, run): equal priorities go in release order
        # (a run's units released together drain tail first, before later releases).
        self._heap: list[tuple[float, int, int, Run]] = []
        self._seq = 0
        self._order = 0
        # During a slot allocation (first() with a predicate): for each run set aside, its
        # deepest unpinned unit that satisfies the predicate, (priority, order, entry id,
        # position, digest, run). Dropped by put_back().
        self._cands: list[tuple[float, int, int, int, bytes, Run]] = []
        self._rescan: list[Run] = []  # runs that lost an offered unit: offer the next one
        self._live = 0  # runs with a current entry (qseq != 0)
        self._strands = 0  # stranded tails found (the recency weighting's order among them)

    # ----------------------------------------------------- run events (EvictionQueue API)
    def on_release(self, run: Run, end: int, tick: int = 0) -> None:
        """A hold ending at ``end`` was released at ``tick``: units below it were used
        until now. The release number carries the tick in its high bits (see
        :data:`TICK_SHIFT`): the numbers order as before, and a policy switch
        (:mod:`hybridcache.policy_switch`) reads the tick back."""
        self._order += 1
        run.rel[end] = (self._clock.value, (tick << TICK_SHIFT) | self._order)

    def hold_range(self, run: Run, lo: int, hi: int) -> None:
        """Pinned tails are dropped lazily at the top."""

    def release_range(self, run: Run, lo: int, hi: int, tick: int, nbytes: int) -> None:
        self.touch(run)

    def run_changed(self, run: Run) -> None:
        self.touch(run)

    # ----------------------------------------------------------------- ranking
    def _base(self, run: Run, pos: int) -> tuple[float, int]:
        """``(priority base, release number)`` of the unit at ``pos``: its last release."""
        if pos == len(run.digests) - 1:  # the tail: ends never pass the run's length
            return run.rel.get(pos + 1, (self._clock.value, 0))
        return max((v for end, v in run.rel.items() if end > pos), default=(self._clock.value, 0))

    def priority(self, node: UnitHandle) -> float:
        """Current priority of any KV unit (the queue itself only ranks tails)."""
        run = node.run
        assert run is not None, "priority of a node without KV"
        return self.unit_priority(run, node.depth - run.first)

    def unit_priority(self, run: Run, pos: int) -> float:
        """:meth:`priority` of the unit at ``pos`` of ``run``."""
        if pos == len(run.digests) - 1 and self.stranded is not None and self.stranded(run):
            return self._clock.value
        if self.uniform:
            return float(self._base(run, pos)[1] >> TICK_SHIFT)
        hits = run.hit_count(pos) if self.freq else 1
        return greedy_dual_priority(self._base(run, pos)[0], hits, run.flops, self._per)

    def touch(self, run: Run) -> None:
        """(Re)queue the run's tail at its current priority if it is evictable."""
        n = len(run.digests)
        if not n or run.held >= n:
            return
        base, order = self._base(run, n - 1)
        if self.uniform:
            prio = float(order >> TICK_SHIFT)
        else:
            prio = greedy_dual_priority(base, run.hits.get(n, 0) if self.freq else 1, run.flops, self._per)
        fresh = False  # recency: found stranded (again) now, so it goes first
        if self.stranded is not None and self.stranded(run):
            if self.uniform:
                seq = run.sseq
                order = self._strand(run, order)
                fresh = run.sseq != seq
            else:
                order = 0
            prio = self._clock.value
        elif run.sseq:
            run.sseq = 0
        if run.qseq:
            if prio == run.qprio and not fresh:
                return  # unchanged: keeps its place, as an unchanged per-unit entry would
        else:
            self._live += 1
        self._seq += 1
        run.qseq, run.qprio = self._seq, prio
        heapq.heappush(self._heap, (prio, order, self._seq, run))
        if len(self._heap) > 4 * self._live + 4096:
            self._rebuild()

    def _strand(self, run: Run, order: int) -> int:
        """The order of ``run``'s stranded tail under ``recency``: newest first, counted
        from when it was found stranded (again, if released since), as LRU's queue moves
        such a tail to its front (:class:`~hybridcache.policies.lru.StrandedLRUQueue`)."""
        if not run.sseq or run.srel != order:
            self._strands += 1
            run.sseq, run.srel = self._strands, order
        return -run.sseq

    def _rebuild(self) -> None:
        """Drop stale entries (every queued run has exactly one live entry)."""
        self._heap = [e for e in self._heap if e[3].qseq == e[2]]
        heapq.heapify(self._heap)

    def _clean(self) -> None:
        heap = self._heap
        while heap:
            _, _, seq, run = heap[0]
            if run.qseq != seq:
                heapq.heappop(heap)
            elif run.held >= len(run.digests):
                heapq.heappop(heap)
                run.qseq = 0  # pinned tail: requeued by touch() on release
                self._live -= 1
            else:
                return

    def peek(self) -> tuple[float, UnitHandle] | None:
        self._clean()
        if not self._heap:
            return None
        prio, _, _, run = self._heap[0]
        return prio, self.unit(run, len(run.digests) - 1)

    def peek_priority(self) -> float | None:
        """:meth:`peek`'s priority, without making the victim's handle."""
        self._clean()
        return self._heap[0][0] if self._heap else None

    def stranded_top(self) -> Run | None:
        """The run whose tail is the queue's top entry if that tail is stranded KV ranked at
        the clock (rank ``(clock, n)`` with ``n <= 0``: only a stranded tail gets such a
        number at the clock's value, 0 or ``recency``'s newest-first order), else None (the
        heap cleaned as :meth:`peek` cleans it)."""
        self._clean()
        if not self._heap:
            return None
        prio, order, _, run = self._heap[0]
        return run if order <= 0 and prio == self._clock.value and self.stranded is not None else None

    def offered_at_or_below(self, run: Run) -> bool:
        """Whether :meth:`first` would return an offered unit before ``run``'s queued tail
        (the candidates cleaned as :meth:`first` cleans them; units still to be offered,
        ``_rescan``, count as such: they are offered first)."""
        if self._rescan:
            return True
        cands = self._cands
        while cands and not self._valid_cand(cands[0]):
            heapq.heappop(cands)
        return bool(cands) and (cands[0][0], cands[0][1]) <= (run.qprio, 0)

    def first(self, pred: PagesPred, aside: list) -> tuple[float, UnitHandle] | None:
        """Lowest-ranked unit satisfying ``pred``; runs whose tail fails it go to ``aside``.

        A run set aside still offers its deepest unpinned unit that satisfies ``pred``
        (the lowest-ranked such unit of the run: priorities grow towards the head), so a
        slot allocation can empty a slab whose pages sit inside runs, as a per-unit queue
        would let it; taking such a unit splits its run.
        """
        heap, cands = self._heap, self._cands
        while True:
            for run in self._rescan:
                self._offer(run, pred, len(run.digests) - 1)
            self._rescan.clear()
            self._clean()
            while cands and not self._valid_cand(cands[0]):
                heapq.heappop(cands)
            if cands and (not heap or cands[0][:2] <= heap[0][:2]):
                c = cands[0]
                return c[0], self.unit(c[5], c[3])
            if not heap:
                return None
            prio, order, seq, run = heap[0]
            tail = len(run.digests) - 1
            if pred(run.unit_pages(tail)):
                return prio, self.unit(run, tail)
            aside.append(heapq.heappop(heap))
            self._offer(run, pred, tail - 1)

    def _offer(self, run: Run, pred: PagesPred, start: int) -> None:
        """Offer the deepest unpinned unit at or above ``start`` that satisfies ``pred``."""
        if not run.qseq:
            return
        pos = _deepest(run, pred, start, self.slab_scan if pred is self.slab_pred else None)
        if pos >= 0:
            prio = self.unit_priority(run, pos)
            cand = (prio, self._base(run, pos)[1], run.qseq, pos, run.digests[pos], run)
            heapq.heappush(self._cands, cand)

    @staticmethod
    def _valid_cand(cand: tuple[float, int, int, int, bytes, Run]) -> bool:
        """The offered unit is still unpinned at its place (its run was not split or
        shortened past it, nor requeued)."""
        _, _, seq, pos, digest, run = cand
        d = run.digests
        return run.qseq == seq and run.held <= pos < len(d) and d[pos] == digest

    def put_back(self, aside: list) -> None:
        for entry in aside:
            heapq.heappush(self._heap, entry)
        aside.clear()
        self._cands.clear()
        self._rescan.clear()

    def floor(self) -> float | None:
        return self._clock.value if self._heap else None

    def evicted(self, node: UnitHandle) -> None:
        """``node`` (a queued tail, or a unit :meth:`first` offered) is being evicted: age
        the clock to its priority."""
        run = node.run
        if run is not None and node.depth - run.first < len(run.digests) - 1:
            prio = self.priority(node)
            if prio > self._clock.value:
                self._clock.value = prio
            self._rescan.append(run)  # its units above the victim may be offered next
            return
        if run is not None and run.qseq:
            if run.qprio > self._clock.value:
                self._clock.value = run.qprio
            run.qseq = 0
            self._live -= 1

    def tail_range(
        self, run: Run, pred: PagesPred | None, snap_top: float | None,
        last: Callable[[tuple[int, ...]], bool], offers: bool = True,
    ) -> int:
        """How many units from ``run``'s tail a slot allocation evicts in a row, the tail
        being its victim now; 0 if the tail is not this queue's top entry (then nothing
        changes). Does what :meth:`evicted` does for each of them (the clock ages to each
        one's priority; the run is left unqueued: the caller evicts the units, then
        reports the run as changed).

        The next tail is the next victim exactly when the chooser (lowest of both queues'
        tops, :class:`~hybridcache.eviction.LowestFirst`) would take it: it is unpinned,
        ranks below the heap's next live entry (cleaned as :meth:`_clean` would with that
        tail queued), below or at the snapshot top ``snap_top``, below any candidate
        :meth:`first` offered, and satisfies ``pred``. Its priority is the one
        :meth:`touch` gives it after the units behind it went (their hit and release
        ends fold into it). ``last(pages)``: evicting a unit with these pages gives the
        allocation what it needs (a free block), so none is taken after it. ``offers``:
        the chooser compares :meth:`first`'s candidates (a slot allocation's), else only
        :meth:`peek` (a page allocation's).
        """
        heap = self._heap
        if not heap or not run.qseq or heap[0][2] != run.qseq or heap[0][3] is not run:
            return 0
        clock, hits, rel, stranded = self._clock, run.hits, run.rel, self.stranded
        run.qseq = 0
        self._live -= 1
        pos, held = len(run.digests) - 1, run.held
        hsum, rmax = hits.get(pos + 1, 0), rel.get(pos + 1)
        prio, count = run.qprio, 0
        one = run.pages[0] if len(run.pages) == 1 else None
        pages = (one[pos],) if one is not None else run.unit_pages(pos)
        # The checks against the other entries (heap, snapshot top, offered candidates)
        # depend on nothing but this unit's rank while the loop runs (it changes no other
        # entry), so they are redone only when the rank changes: between hit and release
        # ends it does not, and a tail range is mostly such a stretch.
        checked = None
        while True:  # the unit at pos is a victim
            if prio > clock.value:
                clock.value = prio
            count += 1
            if pos == held or last(pages):
                run.qprio = prio
                return count
            pos -= 1
            hsum += hits.get(pos + 1, 0)
            r = rel.get(pos + 1)
            if r is not None and (rmax is None or r > rmax):
                rmax = r
            if stranded is not None and stranded(run, pos):  # type: ignore[call-arg]
                # recency: the run found stranded stays first (lru's demoted next tail).
                strand = (-run.sseq if run.sseq else self._strand(run, -1)) if self.uniform else 0
                rank = (clock.value, strand)
            else:
                base, order = rmax if rmax is not None else (clock.value, 0)
                if self.uniform:
                    rank = (float(order >> TICK_SHIFT), order)
                else:
                    rank = (greedy_dual_priority(base, hsum if self.freq else 1, run.flops, self._per), order)
            pages = (one[pos],) if one is not None else run.unit_pages(pos)
            if rank != checked:
                if self._outranked(rank, snap_top, offers):
                    run.qprio = prio
                    return count
                checked = rank
            if pred is not None and not pred(pages):
                run.qprio = prio
                return count
            prio = rank[0]

    def _outranked(self, rank: tuple[float, int], snap_top: float | None, offers: bool) -> bool:
        """Whether another entry goes before a unit of this rank (:meth:`tail_range`): an
        older queued entry of equal or lower rank (stale entries, and pinned ones that
        rank below it, are dropped first), a snapshot ranked below it or, with
        ``offers``, a candidate :meth:`first` offered at or below it."""
        heap = self._heap
        while heap:
            top = heap[0]
            other = top[3]
            if other.qseq != top[2]:
                heapq.heappop(heap)
            elif other.held >= len(other.digests) and (top[0], top[1]) <= rank:
                heapq.heappop(heap)
                other.qseq = 0
                self._live -= 1
            else:
                break
        if heap and (heap[0][0], heap[0][1]) <= rank:
            return True  # an older entry of equal rank goes first too
        if snap_top is not None and rank[0] > snap_top:
            return True
        if offers:
            cands = self._cands
            while cands and not self._valid_cand(cands[0]):
                heapq.heappop(cands)
            if cands and (cands[0][0], cands[0][1]) <= rank:
                return True
        return False

    def discard(self, node: UnitHandle) -> None:
        """No per-unit entry to drop: the index reports the run as changed after evicting."""

    def __len__(self) -> int:
        return self._live


@register_policy("value")
def build_value(settings: PolicySettings) -> PolicyParts:
    clock = Clock()
    kv = RunValueQueue(clock, settings.flops_per_byte_scale, settings.kv_unit_bytes)
    snap = ValueQueue(clock, settings.flops_per_byte_scale, settings.snapshot_evictable)
    return PolicyParts(kv, snap)
