"""Importing a prefix loaded from a tier: the port's transaction for an offload tier.

A tier that holds KV units or a snapshot of a waiting request's prefix, past what the
device caches, loads them into arena pages and a slot and registers them as cached entries
before the request's first allocation (which then hits them). The steps, in order::

    with port.import_prefix(request_id) as imp:
        dev = imp.device_prefix(max_units)        # what the device has (read-only)
        imp.hold(target, device_snapshots)        # keep the device part from eviction
        pages = imp.alloc_unit_pages(u)           # one page per group for unit u (evicts)
        slot = imp.alloc_slot()                   # the loaded snapshot's slot (evicts)
        ... the tier writes the bytes ...
        imp.register(final, bare_units, snapshot_flops)   # cached entries now
    # leaving the block frees whatever was not registered and releases the holds

Pages and slots the import allocated belong to it until :meth:`PrefixImport.register`;
units without KV bytes (a pure-state model) are listed as ``bare_units``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from hybridcache.port import DevicePrefix

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.index import UnitHandle
    from hybridcache.manager import HybridCacheManager
    from hybridcache.requests import Request
    from hybridcache.runs import Hold
    from hybridcache.sliding import SlidingUnit, SlidingWindowCache


class PrefixImport:
    """One import for one waiting request (module docstring)."""

    def __init__(self, manager: HybridCacheManager, request: Request) -> None:
        self._m = manager
        self._req = request
        self._held: list[Hold] = []
        self._pinned: list[UnitHandle] = []
        self._windows: list[tuple[SlidingWindowCache, SlidingUnit]] = []
        self.pages: dict[int, tuple[int, ...]] = {}  # unit -> its loaded pages, per group
        self.slot = -1

    def __enter__(self) -> PrefixImport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def device_prefix(self, max_units: int) -> DevicePrefix:
        """What the device holds of the request's chain (see :class:`DevicePrefix`)."""
        from hybridcache.port import EnginePort

        return EnginePort(self._m, record_events=False).device_prefix(self._req.hasher.digests, max_units)

    def hold(self, target: int, snapshot_boundaries: Iterable[int] = ()) -> None:
        """Hold the device's KV of units ``[0, target)`` and pin its snapshots at the given
        boundaries (units), and the deepest device snapshot of the current hit, so that the
        import's own allocations cannot evict them. With sliding-window groups, the cached
        sliding pages of the windows before ``target``, before each given boundary and
        before the current hit are held too, until :meth:`close`: the hit after the load
        needs them, and only the device has them."""
        index, digests = self._m.index, self._req.hasher.digests
        self._held = index.chain_holds(digests, 0, target)
        index.hold_runs(self._held)
        max_units = min((self._req.num_tokens - 1) // self._m.unit, len(digests))
        kv_units, _, hit_node = index.walk(digests, max_units)
        snapshot_boundaries = list(snapshot_boundaries)
        coordinator = self._m.coordinator
        if coordinator is not None:
            ends = {target, *snapshot_boundaries, coordinator.longest_hit(digests, kv_units)[0]}
            self._windows = coordinator.hold_windows(digests, [e for e in ends if e > 0])
        pins = [index.handles[digests[b - 1]] for b in snapshot_boundaries]
        if hit_node is not None:
            pins.append(hit_node)
        for node in pins:
            index.pin_snapshot(node)
            self._pinned.append(node)

    def alloc_unit_pages(self, unit: int) -> tuple[int, ...] | None:
        """One page per attention group for ``unit``, evicting as needed; ``None`` (nothing
        taken) when memory is full."""
        index, got = self._m.index, []
        for _ in self._m.groups:
            p = index.alloc_page()
            if p is None:
                for q in got:
                    self._m.arena.free_page(q)
                return None
            got.append(p)
        self.pages[unit] = pages = tuple(got)
        return pages

    def alloc_slot(self) -> int:
        """The slot for the loaded snapshot (evicting as needed); ``-1`` when full."""
        if self.slot < 0:
            got = self._m.index.alloc_slot()
            self.slot = -1 if got is None else got
        return self.slot

    def register(self, final: int, bare_units: Iterable[int] = (), snapshot_flops: float | None = None) -> list[int]:
        """Make the loaded units below ``final`` (and the units in ``bare_units``) cached KV,
        and, if ``snapshot_flops`` is given, the slot the snapshot at ``final``; then release
        the holds. Returns the units whose KV pages were registered."""
        m = self._m
        index, digests = m.index, self._req.hasher.digests
        m.tick += 1
        tick = m.tick
        bare = set(bare_units)
        loaded: list[int] = []
        i = min([*self.pages, *bare], default=final)
        while i < final:
            if i not in self.pages and i not in bare:
                i += 1
                continue  # KV on the device (held)
            j = i
            while j < final and (j in self.pages or j in bare):
                j += 1
            pages = {u: self.pages.pop(u, None) or () for u in range(i, j)}
            tables = [{u: p[g] for u, p in pages.items()} for g in range(len(m.groups))]
            got = index.register_kv_run(digests, i, j, self._req.tenant, tables, m._unit_flops)
            assert got is not None and got[1] == j - i, "imported a unit that has KV on the device"
            self._held.append(got[0])
            loaded += [u for u, p in pages.items() if p]
            i = j
        if snapshot_flops is not None and self.slot >= 0:
            node = index.unit(digests, final - 1)
            assert node is not None
            index.register_snapshot(node, self.slot, snapshot_flops, tick)
            self.slot = -1
        holds = sorted(self._held, key=lambda h: h[0].first)  # released deepest first
        self._held = []
        index.release_runs(holds, tick)
        return loaded

    def close(self) -> None:
        """Free what was not registered; release holds and pins."""
        m = self._m
        for pages in self.pages.values():
            for p in pages:
                m.arena.free_page(p)
        self.pages.clear()
        if self.slot >= 0:
            m.arena.free_slot(self.slot)
            self.slot = -1
        if self._held:
            m.index.release_runs(self._held, m.tick)
            self._held = []
        for node in self._pinned:
            m.index.unpin_snapshot(node, m.tick)
        self._pinned = []
        if self._windows:
            m.coordinator.release_windows(self._windows)  # type: ignore[union-attr]
            self._windows = []
