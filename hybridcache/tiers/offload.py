"""OffloadCoordinator: the manager's device cache over a stack of lower tiers.

Two paths, both driven from the engine's thread:

* **Demotion** (device -> first tier). The coordinator's engine port is built with an
  observer of the event stream (:class:`~hybridcache.events.EventLog`): a ``removed``
  event reaches it inside the cache call, right after the entry's pages or slot were freed
  and before anything can write them, and the bytes are copied out there (one ``copy_``
  per piece into fresh host memory, pinned on CUDA) and handed to the first tier's
  non-blocking ``put``. Taking the events out after the call would be too late: the call
  that evicts an entry may hand its pages to the request it allocates for, and an engine
  (the reference runner, vLLM's model runner) writes them right after the call returns
  with nothing in between to drain a queue. :class:`~hybridcache.tiers.offload_policy.DemotionPolicy` decides what
  is worth it (snapshots and the KV below them; not a never-hit, request-unique tail). A
  :class:`~hybridcache.tiers.HostTier` in the stack spills its own victims to the next tier.
* **Prefetch** (tiers -> device), called by the engine after ``add_request`` and before the
  first ``allocate``. It finds the deepest boundary past the device hit such that every
  unit below it has KV (on the device or in a tier) and a snapshot sits at it, probing
  with batched ``contains_many`` in doubling windows (O(log n) round trips); then holds the
  device part of that path, allocates pages and a slot through the port's
  :class:`~hybridcache.port_import.PrefixImport` (evicting, and so demoting, as needed),
  copies the bytes in, and registers them as cached, evictable entries: the manager's
  ordinary ``match`` now hits. It returns a
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
from collections.abc import Sequence
from dataclasses import dataclass, field

from hybridcache.events import REMOVED, CacheEvent
from hybridcache.kernels.storage import ArenaStorage
from hybridcache.manager import HybridCacheManager
from hybridcache.policies.value import greedy_dual_priority
from hybridcache.port import EnginePort, RequestView
from hybridcache.port_import import PrefixImport
from hybridcache.sliding import SLIDING
from hybridcache.tiers.base import Tier
from hybridcache.tiers.errors import TierConfigError
from hybridcache.tiers.format import Entry
from hybridcache.tiers.host import EvictObserver, HostTier
from hybridcache.tiers.keys import EntryKey
from hybridcache.tiers.offload_io import DeviceIO, UnitKeys, layout_fingerprint
from hybridcache.tiers.offload_lookup import TierLookup
from hybridcache.tiers.offload_plan import LoadPlan, OffloadMetrics
from hybridcache.tiers.offload_policy import DemotionPolicy, PathMemory
from hybridcache.tiers.offload_stored import StoredMemory
from hybridcache.tiers.offload_windows import (
    device_window_end,
    device_window_ends,
    full_attention_groups,
    window_reach,
)
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
    """What a prefetch loaded so far; the pages, slot and holds are the import's."""

    imp: PrefixImport
    snap_loaded: bool = False  # the import's slot holds a loaded snapshot
    planned_bytes: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)

    def count(self, tier_name: str) -> None:
        self.by_tier[tier_name] = self.by_tier.get(tier_name, 0) + 1


