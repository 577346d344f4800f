"""OffloadCoordinator: the manager's device cache over a stack of lower tiers.

Two paths, both driven from the engine's thread:

* **Demotion** (device -> first tier). The coordinator chains itself into the index's
  ``on_evict`` hook, which runs right after an entry's pages or slot were freed in the arena
  and before anything can reuse them: the bytes are copied out synchronously (one ``copy_``
  per piece into fresh host memory, pinned on CUDA) and handed to the first tier's
  non-blocking ``put``. :class:`~hybridcache.tiers.offload_policy.DemotionPolicy` decides what
  is worth it (snapshots and the KV below them; not a never-hit, request-unique tail). A
  :class:`~hybridcache.tiers.HostTier` in the stack spills its own victims to the next tier.
* **Prefetch** (tiers -> device), called by the engine after ``add_request`` and before the
  first ``allocate``. It finds the deepest boundary past the device hit such that every
  unit below it has KV (on the device or in a tier) and a snapshot sits at it, probing
  with batched ``contains_many`` in doubling windows (O(log n) round trips); then holds the
  device part of that path, allocates pages and a slot through the index (evicting, and so
  demoting, as needed), copies the bytes in, and registers them as cached, evictable
  entries: the manager's ordinary ``match`` now hits. It returns a
  :class:`~hybridcache.tiers.offload_plan.LoadPlan`.

**KV and state together.** A snapshot at boundary ``b`` is loaded only once every unit
below ``b`` is complete, and KV past the last snapshot that made it is never registered:
if a piece is missing or corrupt, memory runs out or a tier fails mid-load, the coordinator
falls back to the deepest snapshot whose KV is complete (possibly the device hit: then
``None``). Tier errors are misses (the tiers fail closed); anything unexpected is logged
and counted, never raised into the engine. Key layout: :mod:`~hybridcache.tiers.offload_io`.

Not thread-safe: call it from the thread that drives the manager (the tiers' own writer
threads are fine).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hybridcache.index import Hold, UnitHandle
from hybridcache.manager import HybridCacheManager
from hybridcache.requests import Request
from hybridcache.storage import ArenaStorage
from hybridcache.tiers.base import Tier
from hybridcache.tiers.errors import TierConfigError
from hybridcache.tiers.format import Entry
from hybridcache.tiers.host import HostTier
from hybridcache.tiers.keys import EntryKey
from hybridcache.tiers.offload_io import DeviceIO, UnitKeys, layout_fingerprint
from hybridcache.tiers.offload_lookup import TierLookup
from hybridcache.tiers.offload_plan import LoadPlan, OffloadMetrics
from hybridcache.tiers.offload_policy import DemotionPolicy, PathMemory
from hybridcache.tiers.offload_stored import StoredMemory
from hybridcache.tiers.unseeded import warn_if_unseeded

_log = logging.getLogger("hybridcache.tiers.offload")

#: Source of a piece that is already on the device.
DEVICE = -1


@dataclass
class _Probe:
    """What the tiers (plus the device) hold past the device hit."""

    reach: int  # units [0, reach) have KV on the device or in a tier
    kv_src: dict[int, int] = field(default_factory=dict)  # unit -> tier holding its KV
    bare: list[int] = field(default_factory=list)  # pure-state model: units to register
    snaps: list[tuple[int, int]] = field(default_factory=list)  # (boundary unit, source)

    def target(self, has_state: bool, dev_hit: int) -> int:
        if not has_state:
            return self.reach
        return self.snaps[-1][0] if self.snaps else dev_hit


@dataclass
class _Work:
    """Resources a prefetch holds until it registers them (or gives them back)."""

    held: list[Hold] = field(default_factory=list)  # device KV on the path, and new runs
    pinned: list[UnitHandle] = field(default_factory=list)
    pages: dict[int, tuple[int, ...]] = field(default_factory=dict)  # unit -> private pages
    slot: int = -1  # reserved before the KV, so a full arena still fits a snapshot
    snap_loaded: bool = False
    planned_bytes: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)

    def count(self, tier_name: str) -> None:
        self.by_tier[tier_name] = self.by_tier.get(tier_name, 0) + 1


class OffloadCoordinator:
    """Demotes evicted device entries into ``tiers`` and loads prefixes back on a miss.

    Args:
        manager: the engine's manager (its index gets the eviction hook).
        storage: the arena tensors behind the manager's page and slot ids.
        tiers: fastest first, e.g. ``[HostTier, RedisTier]`` or ``[RedisTier]``. Demotions
            go to ``tiers[0]``; a HostTier spills its victims to the tier after it; loads
            read each entry from the first tier that has it.
        policy: what to demote (:class:`DemotionPolicy`).
        probe_batch: units in the first probe window (windows double after it).
        load_batch_bytes: payload fetched from a tier per batch (bounds host memory).
        path_memory: unit digests remembered for the demotion rule.
        stored_memory: keys remembered as already stored (skips re-demoting them).
        stored_max_age_s: how long such a record is trusted; prefetch probes also forget
            keys they find missing (see :mod:`.offload_stored`).
    """

    def __init__(
        self,
        manager: HybridCacheManager,
        storage: ArenaStorage,
        tiers: Sequence[Tier],
        *,
        policy: DemotionPolicy | None = None,
        probe_batch: int = 16,
        load_batch_bytes: int = 256 << 20,
        path_memory: int = 1 << 20,
        stored_memory: int = 1 << 20,
        stored_max_age_s: float | None = 600.0,
    ) -> None:
        if not tiers:
            raise TierConfigError("OffloadCoordinator: need at least one tier")
        if storage.layout != manager.layout:
            raise TierConfigError("OffloadCoordinator: storage was built for another layout")
        if probe_batch <= 0 or load_batch_bytes <= 0:
            raise TierConfigError("probe_batch and load_batch_bytes must be positive")
        self.manager = manager
        self.storage = storage
        self.tiers = list(tiers)
        self.policy = policy or DemotionPolicy()
        self.probe_batch = probe_batch
        self.load_batch_bytes = load_batch_bytes
        self.tier_names = [f"{i}:{type(t).__name__}" for i, t in enumerate(self.tiers)]
        self.fingerprint = layout_fingerprint(manager.spec, manager.layout, manager.unit)
        self.keys = UnitKeys(self.fingerprint)
        self.io = DeviceIO(storage, manager.groups)
        self.metrics = OffloadMetrics()
        self.lookup = TierLookup(self.tiers, self.tier_names, self.metrics)
        self._paths = PathMemory(path_memory)
        self._settled_tick = -1  # requests are only freed by calls that advance the tick
        self._stored = StoredMemory(stored_memory, stored_max_age_s)
        warn_if_unseeded(manager.config.hash_seed, self.tiers)
        self._unit_flops = manager.spec.flops.prefill_flops(0, manager.unit)
        self._warned: set[str] = set()
        self._chained = manager.index.on_evict
        manager.index.on_evict = self._on_evict
        self._host_hooks: list[tuple[HostTier, Callable[..., None] | None]] = []
        for i, tier in enumerate(self.tiers):
            if isinstance(tier, HostTier):
                self._host_hooks.append((tier, tier.on_evict))
                tier.on_evict = self._spill_hook(i, tier.on_evict)

    # ------------------------------------------------------------------ public API
    def track(self, request_id: str) -> None:
        """Remember a live request's path for the demotion rule (``prefetch`` does this)."""
        req = self.manager.requests.get(request_id)
        if req is not None:
            self._paths.track(req)

    def prefetch(self, request_id: str) -> LoadPlan | None:
        """Load what the tiers hold of the request's prefix past the device hit.

        Call after ``add_request`` and before the first ``allocate``. Returns the plan
        of what was loaded and registered, or ``None`` when nothing was gained (full device
        hit, nothing in the tiers, a failure before any complete snapshot). Never raises
        for tier trouble: misses, metrics and a warning instead.
        """
        self.metrics.prefetch_calls += 1
        req = self.manager.requests.get(request_id)
        if req is None or req.allocated:
            return None
        self._paths.track(req)
        work = _Work()
        try:
            return self._prefetch(req, work, time.perf_counter())
        except Exception as exc:  # never into the engine: the request just misses
            self.metrics.prefetch_errors += 1
            self._warn("prefetch", exc)
            return None
        finally:
            self._give_back(work)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for every tier's queued writes; ``True`` if none is left."""
        return all([t.flush(timeout_s) for t in self.tiers])

    def stats(self) -> dict[str, object]:
        """The coordinator's metrics plus every tier's stats, JSON-friendly."""
        out = self.metrics.as_dict()
        out["tiers"] = {n: t.stats().as_dict() for n, t in zip(self.tier_names, self.tiers)}
        return out

    def close(self) -> None:
        """Detach from the index and the host tiers (the tiers stay open: they are the
        caller's). Queued writes are flushed first."""
        self.flush()
        if self.manager.index.on_evict == self._on_evict:
            self.manager.index.on_evict = self._chained
        for tier, previous in self._host_hooks:
            tier.on_evict = previous
        self._host_hooks = []

    # ------------------------------------------------------------------ demotion
    def _on_evict(self, kind: str, node: UnitHandle, nbytes: int) -> None:
        if self._chained is not None:
            self._chained(kind, node, nbytes)
        try:
            self._demote(kind, node)
        except Exception as exc:  # a failed demotion is a later miss, never an engine error
            self.metrics.demote_errors += 1
            self._warn("demote", exc)

    def _demote(self, kind: str, node: UnitHandle) -> None:
        pol, met = self.policy, self.metrics
        if kind == "state":
            if not pol.snapshots:
                met.demote_skipped_policy += 1
                return
            key = self.keys.snap(node.tenant, node.digest)
        else:
            if not self.io.groups:
                return  # a pure-state model's KV units carry no bytes
            if not self._keep_kv(node):
                met.demote_skipped_policy += 1
                return
            key = self.keys.kv(node.tenant, node.digest)
        if self._is_stored(key):
            met.demote_skipped_stored += 1
            return
        if kind == "state":
            entry = self.io.read_snapshot(node.snap, node.depth)
            value = self._priority(node.snap_flops, self.io.state_span, node.snap_hits)
        else:
            assert node.pages is not None
            entry = self.io.read_kv(node.pages, node.depth)
            value = self._priority(node.kv_flops, self.io.kv_bytes, node.kv_hits)
        if not self.tiers[0].put(key, entry, ttl_s=pol.ttl_s, priority=value):
            met.demote_dropped += 1
            return
        self._mark_stored(key, loaded=False)
        met.demoted_bytes += entry.nbytes
        if kind == "state":
            met.demoted_snapshots += 1
        else:
            met.demoted_kv += 1

    def _keep_kv(self, node: UnitHandle) -> bool:
        """The KV half of the demotion rule (see :mod:`.offload_policy`)."""
        pol = self.policy
        if pol.kv == "all" or node.snap >= 0 or not self.manager.has_state:
            return True  # without state every KV prefix is usable on its own
        if pol.min_kv_hits and node.kv_hits >= pol.min_kv_hits:
            return True
        if self._settled_tick != self.manager.tick:  # once per burst of evictions
            self._settled_tick = self.manager.tick
            self._paths.settle(self.manager.requests, self._has_snapshot)
        covered = self._paths.covered(node.digest)
        return covered is None or covered

    def _has_snapshot(self, tenant: str | None, digest: bytes) -> bool:
        node = self.manager.index.handles.get(digest)
        if node is not None and node.snap >= 0:
            return True
        return self._is_stored(self.keys.snap(tenant, digest))

    def _priority(self, flops: float, nbytes: int, hits: int) -> float:
        if self.policy.priority == "lru":
            return 0.0
        per_byte_of_kv = self._unit_flops / max(self.io.kv_bytes, 1)
        return (hits + 1) * flops / max(nbytes, 1) / max(per_byte_of_kv, 1e-30)

    def _spill_hook(
        self, i: int, previous: Callable[..., None] | None
    ) -> Callable[[EntryKey, Entry, float | None, float], None]:
        """HostTier ``i``'s eviction hook: pass the victim to tier ``i + 1``."""

        def spill(key: EntryKey, entry: Entry, ttl_left: float | None, priority: float) -> None:
            if previous is not None:
                previous(key, entry, ttl_left, priority)
            below = self.tiers[i + 1] if i + 1 < len(self.tiers) else None
            if below is not None and below.put(key, entry, ttl_s=ttl_left, priority=priority):
                self.metrics.spilled_entries += 1
                return
            self._stored.forget(key)  # gone from every tier: demote it again next time

        return spill

    def _ttl_for(self, tenant: str) -> float | None:
        if self.policy.ttl_s is not None:
            return self.policy.ttl_s
        limits = getattr(self.tiers[0], "limits", None)
        return None if limits is None else limits.ttl_for(tenant)

    def _mark_stored(self, key: EntryKey, *, loaded: bool) -> None:
        """Remember that a tier holds ``key`` until its TTL. A loaded entry's remaining
        TTL is unknown: with TTLs it is not remembered, so evicting it re-demotes it (and
        the put refreshes its TTL)."""
        ttl = self._ttl_for(key.tenant)
        if not (loaded and ttl is not None):
            self._stored.remember(key, ttl)

    def _is_stored(self, key: EntryKey) -> bool:
        return self._stored.known(key)

    # ------------------------------------------------------------------ prefetch
    def _prefetch(self, req: Request, work: _Work, t0: float) -> LoadPlan | None:
        m = self.manager
        digests = req.hasher.digests
        max_units = min((req.num_tokens - 1) // m.unit, len(digests))
        kv_units, snap_units, snap_node = m.index.walk(digests, max_units)
        dev_hit = snap_units if m.has_state else kv_units
        if dev_hit >= max_units:
            return None
        probe = self._probe(req.tenant, digests, dev_hit, max_units)
        target = probe.target(m.has_state, dev_hit)
        if target <= dev_hit:
            return None
        self._hold(work, digests, target, probe, snap_node)
        if probe.snaps[-1:] and probe.snaps[-1][1] != DEVICE:  # the target's state must load
            slot = m.index.alloc_slot()
            work.slot = -1 if slot is None else slot
        limit = self._load_kv(req, work, probe, target)
        final = limit
        if m.has_state:
            final = self._load_snapshot(req, work, probe, limit, dev_hit)
        if final <= dev_hit:
            return None
        return self._register(req, work, probe, dev_hit, final, target, t0)

    def _probe(
        self, tenant: str | None, digests: list[bytes], dev_hit: int, max_units: int
    ) -> _Probe:
        """Walk units past the device hit in doubling windows, one ``contains_many`` per
        tier and window, until a unit's KV is nowhere."""
        index = self.manager.index
        handles = index.handles
        has_kv_on_device = [False] * max_units  # stranded runs past the hit count too
        for run, end in index.chain_holds(digests, 0, max_units):
            has_kv_on_device[run.first : run.first + end] = [True] * end
        has_state, has_kv = self.manager.has_state, bool(self.io.groups)
        probe = _Probe(reach=dev_hit)
        pos, step = dev_hit, self.probe_batch
        while pos < max_units:
            end = min(max_units, pos + step)
            keys: list[EntryKey] = []
            what: list[tuple[int, bool]] = []
            dev_snap: set[int] = set()
            for i in range(pos, end):
                node = handles.get(digests[i])
                if not has_kv_on_device[i]:
                    if has_kv:
                        keys.append(self.keys.kv(tenant, digests[i]))
                        what.append((i, False))
                    else:
                        probe.bare.append(i)
                if has_state:
                    if node is not None and node.snap >= 0:
                        dev_snap.add(i)
                    else:
                        keys.append(self.keys.snap(tenant, digests[i]))
                        what.append((i, True))
            found = self.lookup.locate(keys)
            self._stored.forget_all(k for k, src in zip(keys, found, strict=True) if src is None)
            kv_at: dict[int, int | None] = {}
            snap_at: dict[int, int | None] = {}
            for (i, is_snap), src in zip(what, found, strict=True):
                (snap_at if is_snap else kv_at)[i] = src
            for i in range(pos, end):
                src = kv_at.get(i, DEVICE)
                if src is None:  # past a hole: what we stored is as likely lost
                    self._stored.forget_all(self._path_keys(tenant, digests[i:]))
                    return probe
                if i in kv_at:
                    probe.kv_src[i] = src
                probe.reach = i + 1
                if has_state:
                    s = DEVICE if i in dev_snap else snap_at.get(i)
                    if s is not None:
                        probe.snaps.append((i + 1, s))
            pos, step = end, step * 2
        return probe

    def _path_keys(self, tenant: str | None, digests: list[bytes]) -> list[EntryKey]:
        return [k for d in digests for k in (self.keys.kv(tenant, d), self.keys.snap(tenant, d))]

    def _hold(
        self,
        work: _Work,
        digests: list[bytes],
        target: int,
        probe: _Probe,
        snap_node: UnitHandle | None,
    ) -> None:
        """Keep the device part of the path from being evicted by our own allocations."""
        index = self.manager.index
        work.held = index.chain_holds(digests, 0, target)
        index.hold_runs(work.held)
        pins = [
            index.handles[digests[b - 1]] for b, src in probe.snaps if src == DEVICE and b <= target
        ]
        if snap_node is not None:
            pins.append(snap_node)
        for node in pins:
            index.pin_snapshot(node)
            work.pinned.append(node)

    def _load_kv(self, req: Request, work: _Work, probe: _Probe, target: int) -> int:
        """Load the KV the tiers hold below ``target``; returns ``limit``: units
        ``[0, limit)`` are complete (on the device or loaded into private pages)."""
        units = sorted(i for i in probe.kv_src if i < target)
        digests = req.hasher.digests
        per_batch = max(1, self.load_batch_bytes // max(self.io.kv_bytes, 1))
        room = self._quota_room(req.tenant)
        unit_bytes = self.manager.index.node_kv_bytes
        for start in range(0, len(units), per_batch):
            batch = units[start : start + per_batch]
            keys = [self.keys.kv(req.tenant, digests[i]) for i in batch]
            got = self.lookup.fetch(keys, [probe.kv_src[i] for i in batch])
            try:
                for i, key, (entry, t) in zip(batch, keys, got, strict=True):
                    if entry is None or not self._valid(entry, key, t, i, kv=True):
                        return i
                    if room is not None and work.planned_bytes + unit_bytes > room:
                        return i
                    pages = self._alloc_pages()
                    if pages is None:
                        return i
                    work.pages[i] = pages
                    work.planned_bytes += unit_bytes
                    self.io.write_kv(pages, entry)
                    work.count(self.tier_names[t])
            finally:
                self.io.synchronize()  # the fetched entries must outlive their copies
        return target

    def _load_snapshot(
        self, req: Request, work: _Work, probe: _Probe, limit: int, dev_hit: int
    ) -> int:
        """Load the deepest snapshot whose KV is complete; returns its boundary (units)."""
        index = self.manager.index
        room = self._quota_room(req.tenant)
        for b, src in reversed([(b, s) for b, s in probe.snaps if b <= limit]):
            if src == DEVICE:
                return b
            if room is not None and work.planned_bytes + index.snap_bytes > room:
                continue
            key = self.keys.snap(req.tenant, req.hasher.digests[b - 1])
            entry, t = self.lookup.fetch([key], [src])[0]
            if entry is None or not self._valid(entry, key, t, b - 1, kv=False):
                continue
            if work.slot < 0:
                slot = index.alloc_slot()
                if slot is None:
                    continue
                work.slot = slot
            work.snap_loaded = True
            try:
                self.io.write_snapshot(work.slot, entry)
            finally:
                self.io.synchronize()
            work.count(self.tier_names[t])
            return b
        return dev_hit

    def _register_loaded(
        self, req: Request, work: _Work, bare: set[int], dev_hit: int, final: int
    ) -> list[int]:
        """Register the loaded (or bare) units below ``final``, each consecutive stretch as
        one run (held and walked as one); returns the units whose KV was loaded."""
        index, digests, groups = self.manager.index, req.hasher.digests, len(self.manager.groups)
        loaded: list[int] = []
        i = dev_hit
        while i < final:
            if i not in work.pages and i not in bare:
                i += 1
                continue  # KV on the device (held)
            j = i
            while j < final and (j in work.pages or j in bare):
                j += 1
            pages = {u: work.pages.pop(u, None) or () for u in range(i, j)}
            tables = [{u: p[g] for u, p in pages.items()} for g in range(groups)]
            got = index.register_kv_run(digests, i, j, req.tenant, tables, self._unit_flops)
            assert got is not None and got[1] == j - i, "loaded a unit that has KV on the device"
            work.held.append(got[0])  # registered with one reference: released below
            loaded += [u for u, p in pages.items() if p]
            i = j
        return loaded

    def _register(
        self,
        req: Request,
        work: _Work,
        probe: _Probe,
        dev_hit: int,
        final: int,
        target: int,
        t0: float,
    ) -> LoadPlan:
        """Make the loaded units below ``final`` (and its snapshot) cached entries."""
        m, met = self.manager, self.metrics
        index, digests, unit = m.index, req.hasher.digests, m.unit
        m.tick += 1
        tick = m.tick
        loaded = self._register_loaded(req, work, set(probe.bare), dev_hit, final)
        nbytes = len(loaded) * self.io.kv_bytes
        snapshot = None
        if work.snap_loaded:
            node = index.unit(digests, final - 1)
            assert node is not None
            index.register_snapshot(node, work.slot, self._snapshot_flops(dev_hit, final), tick)
            work.slot, work.snap_loaded = -1, False
            snapshot = final * unit
            nbytes += self.io.state_span
            met.loaded_snapshots += 1
        holds = sorted(work.held, key=lambda h: h[0].first)  # released deepest first
        work.held = []
        index.release_runs(holds, tick)
        met.loaded_kv += len(loaded)
        met.loaded_bytes += nbytes
        met.prefetch_hits += 1
        met.prefetch_partial += final < target
        met.prefetch_hit_tokens += (final - dev_hit) * unit
        return LoadPlan(
            request_id=req.id,
            device_hit_tokens=dev_hit * unit,
            hit_tokens=final * unit,
            planned_tokens=target * unit,
            kv_units=tuple(loaded),
            snapshot_boundary=snapshot,
            bytes_loaded=nbytes,
            entries_by_tier=dict(work.by_tier),
            seconds=time.perf_counter() - t0,
        )

    def _snapshot_flops(self, prev: int, final: int) -> float:
        """The manager's value of a snapshot: marginal prefill FLOPs, capped at KV's per byte."""
        unit, index = self.manager.unit, self.manager.index
        flops = self.manager.spec.flops.prefill_flops(prev * unit, final * unit)
        if index.node_kv_bytes:
            flops = min(flops, self._unit_flops * index.snap_bytes / index.node_kv_bytes)
        return flops

    def _give_back(self, work: _Work) -> None:
        """Free whatever a prefetch still holds (after registration: only the discards)."""
        m = self.manager
        for pages in work.pages.values():
            for p in pages:
                m.arena.free_page(p)
            self.metrics.load_discarded += 1
        work.pages.clear()
        if work.slot >= 0:
            m.arena.free_slot(work.slot)
            self.metrics.load_discarded += work.snap_loaded
            work.slot, work.snap_loaded = -1, False
        if work.held:
            m.index.release_runs(work.held, m.tick)
            work.held = []
        for node in work.pinned:
            m.index.unpin_snapshot(node, m.tick)
        work.pinned = []

    # ------------------------------------------------------------------ helpers
    def _valid(self, entry: Entry, key: EntryKey, t: int, depth: int, *, kv: bool) -> bool:
        """Whether a tier's entry fits this layout; a misfit is deleted (fail closed)."""
        ok = self.io.kv_entry_ok(entry, depth) if kv else self.io.snapshot_entry_ok(entry, depth)
        if not ok:
            self.metrics.load_invalid += 1
            self.tiers[t].delete(key)
            self._stored.forget(key)
        else:
            self._mark_stored(key, loaded=True)
        return ok

    def _alloc_pages(self) -> tuple[int, ...] | None:
        """One page per attention group, evicting as needed; ``None`` if memory is full."""
        index, got = self.manager.index, []
        for _ in self.io.groups:
            p = index.alloc_page()
            if p is None:
                for q in got:
                    self.manager.arena.free_page(q)
                return None
            got.append(p)
        return tuple(got)

    def _quota_room(self, tenant: str | None) -> int | None:
        """Bytes the tenant may still register on the device under the manager's quotas."""
        quotas = self.manager.config.tenant_quotas
        if not quotas:
            return None
        quota = quotas.get(tenant if tenant is not None else "", quotas.get("*"))
        if quota is None:
            return None
        return quota - self.manager.index.tenant_bytes.get(tenant, 0)

    def _warn(self, what: str, exc: Exception) -> None:
        kind = f"{what}:{type(exc).__name__}"
        if kind in self._warned:
            _log.debug("offload %s failed: %r", what, exc)
            return
        self._warned.add(kind)
        _log.warning("offload %s failed (%r); counted, the engine goes on", what, exc, exc_info=exc)
