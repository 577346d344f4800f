"""Admission (where to snapshot) and eviction (what to drop) policies, chosen by name.

Admission decides at which hash-unit boundaries of a request the engine saves a state
snapshot. Snapshots are large (41 MiB for Kimi Linear 48B), so saving one everywhere wastes
memory, and saving too few makes KV hits unusable on hybrid models. Rules (combine with
``+``):

- ``last-token``: the last unit boundary before the prompt's last token, the deepest point an
  identical prompt can reuse (the last token is always recomputed).
- ``turn-end``: the last unit boundary of the finished turn (prompt + output), which the next
  turn of a multi-turn session or agent extends.
- ``branch-point``: the point where the request leaves the cached KV path (Marconi): every
  later request that shares the prefix up to there can use it.
- ``interval:N``: every N tokens (N a multiple of the hash unit), as SGLang's track interval.
- ``chunk-end``: the end of every scheduled prefill chunk, where the engine has the state
  for free.

Eviction ranks evictable entries of both kinds (KV pages of a unit, state snapshots) on one
scale so that one can be traded against the other:

- ``lru``: last access tick.
- ``value`` (default): GreedyDual-Size-Frequency. Priority = ``L + hits * flops / bytes``
  where ``flops`` are the prefill FLOPs the entry saves, ``bytes`` what it holds and ``L``
  the priority of the last victim (an aging clock). It keeps cheap-to-hold, expensive-to-
  recompute, often-used entries, and still ages out what is not touched; O(log n).
- ``marconi``: Marconi's utility ``alpha * norm(flops/bytes) + norm(recency)``, min-max
  normalised over the candidates; the candidates are the ``window`` least recently used
  entries of each kind (a bounded scan, so eviction stays cheap on large caches).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from typing import Any

from hybridcache.errors import UnknownNameError

ADMISSION_RULES = ("last-token", "turn-end", "branch-point", "interval", "chunk-end")
EVICTION_POLICIES = ("lru", "value", "marconi")


@dataclass(frozen=True)
class AdmissionPolicy:
    """Parsed admission rules (see module docstring)."""

    last_token: bool = False
    turn_end: bool = False
    branch_point: bool = False
    interval: int = 0
    chunk_end: bool = False
    #: Save a snapshot only once the same point was wanted ``min_seen`` times (vLLM's align
    #: mode does not save a prefix seen for the first time). 1 = always.
    min_seen: int = 1

    @classmethod
    def parse(cls, text: str, hash_unit: int) -> AdmissionPolicy:
        """Parse ``"last-token+turn-end+interval:256"``; unknown rules list the known ones."""
        kw: dict[str, object] = {}
        for raw in filter(None, (p.strip() for p in text.split("+"))):
            name, _, arg = raw.partition(":")
            if name == "interval":
                try:
                    n = int(arg)
                except ValueError:
                    raise UnknownNameError(f"admission rule {raw!r}: interval needs tokens, e.g. interval:256") from None
                if n <= 0 or n % hash_unit:
                    raise UnknownNameError(
                        f"admission rule {raw!r}: interval must be a positive multiple of the hash unit {hash_unit}"
                    )
                kw["interval"] = n
            elif name in ("last-token", "turn-end", "branch-point", "chunk-end") and not arg:
                kw[name.replace("-", "_")] = True
            elif name == "none":
                continue
            else:
                raise UnknownNameError(
                    f"unknown admission rule {raw!r}; known: {', '.join(ADMISSION_RULES)} "
                    "(interval takes :TOKENS; combine with '+', or 'none')"
                )
        return cls(**kw)  # type: ignore[arg-type]


class EvictionQueue:
    """Evictable entries of one kind ranked by a policy. Items are manager nodes.

    The manager calls :meth:`add` when an entry becomes evictable (no request holds it),
    :meth:`discard` when it is held again or dropped, :meth:`peek` (or :meth:`first`) to
    choose a victim and :meth:`evicted` once it is gone. ``priority`` values of the two
    kinds are comparable: lower goes first.

    KV units are held and released per run (:mod:`hybridcache.runs`): the index reports
    ranges of a run through :meth:`hold_range`, :meth:`release_range`, :meth:`on_release` and
    :meth:`run_changed`, which a per-unit queue turns into calls per unit and a per-run
    queue (:class:`~hybridcache.runs.RunValueQueue`) handles as a whole.
    """

    def add(self, item: object, tick: int, flops: float, nbytes: int, hits: int) -> None:
        raise NotImplementedError

    #: The index's handle maker ``(run, pos) -> Node``: a per-unit queue keys its entries by
    #: the units' handles (set by the index).
    unit: Callable[[Any, int], Any]

    def hold_range(self, run: Any, lo: int, hi: int) -> None:
        """Units ``[lo, hi)`` of ``run`` became held."""
        for pos in range(lo, hi):
            self.hold(self.unit(run, pos))

    def release_range(self, run: Any, lo: int, hi: int, tick: int, nbytes: int) -> None:
        """Units ``[lo, hi)`` of ``run`` became evictable; deepest first, so that under LRU
        the tail of a prefix goes before its head."""
        flops = run.flops
        for pos in range(hi - 1, lo - 1, -1):
            self.add(self.unit(run, pos), tick, flops, nbytes, 0)

    def on_release(self, run: Any, end: int) -> None:
        """A hold of units ``[0, end)`` of ``run`` was released (some may stay held)."""

    def run_changed(self, run: Any) -> None:
        """``run`` lost units to eviction (its tail moved, or it was split off)."""

    def discard(self, item: object) -> None:
        raise NotImplementedError

    def hold(self, item: object) -> None:
        """``item`` is held by a request and must not be chosen until :meth:`add` again."""
        self.discard(item)

    def peek(self) -> tuple[float, object] | None:
        raise NotImplementedError

    def peek_priority(self) -> float | None:
        """The priority :meth:`peek` would report (a queue may answer without the item)."""
        top = self.peek()
        return None if top is None else top[0]

    def first(self, pred: Callable[[Any], bool], aside: list) -> tuple[float, object] | None:
        """The lowest-ranked entry whose pages satisfy ``pred`` (left in the queue), or ``None``.

        Lower-ranked entries that fail ``pred`` are moved into ``aside`` so that a caller
        evicting many victims under the same ``pred`` scans each of them once; the caller
        must hand ``aside`` back to :meth:`put_back` when done.
        """
        raise NotImplementedError

    def put_back(self, aside: list) -> None:
        """Return the entries :meth:`first` set aside, in their original ranks."""
        raise NotImplementedError

    def floor(self) -> float | None:
        """A priority at or below every queued entry's (``None`` when empty); no side effects."""
        raise NotImplementedError

    def demote(self, item: object, floor: float) -> None:
        """Rank a queued ``item`` first in this queue, with priority at most ``floor`` (the
        lowest priority of any queue, so that it also goes before the other kind's entries);
        no-op if ``item`` is not queued."""
        raise NotImplementedError

    def evicted(self, item: object) -> None:
        """``item`` was chosen as a victim and is being dropped (the index discards it)."""

    def __len__(self) -> int:
        raise NotImplementedError