class OffloadCoordinator:
    """Demotes evicted device entries into ``tiers`` and loads prefixes back on a miss.

    Args:
        manager: the engine's manager; the coordinator drives it through its own
            :class:`~hybridcache.port.EnginePort` (built with the removal observer), so an
            engine's own port, ``take_events`` and subscriptions are untouched.
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
        if probe_batch <= 0 or load_batch_bytes <= 0:
            raise TierConfigError("probe_batch and load_batch_bytes must be positive")
        port = EnginePort(manager, record_events=False)
        if storage.layout != port.layout:
            raise TierConfigError("OffloadCoordinator: storage was built for another layout")
        self.storage = storage
        self.tiers = list(tiers)
        self.policy = policy or DemotionPolicy()
        self.probe_batch = probe_batch
        self.load_batch_bytes = load_batch_bytes
        self.tier_names = [f"{i}:{type(t).__name__}" for i, t in enumerate(self.tiers)]
        self.port = port = EnginePort(manager, record_events=False, observer=self._on_event)
        self.fingerprint = layout_fingerprint(port.spec, port.layout, port.unit)
        self.keys = UnitKeys(self.fingerprint)
        # A unit's KV entry: its full-attention pages (sliding pages are never stored;
        # see offload_windows), and the device windows a loaded end must have.
        self.io = DeviceIO(storage, full_attention_groups(port.spec))
        self._window_reach = window_reach(port.spec, port.unit)
        self.metrics = OffloadMetrics()
        self.lookup = TierLookup(self.tiers, self.tier_names, self.metrics)
        self._paths = PathMemory(path_memory)
        self._settled_step = -1  # requests are only freed by calls that advance the step
        self._stored = StoredMemory(stored_memory, stored_max_age_s)
        warn_if_unseeded(port.config.hash_seed, self.tiers)
        self._unit_flops = port.spec.flops.prefill_flops(0, port.unit)
        self._warned: set[str] = set()
        self._spills: list[tuple[HostTier, EvictObserver]] = []
        for i, tier in enumerate(self.tiers):
            if isinstance(tier, HostTier):
                spill = self._spill_to(i + 1)
                tier.add_evict_observer(spill)
                self._spills.append((tier, spill))

    # ------------------------------------------------------------------ public API
    def track(self, request_id: str) -> None:
        """Remember a live request's path for the demotion rule (``prefetch`` does this)."""
        req = self.port.request(request_id)
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
        req = self.port.request(request_id)
        if req is None or req.allocated:
            return None
        self._paths.track(req)
        with self.port.import_prefix(request_id) as imp:
            work = _Work(imp)
            try:
                return self._prefetch(req, work, time.perf_counter())
            except Exception as exc:  # never into the engine: the request just misses
                self.metrics.prefetch_errors += 1
                self._warn("prefetch", exc)
                return None
            finally:  # what was not registered is freed by the import
                self.metrics.load_discarded += len(imp.pages) + (work.snap_loaded and imp.slot >= 0)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for every tier's queued writes; ``True`` if none is left."""
        return all([t.flush(timeout_s) for t in self.tiers])

    def stats(self) -> dict[str, object]:
        """The coordinator's metrics plus every tier's stats, JSON-friendly."""
        out = self.metrics.as_dict()
        out["tiers"] = {n: t.stats().as_dict() for n, t in zip(self.tier_names, self.tiers)}
        return out

    def close(self) -> None:
        """Detach from the event stream and the host tiers (the tiers stay open: they are
        the caller's). Queued writes are flushed first."""
        self.flush()
        self.port.close()
        for tier, spill in self._spills:
            tier.remove_evict_observer(spill)
        self._spills = []

    # ------------------------------------------------------------------ demotion
    def _on_event(self, event: CacheEvent) -> None:
        """The port's observer: runs inside the evicting call, bytes still intact."""
        if event.action != REMOVED:
            return
        try:
            self._demote(event)
        except Exception as exc:  # a failed demotion is a later miss, never an engine error
            self.metrics.demote_errors += 1
            self._warn("demote", exc)

    def _demote(self, ev: CacheEvent) -> None:
        pol, met = self.policy, self.metrics
        digest = ev.digests[0]
        if ev.kind == SLIDING:  # not a unit's KV, and only the device's window cache uses it
            met.demote_skipped_sliding += 1
            return
        if ev.kind == "state":
            if not pol.snapshots:
                met.demote_skipped_policy += 1
                return
            key = self.keys.snap(ev.tenant, digest)
        else:
            if not self.io.groups:
                return  # a pure-state model's KV units carry no bytes
            if not self._keep_kv(ev):
                met.demote_skipped_policy += 1
                return
            key = self.keys.kv(ev.tenant, digest)
        if self._is_stored(key):
            met.demote_skipped_stored += 1
            return
        if ev.kind == "state":
            entry = self.io.read_snapshot(ev.locations[0], ev.depth)
            value = self._priority(ev.flops, self.io.state_span, ev.hits)
        else:
            entry = self.io.read_kv(ev.locations[0], ev.depth)
            value = self._priority(ev.flops, self.io.kv_bytes, ev.hits)
        if not self.tiers[0].put(key, entry, ttl_s=pol.ttl_s, priority=value):
            met.demote_dropped += 1
            return
        self._mark_stored(key, loaded=False)
        met.demoted_bytes += entry.nbytes
        if ev.kind == "state":
            met.demoted_snapshots += 1
        else:
            met.demoted_kv += 1

    def _keep_kv(self, ev: CacheEvent) -> bool:
        """The KV half of the demotion rule (see :mod:`.offload_policy`)."""
        pol, port = self.policy, self.port
        if pol.kv == "all" or not port.has_state or port.has_snapshot(ev.digests[0]):
            return True  # without state every KV prefix is usable on its own
        if pol.min_kv_hits and ev.hits >= pol.min_kv_hits:
            return True
        if self._settled_step != port.step_count:  # once per burst of evictions
            self._settled_step = port.step_count
            self._paths.settle(port.request, self._has_snapshot)
        covered = self._paths.covered(ev.digests[0])
        return covered is None or covered

    def _has_snapshot(self, tenant: str | None, digest: bytes) -> bool:
        if self.port.has_snapshot(digest):
            return True
        return self._is_stored(self.keys.snap(tenant, digest))

    def _priority(self, flops: float, nbytes: int, hits: int) -> float:
        """The tier's rank of an entry: the core's GreedyDual priority (clock 0: a tier
        ages by LRU among equals), normalised so one never-hit unit of KV is 1.0.

        The frequency passed is ``hits + 1``, the entry's uses counting the computation
        that produced it: the core's hit term ``max(hits, 1)`` ranks a device entry reused
        once like one never reused, but for a tier that reuse is the evidence the demotion
        rule (``min_kv_hits=1``) keeps it on, so the tier must rank it above a never-hit one.
        """
        if self.policy.priority == "lru":
            return 0.0
        per_byte_of_kv = self._unit_flops / max(self.io.kv_bytes, 1)
        per_byte = 1.0 / (max(nbytes, 1) * max(per_byte_of_kv, 1e-30))
        return greedy_dual_priority(0.0, hits + 1, flops, per_byte)

    def _spill_to(self, below: int) -> EvictObserver:
        """A HostTier's eviction observer: pass the victim to tier ``below`` (if any)."""

        def spill(key: EntryKey, entry: Entry, ttl_left: float | None, priority: float) -> None:
            tier = self.tiers[below] if below < len(self.tiers) else None
            if tier is not None and tier.put(key, entry, ttl_s=ttl_left, priority=priority):
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
    def _prefetch(self, req: RequestView, work: _Work, t0: float) -> LoadPlan | None:
        port = self.port
        digests = list(req.digests)
        max_units = min((req.num_tokens - 1) // port.unit, len(digests))
        dev = port.device_prefix(digests, max_units)
        dev_hit = dev.snapshot_units if port.has_state else dev.kv_units
        if dev_hit >= max_units:
            return None
        probe = self._probe(req.tenant, digests, dev_hit, max_units, dev.has_kv)
        if self._window_reach:
            self._keep_device_windows(probe, dev_hit, dev.has_kv)
        target = probe.target(port.has_state, dev_hit)
        if target <= dev_hit:
            return None
        imp = work.imp
        imp.hold(target, [b for b, src in probe.snaps if src == DEVICE and b <= target])
        if probe.snaps[-1:] and probe.snaps[-1][1] != DEVICE:  # the target's state must load
            imp.alloc_slot()  # reserved before the KV, so a full arena still fits it
        limit = self._load_kv(req, digests, work, probe, target)
        final = limit
        if port.has_state:
            final = self._load_snapshot(req, digests, work, probe, limit, dev_hit)
        if final <= dev_hit:
            return None
        return self._register(req, work, probe, dev_hit, final, target, t0)

    def _keep_device_windows(self, probe: _Probe, dev_hit: int, has_kv_on_device: list[bool]) -> None:
        """Lower the probe to the ends a hit could use: the window before each must be on
        the device (see :mod:`.offload_windows`); a load past them would only be refused."""
        reach = self._window_reach
        if self.port.has_state:
            ok = device_window_ends([b for b, _ in probe.snaps], reach, has_kv_on_device)
            dropped = sum(1 for b, src in probe.snaps if b not in ok)
            probe.snaps = [(b, src) for b, src in probe.snaps if b in ok]
        else:
            end = device_window_end(probe.reach, dev_hit, reach, has_kv_on_device)
            dropped = probe.reach - end
            probe.reach = end
        self.metrics.prefetch_window_limited += dropped > 0

    def _probe(
        self,
        tenant: str | None,
        digests: list[bytes],
        dev_hit: int,
        max_units: int,
        has_kv_on_device: list[bool],
    ) -> _Probe:
        """Walk units past the device hit in doubling windows, one ``contains_many`` per
        tier and window, until a unit's KV is nowhere (stranded device runs count)."""
        has_state, has_kv = self.port.has_state, bool(self.io.groups)
        probe = _Probe(reach=dev_hit)
        pos, step = dev_hit, self.probe_batch
        while pos < max_units:
            end = min(max_units, pos + step)
            keys: list[EntryKey] = []
            what: list[tuple[int, bool]] = []
            dev_snap: set[int] = set()
            for i in range(pos, end):
                if not has_kv_on_device[i]:
                    if has_kv:
                        keys.append(self.keys.kv(tenant, digests[i]))
                        what.append((i, False))
                    else:
                        probe.bare.append(i)
                if has_state:
                    if self.port.has_snapshot(digests[i]):
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

    def _load_kv(
        self, req: RequestView, digests: list[bytes], work: _Work, probe: _Probe, target: int
    ) -> int:
        """Load the KV the tiers hold below ``target``; returns ``limit``: units
        ``[0, limit)`` are complete (on the device or loaded into the import's pages)."""
        units = sorted(i for i in probe.kv_src if i < target)
        per_batch = max(1, self.load_batch_bytes // max(self.io.kv_bytes, 1))
        room = self._quota_room(req.tenant)
        unit_bytes = self.port.unit_kv_bytes
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
                    pages = work.imp.alloc_unit_pages(i)  # evictions demote before we write
                    if pages is None:
                        return i
                    work.planned_bytes += unit_bytes
                    self.io.write_kv(pages, entry)
                    work.count(self.tier_names[t])
            finally:
                self.io.synchronize()  # the fetched entries must outlive their copies
        return target

    def _load_snapshot(
        self,
        req: RequestView,
        digests: list[bytes],
        work: _Work,
        probe: _Probe,
        limit: int,
        dev_hit: int,
    ) -> int:
        """Load the deepest snapshot whose KV is complete; returns its boundary (units)."""
        room = self._quota_room(req.tenant)
        snap_bytes = self.port.snapshot_bytes
        for b, src in reversed([(b, s) for b, s in probe.snaps if b <= limit]):
            if src == DEVICE:
                return b
            if room is not None and work.planned_bytes + snap_bytes > room:
                continue
            key = self.keys.snap(req.tenant, digests[b - 1])
            entry, t = self.lookup.fetch([key], [src])[0]
            if entry is None or not self._valid(entry, key, t, b - 1, kv=False):
                continue
            slot = work.imp.alloc_slot()
            if slot < 0:
                continue
            work.snap_loaded = True
            try:
                self.io.write_snapshot(slot, entry)
            finally:
                self.io.synchronize()
            work.count(self.tier_names[t])
            return b
        return dev_hit

    def _register(
        self,
        req: RequestView,
        work: _Work,
        probe: _Probe,
        dev_hit: int,
        final: int,
        target: int,
        t0: float,
    ) -> LoadPlan:
        """Make the loaded units below ``final`` (and its snapshot) cached entries."""
        met, unit = self.metrics, self.port.unit
        flops = self._snapshot_flops(dev_hit, final) if work.snap_loaded else None
        loaded = work.imp.register(final, probe.bare, flops)
        nbytes = len(loaded) * self.io.kv_bytes
        snapshot = None
        if work.snap_loaded:
            work.snap_loaded = False
            snapshot = final * unit
            nbytes += self.io.state_span
            met.loaded_snapshots += 1
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
        port = self.port
        flops = port.spec.flops.prefill_flops(prev * port.unit, final * port.unit)
        if port.unit_kv_bytes:
            flops = min(flops, self._unit_flops * port.snapshot_bytes / port.unit_kv_bytes)
        return flops

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

    def _quota_room(self, tenant: str | None) -> int | None:
        """Bytes the tenant may still register on the device under the manager's quotas."""
        quotas = self.port.config.tenant_quotas
        if not quotas:
            return None
        quota = quotas.get(tenant if tenant is not None else "", quotas.get("*"))
        if quota is None:
            return None
        return quota - self.port.tenant_bytes(tenant)

    def _warn(self, what: str, exc: Exception) -> None:
        kind = f"{what}:{type(exc).__name__}"
        if kind in self._warned:
            _log.debug("offload %s failed: %r", what, exc)
            return
        self._warned.add(kind)
        _log.warning("offload %s failed (%r); counted, the engine goes on", what, exc, exc_info=exc)
