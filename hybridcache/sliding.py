"""The sliding-window group's cache: KV of the last ``window`` tokens before a hit end.

A sliding-window layer at token ``t`` reads tokens ``[t - window + 1, t]`` only. A hit that
resumes at token ``L`` (a unit boundary) therefore needs this group's KV for tokens
``[L - window + 1, L)`` and nothing older: the units ``[L - reach, L)`` with ``reach =
ceil((window - 1) / unit)``, the *exact token rule* (vLLM's ``SlidingWindowManager`` needs
``cdiv(sliding_window - 1, block_size)`` contiguous blocks, the same count). The rule that
says which units a hit needs is also the one that says which units a running request may
let go of (:meth:`SlidingWindowCache.first_needed` of its computed tokens), so a released
unit is never one that the request's next token reads.

Unlike full attention, which units a hit needs is not prefix-closed (``[0, L)`` all having
KV does not make every shorter end a hit), so entries are per unit, keyed by digest, not
runs: one :class:`SlidingUnit` per unit whose sliding pages are cached, with a reference
count of the running requests whose window covers it. An entry nobody holds is evictable
and sits in :attr:`SlidingWindowCache.lru` in release order (oldest first).

Why the sliding pages are kept apart from the unit's full-attention pages: a long request
releases its sliding pages as its window moves on while it still holds every full-attention
page, so the two must be held and evicted separately ("a unit has KV" is no longer one bit).
Eviction may take a unit's sliding pages without its full pages: that unit stops being a
hit end (and so do the ``reach`` ends after it), later ends still hit. When a unit's full KV
is evicted its sliding pages go too (no path can reach the unit any more).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from hybridcache.events import DEVICE, REMOVED, STORED, CacheEvent

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Mapping

    from hybridcache.index import PrefixIndex, UnitHandle

#: The event kind of sliding-window pages (``"kv"`` is full attention's, ``"state"`` a
#: snapshot's): a consumer that stores KV by unit must not take these for a unit's KV.
SLIDING = "sliding"


class SlidingUnit:
    """One unit's cached sliding-window pages (one per group of its cache).

    ``ref`` counts the running requests whose window (or hit) holds the unit; ``0``: the
    entry is evictable and queued in its cache's ``lru``.
    """

    __slots__ = ("digest", "depth", "tenant", "pages", "ref")

    def __init__(self, digest: bytes, depth: int, tenant: str | None, pages: tuple[int, ...]) -> None:
        self.digest = digest
        self.depth = depth
        self.tenant = tenant
        self.pages = pages
        self.ref = 1

    def __repr__(self) -> str:
        return f"SlidingUnit(depth={self.depth}, pages={self.pages}, ref={self.ref})"


class SlidingWindowCache:
    """Cached sliding-window pages of the attention groups that share one window.

    Args:
        names: the attention groups (same window), in block-table order.
        window: tokens a layer of these groups reads (itself included).
        unit: the hash unit, in tokens.
        index: the prefix index whose arena the pages come from, whose event log records
            stores and removals, and whose version (walks are reused while it is equal)
            moves with every change.
    """

    def __init__(self, names: Sequence[str], window: int, unit: int, index: PrefixIndex) -> None:
        self.names = tuple(names)
        self.groups = len(self.names)
        self.window = window
        #: Units before a hit end whose pages the hit needs (the exact token rule).
        self.reach = -(-(window - 1) // unit)
        self.index = index
        self.arena = index.arena
        #: digest -> entry, for every unit with cached sliding pages (invariant: pages
        #: distinct and in use in the arena; ``ref`` equals the live requests' holds).
        self.entries: dict[bytes, SlidingUnit] = {}
        #: The entries with ``ref == 0``, oldest release first (invariant: exactly those).
        self.lru: OrderedDict[bytes, SlidingUnit] = OrderedDict()
        #: The entries with ``ref > 0`` (invariant: exactly those): their blocks are pinned
        #: for a slot allocation (hybridcache.eviction), as a held run prefix's are.
        self.held: dict[bytes, SlidingUnit] = {}
        self._ppb = max(index.arena.layout.pages_per_block, 1)
        #: Bytes one entry holds (a page per group), counted in ``index.tenant_bytes``
        #: for the tenant whose request registered it, as a run's units and snapshots are.
        self.entry_bytes = index.arena.layout.page_bytes * self.groups
        #: The byte quota of a tenant (``None``: unlimited), set by the coordinator's
        #: owner: a registration past it is refused (the request's pages stay its own).
        self.quota: Callable[[str | None], int | None] | None = None
        self.evictions = 0
        self.quota_rejections = 0

    # ------------------------------------------------------------------ the hit rule
    def first_needed(self, end: int) -> int:
        """The first unit a hit (or a running request) at unit boundary ``end`` reads."""
        reach = self.reach
        return end - reach if end > reach else 0

    def longest_end(self, digests: Sequence[bytes], end: int) -> int:
        """The largest ``e <= end`` whose units ``[first_needed(e), e)`` all have cached
        sliding pages: scanned right to left, stopping at the first such window (vLLM's
        ``SlidingWindowManager.find_longest_cache_hit``)."""
        reach, entries = self.reach, self.entries
        if not reach:
            return end
        run, e = 0, end
        for u in range(end - 1, -1, -1):
            if digests[u] in entries:
                run += 1
                if run >= reach:
                    return e
            else:
                run, e = 0, u
        return e  # units [0, e) are all present: the window is cut at the first token

    @property
    def evictable_pages(self) -> int:
        """Pages an eviction of every unheld entry would free."""
        return len(self.lru) * self.groups

    # ------------------------------------------------------------------ holding
    def hold(self, entry: SlidingUnit) -> None:
        if not entry.ref:
            del self.lru[entry.digest]
            self.held[entry.digest] = entry
            self.index.evictor.pinned_stale = True
        entry.ref += 1

    def release(self, entry: SlidingUnit) -> None:
        entry.ref -= 1
        if entry.ref < 0:
            raise AssertionError(f"negative ref on {entry}")
        if not entry.ref:
            del self.held[entry.digest]
            self.lru[entry.digest] = entry  # the newest release: evicted last
            self.index.evictor.pinned_stale = True

    def register(
        self, digest: bytes, depth: int, tenant: str | None, pages: tuple[int, ...], held: bool = True
    ) -> SlidingUnit | None:
        """Cache ``pages`` as the unit's sliding pages, held by the caller (``ref == 1``) or,
        with ``held=False``, evictable at once (a unit the window has already left); ``None``
        if the unit has cached sliding pages already or ``tenant`` has no quota left for
        them (the caller keeps its own)."""
        if digest in self.entries:
            return None
        index = self.index
        tenant_bytes = index.tenant_bytes
        if self.quota is not None:
            q = self.quota(tenant)
            if q is not None and tenant_bytes.get(tenant, 0) + self.entry_bytes > q:
                self.quota_rejections += 1
                return None
        entry = self.entries[digest] = SlidingUnit(digest, depth, tenant, pages)
        tenant_bytes[tenant] = tenant_bytes.get(tenant, 0) + self.entry_bytes
        index.version += 1
        if held:
            self.held[digest] = entry
            index.evictor.pinned_stale = True
        else:
            entry.ref = 0
            self.lru[digest] = entry
        reg, ppb = index._registered, self._ppb
        for p in pages:
            reg[p // ppb] += 1
        events = self.index.events
        if events is not None:
            events.append(CacheEvent(
                STORED, SLIDING, DEVICE, (digest,), depth, self.names, tenant, (pages,),
            ))
        return entry

    # ------------------------------------------------------------------ eviction
    def evict(self, entry: SlidingUnit) -> None:
        """Free an unheld entry's pages."""
        assert not entry.ref, "evict of a held sliding entry"
        del self.entries[entry.digest]
        del self.lru[entry.digest]
        free_page, reg, ppb = self.arena.free_page, self.index._registered, self._ppb
        for p in entry.pages:
            reg[p // ppb] -= 1
            free_page(p)
        self.evictions += 1
        index = self.index
        index.version += 1
        left = index.tenant_bytes.pop(entry.tenant, 0) - self.entry_bytes
        if left:  # a tenant with nothing cached is dropped, as the index does
            index.tenant_bytes[entry.tenant] = left
        events = self.index.events
        if events is not None:
            events.append(CacheEvent(
                REMOVED, SLIDING, DEVICE, (entry.digest,), entry.depth, self.names, entry.tenant,
                (entry.pages,),
            ))

    def evict_oldest(self, pred: Callable[[tuple[int, ...]], bool] | None = None) -> bool:
        """Evict the entry released longest ago (whose pages satisfy ``pred``, if given: a
        slot allocation wants pages of slabs it can empty); False when there is none."""
        if pred is None:
            if not self.lru:
                return False
            self.evict(next(iter(self.lru.values())))
            return True
        for entry in self.lru.values():
            if pred(entry.pages):
                self.evict(entry)
                return True
        return False

    def snapshot_evicted(self, node: UnitHandle, handles: Mapping[bytes, UnitHandle]) -> None:
        """A snapshot at the end of ``node``'s unit was evicted (models with state): unheld
        entries of its window that no other snapshot end reads are evicted too (they could
        only serve hits ending there). Ends past ``node``'s run are not known from here: an
        entry that such an end might read stays."""
        run, reach = node.run, self.reach
        if run is None or not reach:
            return
        digests, first, end = run.digests, run.first, node.depth + 1
        entries = self.entries
        for u in range(max(end - reach, first), end):
            entry = entries.get(digests[u - first])
            if entry is None or entry.ref:
                continue
            top = u + reach  # the deepest end that reads unit u
            if top > first + len(digests):
                continue
            if not any(
                (h := handles.get(digests[e - 1 - first])) is not None and h.snap >= 0
                for e in range(u + 1, top + 1)  # its own snapshot is gone already
            ):
                self.evict(entry)

    def pinned_blocks(self, out: set[int]) -> None:
        """Add the blocks of the held entries' pages to ``out``."""
        ppb = self._ppb
        for entry in self.held.values():
            out.update(p // ppb for p in entry.pages)

    def drop_unit(self, digest: bytes) -> None:
        """The unit's full KV was evicted: no path reaches it, so its sliding pages (which
        no request can hold then, as every hold on them comes with one on the full KV)
        go too."""
        entry = self.entries.get(digest)
        if entry is not None and not entry.ref:
            self.evict(entry)

    def check_invariants(self) -> None:
        """Entries, the evictable queue and the arena agree (see the fields)."""
        pages = [p for e in self.entries.values() for p in e.pages]
        assert len(pages) == len(set(pages)), "a sliding page cached twice"
        assert all(self.arena._live[1][p] for p in pages), "a cached sliding page is free"
        assert all(len(e.pages) == self.groups and e.ref >= 0 for e in self.entries.values())
        assert {d for d, e in self.entries.items() if not e.ref} == set(self.lru), "evictable queue"
        assert {d for d, e in self.entries.items() if e.ref} == set(self.held), "held entries"
        assert all(self.entries.get(d) is e for d, e in self.lru.items())