class LRUQueue(EvictionQueue):
    """Oldest access first; O(1) everything."""

    def __init__(self) -> None:
        self._od: OrderedDict[object, int] = OrderedDict()

    def add(self, item, tick, flops, nbytes, hits):
        self._od[item] = tick
        self._od.move_to_end(item)

    def discard(self, item):
        self._od.pop(item, None)

    def peek(self):
        if not self._od:
            return None
        item, tick = next(iter(self._od.items()))
        return float(tick), item

    def first(self, pred, aside):
        od, found, skipped = self._od, None, []
        for item, tick in od.items():
            if pred(item.pages):  # type: ignore[attr-defined]
                found = (float(tick), item)
                break
            skipped.append((item, tick))
        for item, _ in skipped:  # set aside: not scanned again by this caller
            del od[item]
        aside.extend(skipped)
        return found

    def floor(self):
        return float(next(iter(self._od.values()))) if self._od else None

    def demote(self, item, floor):
        od = self._od
        if item in od:
            # The tick is the priority peek() reports against the other queue: lower it too,
            # or this entry would hide older ones behind it.
            od[item] = min(od[item], int(floor))
            od.move_to_end(item, last=False)

    def put_back(self, aside):
        od = self._od
        for item, tick in reversed(aside):
            od[item] = tick
            od.move_to_end(item, last=False)
        aside.clear()

    def __len__(self):
        return len(self._od)


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

    def __init__(self, clock: Clock, scale: float, evictable: Callable[[object], bool]) -> None:
        self._clock = clock
        self._scale = scale  # FLOPs per byte -> priority units
        self._evictable = evictable
        self._heap: list[tuple[float, int, object]] = []
        # item -> [current priority, heap seq]: mutable, so a hit updates it in place.
        self._live: dict[object, list] = {}
        self._seq = 0

    #: Frequency weighting, as :attr:`hybridcache.runs.RunValueQueue.freq`.
    freq = True

    def add(self, item, tick, flops, nbytes, hits):
        prio = self._clock.value + (hits if hits > 1 and self.freq else 1) * flops * (1.0 / (nbytes or 1) / self._scale)
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


class MarconiQueue(LRUQueue):
    """LRU order plus the per-entry FLOP efficiency that Marconi's utility needs."""

    def __init__(self) -> None:
        super().__init__()
        self.eff: dict[object, float] = {}

    def add(self, item, tick, flops, nbytes, hits):
        super().add(item, tick, flops, nbytes, hits)
        self.eff[item] = flops / max(nbytes, 1)

    def discard(self, item):
        super().discard(item)
        self.eff.pop(item, None)


def marconi_ranking(
    queues: dict[str, MarconiQueue], alpha: float, window: int, keep: int = 16
) -> list[tuple[str, object]]:
    """The ``keep`` lowest-utility entries among the ``window`` oldest of each queue,
    lowest first (Marconi's utility, min-max normalised over those candidates).

    The caller evicts from this ranking until it runs out or an entry turns stale, so the
    candidate scan is paid once per ``keep`` evictions instead of once per eviction.
    """
    cands: list[tuple[str, object, int, float]] = []
    for kind, q in queues.items():
        eff = q.eff
        cands += [(kind, item, tick, eff[item]) for item, tick in islice(q._od.items(), window)]
    if not cands:
        return []
    ticks = [c[2] for c in cands]
    effs = [c[3] for c in cands]
    t0, t1 = min(ticks), max(ticks)
    e0, e1 = min(effs), max(effs)
    rt = 1.0 / (t1 - t0) if t1 > t0 else 0.0
    re = alpha / (e1 - e0) if e1 > e0 else 0.0
    # Constant terms of the normalisation (a flat dimension scores 1) do not change the order.
    scores = [(e - e0) * re + (t - t0) * rt for t, e in zip(ticks, effs)]
    # sorted()[:keep] is what nsmallest is defined as (same ties), and in C for ~128 items.
    best = sorted(range(len(scores)), key=scores.__getitem__)[:keep]
    return [(cands[i][0], cands[i][1]) for i in best]


def check_eviction_name(name: str) -> str:
    if name not in EVICTION_POLICIES:
        raise UnknownNameError(
            f"unknown eviction policy {name!r}; known: {', '.join(EVICTION_POLICIES)}"
        )
    return name
