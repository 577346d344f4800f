"""Where a prompt leaves a prefix the cache held and let go: the ``seen-branch`` rule's point.

The ``branch-point`` rule (Marconi's) saves a state where a request leaves the cached KV
path: the second question on a document finds the first one's KV and saves the document's
end, so the third resumes there. Under pressure that KV is gone before the second question
comes: a document of 43k tokens in a cache of 47k leaves no other document's KV in place,
and no question ever finds a branch, so none is saved and no question ever hits
(falcon-h1-7b, documents at 2 GiB). vLLM's align mode saves inside such a document at its
block boundary; what is missing here is the memory that the prefix was there.

:class:`SeenPrefixes` is that memory, kept the way ARC keeps the pages its cache let go: the
unit digests whose KV the index evicted (:meth:`evicted`, called by the index on every KV
eviction), in two generations of sets: at a request's end, once the newer one holds as
many units as the cache holds KV, the older one is dropped and a new one started. With the cached units (the index's own)
it remembers the prefixes of two to three caches' worth of units. The point is the deepest
unit past the request's KV match that the record holds, found by bisection: KV goes tail
first, so a run's units enter the record deepest first and a generation is dropped whole,
which keeps the record close to prefix-closed (where it is not, the point found is a unit
some prompt went past, only not the deepest). It costs nothing while nothing is evicted.

Not every such point is a branch. A session's next turn extends the previous turn: where
its KV went, the deepest unit held is the previous turn's end (or its prompt's, if only
that was cached), where nothing branched. The last units of recent prompts and turns are
kept too (:meth:`ended_turn`), and a point at one of them is none (the turn end is the
``turn-end`` rule's). The size is the cache's own (its KV units), so nothing here comes from
a trace: a prefix evicted longer ago than a cache's worth of evictions is forgotten.
Measured over 150 falcon-h1-7b cells (a record of prompts' units, kept exactly, least
recently noted first out): one cache's worth of units +0.0040 mean hit, two +0.0069, four
+0.0061.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.arena import ArenaLayout
    from hybridcache.index import PrefixIndex
    from hybridcache.manager import HybridCacheManager
    from hybridcache.requests import Request


def fit_record(mgr: HybridCacheManager, *, keep_unused: bool = False) -> None:
    """Give ``mgr``'s index a record (``index.seen``) when its rules read one, and (unless
    ``keep_unused``) none when they do not.

    Why not once, at construction: a shadow's cache is at times a copy of another
    candidate's (:meth:`hybridcache.shadow.ShadowCache.copy_cache`), record and all, and the
    live cache adopts other candidates' rules. A ``seen-branch`` setting that came back on a
    copy of ``prompt-turn-recency``'s cache (no record) would otherwise never find a point
    again; a setting without the rule would feed a copied record it never reads. A record
    started here is empty: the evictions before it are not known. The live cache keeps
    its record while it runs other rules (``keep_unused``), so that it is current if they
    come back."""
    idx = mgr.index
    if not (mgr.has_state and mgr.admission.seen_branch):
        if not keep_unused:
            idx.seen = None
    elif idx.seen is None:
        idx.seen = SeenPrefixes.for_cache(mgr.layout, idx)


class SeenPrefixes:
    """Digests of units whose KV was evicted, and of recent prompts' and turns' last units.

    Invariants: a generation is started at a request's end once ``_new`` holds
    ``capacity`` units (between two ends it may grow past it by one request's evictions);
    ``_old`` is the generation before ``_new``, dropped whole when the next one starts;
    ``_ends`` / ``_old_ends`` hold the last units noted while ``_new`` / ``_old`` were the
    newer generation, except that ``_ends`` alone is started again once it holds
    ``2 x capacity`` units. Why that bound: an end noted in this generation is cached or
    was evicted since (and so is in ``_new``), which keeps ``_ends`` below about twice the
    cache's units; ends of units the cache never registered (a tenant over its quota) are
    neither, and without it a cache that rarely evicts would keep them all.
    """

    def __init__(self, cache_units: int) -> None:
        """``cache_units``: the units of KV the cache holds; a generation holds that many."""
        if cache_units <= 0:
            raise ValueError(f"cache_units must be positive, got {cache_units}")
        self.capacity = cache_units
        self._new: set[bytes] = set()
        self._old: set[bytes] = set()
        self._ends: set[bytes] = set()
        self._old_ends: set[bytes] = set()

    @classmethod
    def for_cache(cls, layout: ArenaLayout, index: PrefixIndex) -> SeenPrefixes:
        """The record for a cache of ``layout``: its KV units (a model without KV: its
        snapshots)."""
        return cls(max(layout.capacity_bytes // (index.node_kv_bytes or index.snap_bytes), 1))

    def _held(self, d: bytes) -> bool:
        return d in self._new or d in self._old

    def branch(self, digests: Sequence[bytes], lo: int, n: int) -> int:
        """The deepest unit count ``u`` in ``(lo, n]`` whose unit ``u - 1`` the record holds,
        unit ``lo`` held too, and not a prompt's or a turn's last unit; 0 when there is none.

        Args:
            digests: the prompt's unit digests (at least ``n``).
            lo: units of the request's KV match: only a deeper point is asked for.
            n: the prompt's full units.
        """
        if n <= lo or not self._held(digests[lo]):
            return 0
        a, b = lo + 1, n  # unit a - 1 is held; find the last held one
        while a < b:
            mid = (a + b + 1) // 2
            if self._held(digests[mid - 1]):
                a = mid
            else:
                b = mid - 1
        last = digests[a - 1]
        return 0 if last in self._ends or last in self._old_ends else a

    def point(self, req: Request, kv_hit: int, hit: int, unit: int) -> int:
        """The ``seen-branch`` rule's boundary for ``req``'s prompt (``Request.seen_branch``;
        0: none): the deeper of its KV match (``kv_hit`` tokens) and :meth:`branch` past
        it, where that lies past its hit (``hit`` tokens), and not past the prompt's last
        boundary. Worked out once, at the first allocation: the rule reads it at every step
        (and ``min_seen`` counts it as seen twice). Read-only."""
        n = req.num_tokens
        b = max(kv_hit, self.branch(req.hasher.digests, kv_hit // unit, n // unit) * unit)
        return min(b, (n - 1) // unit * unit) if b > hit else 0

    def evicted(self, digests: Iterable[bytes]) -> None:
        """Record units whose KV the cache evicted (a generation is started only at a
        request's end, :meth:`ended_turn`: the index's range evictions and its unit-by-unit
        ones then leave the same record)."""
        self._new.update(digests)

    def evicted_one(self, digest: bytes) -> None:
        """:meth:`evicted` of one unit (the index's per-unit eviction)."""
        self._new.add(digest)

    def ended_turn(self, req: Request, unit: int) -> None:
        """Record ``req``'s prompt's last full unit and, past it, its turn's (the request is
        leaving the cache).

        Internal updates: the newer generation, started again once it holds a cache's worth
        of units (the older one is then dropped)."""
        if len(self._new) >= self.capacity:
            self._old, self._new = self._new, set()
            self._old_ends, self._ends = self._ends, set()
        elif len(self._ends) >= 2 * self.capacity:  # a hard bound on the ends alone (below)
            self._old_ends, self._ends = self._ends, set()
        ds, n = req.hasher.digests, req.prompt_len // unit
        if n:
            self._ends.add(ds[n - 1])
        t = min(req.num_computed // unit, len(ds))
        if t > n:
            self._ends.add(ds[t - 1])

    def sanity_check(self) -> None:
        """Raise ``AssertionError`` if an invariant does not hold."""
        assert self._old is not self._new and self._ends is not self._old_ends, "one generation twice"
        assert not self._old or len(self._old) >= self.capacity, "a generation retired before it was full"
        assert len(self._ends) < 2 * self.capacity + 2, "the ends outgrew their bound"
