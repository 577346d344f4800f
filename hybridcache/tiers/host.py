"""HostTier: a bounded store of entries in host memory (pinned when CUDA is present).

The first tier below the device: large (hundreds of GiB of DRAM), fast (a memcpy away), but
bounded. Design choices and why:

* **One contiguous buffer per entry**, pieces at 64-byte aligned offsets, pinned with CUDA so
  that a load is a single async host-to-device copy per piece from the stored bytes, with no
  staging copy. ``get`` returns views of that buffer (zero-copy): numpy pieces are read-only,
  torch pieces must be treated as read-only (torch has no read-only tensors).
* **Eviction** takes the lowest ``priority`` first and, among equals, the least recently used
  entry: with the default priority it is plain LRU; a manager can pass a value score
  (prefill FLOPs saved per byte, say) to keep valuable snapshots longer.
* **Per-tenant quotas** evict within the tenant first, so one tenant's burst never pushes
  out another tenant's entries; an entry larger than its quota is refused.
* **TTLs** (per tenant, or per put for sessions) expire lazily on every operation through a
  heap of deadlines, so there is no background thread.
* **Spilling**: ``on_evict(key, entry, ttl_left_s, priority)``, if given, receives every
  entry evicted for room (capacity or quota; not expiry, delete or replacement), after the
  lock is released and in the thread whose put evicted it, so a stack of tiers can demote
  host memory's victims to Redis instead of losing them. More observers can be registered
  with :meth:`HostTier.add_evict_observer` (the offload coordinator's spill). The entry's pieces are zero-copy
  views of the evicted buffer, which they keep alive.

The byte budget counts what the tier holds (aligned payload + header). Returned views keep
an evicted entry's buffer alive until the caller drops them; that memory is the caller's.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hybridcache.tiers.auth import EntryAuth
from hybridcache.tiers.base import Counters, Tier, TierStats, check_key, check_keys, check_put
from hybridcache.tiers.errors import EntryFormatError, TierConfigError
from hybridcache.tiers.format import EncodedEntry, Entry, Header, decode, encode, parse_header
from hybridcache.tiers.keys import EntryKey
from hybridcache.tiers.limits import TenantLimits

_ALIGN = 64
_log = logging.getLogger("hybridcache.tiers.host")

#: ``(key, entry, ttl_left_s, priority)`` of an entry the tier evicted for room.
EvictObserver = Callable[[EntryKey, Entry, float | None, float], None]


@dataclass(eq=False)
class _Slot:
    key: EntryKey
    header: Header
    storage: object  # np.ndarray or pinned torch.Tensor: keeps the memory alive
    view: memoryview  # read-only bytes of storage
    offsets: tuple[tuple[int, int], ...]
    size: int
    payload: int
    priority: float
    gen: int
    tick: int
    expires_at: float | None


class HostTier(Tier):
    """Entries in host memory under a byte budget, LRU / priority eviction, quotas and TTLs.

    Args:
        capacity_bytes: most bytes held (payload, alignment and headers).
        limits: per-tenant TTLs and byte quotas.
        pin_memory: allocate pinned buffers; ``None`` pins when CUDA is available.
        verify_reads: check chunk MACs on every ``get`` (off by default: the memory
            is the tier's own; turn on to catch callers writing into returned tensors).
        clock: monotonic seconds; injectable so TTL tests need no sleeping.
        on_evict: called with ``(key, entry, ttl_left_s, priority)`` for each entry evicted
            to make room (see the module notes); its exceptions are logged, never raised.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        limits: TenantLimits | None = None,
        pin_memory: bool | None = None,
        verify_reads: bool = False,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[EntryKey, Entry, float | None, float], None] | None = None,
    ) -> None:
        if (
            isinstance(capacity_bytes, bool)
            or not isinstance(capacity_bytes, int)
            or capacity_bytes < 0
        ):
            raise TierConfigError(
                f"capacity_bytes: must be a non-negative int, got {capacity_bytes!r}"
            )
        self.capacity_bytes = capacity_bytes
        self.limits = limits or TenantLimits()
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self.verify_reads = verify_reads
        self._clock = clock
        self.on_evict = on_evict
        self._evict_observers: list[EvictObserver] = []
        self._lock = threading.RLock()
        self._slots: dict[EntryKey, _Slot] = {}
        self._used = 0
        self._tenant_used: dict[str, int] = {}
        self._lru: list[tuple[float, int, EntryKey]] = []
        self._tenant_lru: dict[str, list[tuple[float, int, EntryKey]]] = {}
        self._deadlines: list[tuple[float, int, EntryKey]] = []
        self._ticks = itertools.count()
        self._counters = Counters()
        # The bytes never leave this process, so a key of its own authenticates them.
        self._auth = EntryAuth(os.urandom(32))

    # ------------------------------------------------------------------ public API

    def add_evict_observer(self, observer: EvictObserver) -> None:
        """Also hand every entry evicted for room to ``observer`` (after ``on_evict``), e.g.
        an offload coordinator spilling it to the next tier; same contract as ``on_evict``."""
        self._evict_observers.append(observer)

    def remove_evict_observer(self, observer: EvictObserver) -> None:
        """Stop handing evictions to ``observer`` (idempotent)."""
        self._evict_observers = [o for o in self._evict_observers if o is not observer]

    def put(
        self, key: EntryKey, entry: Entry, *, ttl_s: float | None = None, priority: float = 0.0
    ) -> bool:
        """Copy ``entry`` into host memory, evicting as needed; ``False`` if it cannot fit."""
        priority = check_put(key, entry, ttl_s, priority)  # before anything changes
        ttl = self.limits.ttl_for(key.tenant, ttl_s)
        encoded = encode(key, entry, self._auth, tag=self.verify_reads)
        size = _stored_size(encoded)
        quota = self.limits.quota_for(key.tenant)
        if quota is not None and size > quota:
            self._counters.add(quota_rejections=1)
            return False
        if size > self.capacity_bytes:
            self._counters.add(dropped_writes=1)
            return False
        storage, view, offsets = self._copy_in(encoded)
        header = parse_header(key, encoded.header, self._auth)
        victims: list[_Slot] = []
        with self._lock:
            now = self._clock()
            self._remove(key)
            self._expire(now)
            if quota is not None:
                heap = self._tenant_lru.get(key.tenant, [])
                self._evict_until(heap, key.tenant, quota - size, victims)
            self._evict_until(self._lru, None, self.capacity_bytes - size, victims)
            gen = next(self._ticks)
            slot = _Slot(
                key=key,
                header=header,
                storage=storage,
                view=view,
                offsets=offsets,
                size=size,
                payload=encoded.nbytes,
                priority=float(priority),
                gen=gen,
                tick=gen,
                expires_at=None if ttl is None else now + ttl,
            )
            self._insert(slot)
        self._counters.add(puts=1, bytes_in=encoded.nbytes)
        if victims and (self.on_evict is not None or self._evict_observers):
            self._spill(victims, now)
        return True

    def get_many(self, keys: Sequence[EntryKey]) -> list[Entry | None]:
        return [self._get(k) for k in check_keys(keys)]

    def contains_many(self, keys: Sequence[EntryKey]) -> list[bool]:
        keys = check_keys(keys)
        with self._lock:
            self._expire(self._clock())
            return [k in self._slots for k in keys]

    def delete(self, key: EntryKey) -> None:
        check_key(key)
        with self._lock:
            if self._remove(key):
                self._counters.add(deletes=1)

    def stats(self) -> TierStats:
        with self._lock:
            return self._counters.snapshot(entries=len(self._slots), bytes_used=self._used)

    def usage(self, tenant: str) -> int:
        """Bytes held for ``tenant``."""
        with self._lock:
            self._expire(self._clock())
            return self._tenant_used.get(tenant, 0)

    def purge_expired(self) -> int:
        """Drop every expired entry now; returns how many."""
        with self._lock:
            return self._expire(self._clock())

    def clear(self) -> None:
        with self._lock:
            for key in list(self._slots):
                self._remove(key)

    # ------------------------------------------------------------------ internals

    def _get(self, key: EntryKey) -> Entry | None:
        with self._lock:
            self._expire(self._clock())
            slot = self._slots.get(key)
            if slot is not None:
                slot.tick = next(self._ticks)
                self._push_lru(slot)
        if slot is None:
            self._counters.add(misses=1)
            return None
        chunks = [slot.view[o : o + n] for o, n in slot.offsets]
        try:
            entry = decode(key, slot.header, chunks, self._auth, verify=self.verify_reads)
        except EntryFormatError:  # a caller wrote into a returned tensor: never serve it
            with self._lock:
                if self._slots.get(key) is slot:
                    self._remove(key)
            self._counters.add(misses=1, corrupt=1)
            return None
        self._counters.add(hits=1, bytes_out=slot.payload)
        return entry

    def _copy_in(
        self, encoded: EncodedEntry
    ) -> tuple[object, memoryview, tuple[tuple[int, int], ...]]:
        """One aligned buffer (pinned if asked) holding every chunk; copied outside the lock."""
        offsets: list[tuple[int, int]] = []
        total = 0
        for chunk in encoded.chunks:
            offsets.append((total, chunk.nbytes))
            total += _aligned(chunk.nbytes)
        if self.pin_memory:
            storage: object = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=True)
            array = storage.numpy()  # type: ignore[attr-defined]
        else:
            storage = array = np.empty(max(total, 1), dtype=np.uint8)
        for (off, n), chunk in zip(offsets, encoded.chunks, strict=True):
            array[off : off + n] = np.frombuffer(chunk, dtype=np.uint8)
        return storage, memoryview(array).toreadonly(), tuple(offsets)

    def _insert(self, slot: _Slot) -> None:
        self._slots[slot.key] = slot
        self._used += slot.size
        tenant = slot.key.tenant
        self._tenant_used[tenant] = self._tenant_used.get(tenant, 0) + slot.size
        self._push_lru(slot)
        if slot.expires_at is not None:
            heapq.heappush(self._deadlines, (slot.expires_at, slot.gen, slot.key))

    def _push_lru(self, slot: _Slot) -> None:
        item = (slot.priority, slot.tick, slot.key)
        heapq.heappush(self._lru, item)
        heapq.heappush(self._tenant_lru.setdefault(slot.key.tenant, []), item)
        if len(self._lru) > 2 * len(self._slots) + 64:
            self._rebuild_heaps()

    def _rebuild_heaps(self) -> None:
        """Drop stale heap items (each ``get`` pushes a fresh one; old ones are skipped)."""
        self._lru = [(s.priority, s.tick, s.key) for s in self._slots.values()]
        heapq.heapify(self._lru)
        self._tenant_lru = {}
        for item in self._lru:
            self._tenant_lru.setdefault(item[2].tenant, []).append(item)
        for heap in self._tenant_lru.values():
            heapq.heapify(heap)

    def _remove(self, key: EntryKey) -> bool:
        slot = self._slots.pop(key, None)
        if slot is None:
            return False
        self._used -= slot.size
        tenant = key.tenant
        left = self._tenant_used[tenant] - slot.size
        if left:
            self._tenant_used[tenant] = left
        else:
            del self._tenant_used[tenant]
            self._tenant_lru.pop(tenant, None)
        return True

    def _spill(self, victims: list[_Slot], now: float) -> None:
        """Hand evicted entries to ``on_evict`` (outside the lock: it may write elsewhere)."""
        for slot in victims:
            chunks = [slot.view[o : o + n] for o, n in slot.offsets]
            ttl_left = None if slot.expires_at is None else max(slot.expires_at - now, 1e-3)
            try:
                entry = decode(slot.key, slot.header, chunks, self._auth, verify=False)
            except Exception:  # a spill target's bug must not fail this put
                _log.exception("host tier: decoding an evicted entry failed")
                continue
            observers = [self.on_evict, *self._evict_observers]
            for observe in observers:
                if observe is None:
                    continue
                try:
                    observe(slot.key, entry, ttl_left, slot.priority)
                except Exception:  # a spill target's bug must not fail this put
                    _log.exception("host tier: on_evict failed for an evicted entry")

    def _evict_until(
        self, heap: list, tenant: str | None, limit: int, victims: list[_Slot]
    ) -> None:
        """Evict from ``heap`` (lowest priority, then oldest use) until usage <= ``limit``."""

        def used() -> int:
            return self._used if tenant is None else self._tenant_used.get(tenant, 0)

        while used() > limit and heap:
            _, tick, key = heapq.heappop(heap)
            slot = self._slots.get(key)
            if slot is not None and slot.tick == tick:
                self._remove(key)
                self._counters.add(evictions=1)
                victims.append(slot)

    def _expire(self, now: float) -> int:
        expired = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, gen, key = heapq.heappop(self._deadlines)
            slot = self._slots.get(key)
            if slot is not None and slot.gen == gen:
                self._remove(key)
                expired += 1
        if expired:
            self._counters.add(expirations=expired)
        return expired


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _stored_size(encoded: EncodedEntry) -> int:
    return len(encoded.header) + sum(_aligned(c.nbytes) for c in encoded.chunks)
