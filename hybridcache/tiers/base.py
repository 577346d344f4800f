"""The interface every offload tier implements, and its metrics.

The manager sees tiers only through :class:`Tier`, so host memory, Redis (and later a disk
or a remote store) are interchangeable and can be stacked. The contract, which the manager
relies on to be *never wrong*:

* ``get`` returns an entry only if every piece was found and every check passed; otherwise
  ``None``. Infrastructure failures are misses, never exceptions.
* ``contains_many`` answers for complete entries, so ``longest_prefix`` can pick a load plan
  without fetching payloads (a later ``get`` may still miss: eviction or expiry in between).
* Bad *arguments* (an invalid entry, a bad key) raise at once, in the caller's thread.
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

from hybridcache.tiers.errors import InvalidEntryError, TierConfigError
from hybridcache.tiers.format import Entry
from hybridcache.tiers.keys import EntryKey
from hybridcache.tiers.limits import check_ttl


def check_key(key: object) -> EntryKey:
    """``key`` must be an :class:`EntryKey` (a str or tuple is a caller's bug, said at once)."""
    if not isinstance(key, EntryKey):
        raise TierConfigError(f"key: need an EntryKey, got {type(key).__name__}")
    return key


def check_keys(keys: object) -> list[EntryKey]:
    """A sequence of :class:`EntryKey` (a bare str is refused, not iterated)."""
    if isinstance(keys, str | bytes) or not isinstance(keys, Sequence):
        raise TierConfigError(f"keys: need a sequence of EntryKey, got {type(keys).__name__}")
    return [check_key(k) for k in keys]


def check_put(key: object, entry: object, ttl_s: object, priority: object) -> float:
    """Validate every argument of ``put`` before a tier changes anything; returns the
    priority as a float.

    Raises:
        TierConfigError: ``key`` not an :class:`EntryKey`, a bad ``ttl_s``, or a
            ``priority`` that is not a finite real number (bool refused).
        InvalidEntryError: ``entry`` not an :class:`Entry`.
    """
    check_key(key)
    if not isinstance(entry, Entry):
        raise InvalidEntryError(f"entry: need an Entry, got {type(entry).__name__}")
    check_ttl(ttl_s, "ttl_s")  # type: ignore[arg-type]
    if isinstance(priority, bool) or not isinstance(priority, int | float):
        raise TierConfigError(f"priority: need a real number, got {priority!r}")
    if not math.isfinite(priority):
        raise TierConfigError(f"priority: must be finite, got {priority!r}")
    return float(priority)


@dataclass(frozen=True)
class TierStats:
    """A snapshot of a tier's counters (all cumulative except the gauges at the end).

    Attributes:
        hits: ``get`` lookups that returned an entry.
        misses: lookups that returned ``None`` (absent, expired, corrupt, or tier down).
        corrupt: entries that failed validation; each was counted as a miss and deleted.
        dropped_writes: puts not stored: write queue full, entry larger than the tier, or
            the write failed (server down).
        errors: infrastructure errors (connection refused, timeouts, server errors).
        bytes_in: payload bytes stored.
        bytes_out: payload bytes returned by hits.
        puts: puts stored.
        deletes: explicit deletes (not evictions).
        evictions: entries removed to make room (capacity or tenant quota).
        expirations: entries removed because their TTL passed (where the tier can see it).
        quota_rejections: puts refused because one entry exceeds its tenant's quota.
        entries: gauge: entries held (-1 where the tier cannot count cheaply).
        bytes_used: gauge: bytes held, headers included (-1 where unknown).
        pending_writes: gauge: writes queued but not yet stored.
    """

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    dropped_writes: int = 0
    errors: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    puts: int = 0
    deletes: int = 0
    evictions: int = 0
    expirations: int = 0
    quota_rejections: int = 0
    entries: int = -1
    bytes_used: int = -1
    pending_writes: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_GAUGES = ("entries", "bytes_used", "pending_writes")


class Counters:
    """Thread-safe cumulative counters behind :class:`TierStats`."""

    _NAMES = tuple(f.name for f in fields(TierStats) if f.name not in _GAUGES)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self._NAMES, 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def snapshot(self, **gauges: int) -> TierStats:
        with self._lock:
            return TierStats(**self._values, **gauges)


class Tier(ABC):
    """A store of complete entries below the device cache (see the module notes)."""

    @abstractmethod
    def put(
        self, key: EntryKey, entry: Entry, *, ttl_s: float | None = None, priority: float = 0.0
    ) -> bool:
        """Store ``entry`` under ``key`` (replacing any previous one).

        Args:
            ttl_s: time to live; ``None`` uses the tenant's (or the tier's) default TTL. Pass
                a session's TTL here for per-session lifetimes.
            priority: value hint for eviction (higher is kept longer); tiers may ignore it.

        Returns:
            ``True`` if stored or queued for storage, ``False`` if dropped (see ``stats``).
        """

    def put_many(
        self, items: Iterable[tuple[EntryKey, Entry]], *, ttl_s: float | None = None
    ) -> list[bool]:
        """``put`` for several entries (tiers batch them where they can)."""
        return [self.put(k, e, ttl_s=ttl_s) for k, e in items]

    def get(self, key: EntryKey) -> Entry | None:
        """The complete, validated entry, or ``None``."""
        return self.get_many([key])[0]

    @abstractmethod
    def get_many(self, keys: Sequence[EntryKey]) -> list[Entry | None]:
        """``get`` for several keys, batched (one round trip for Redis)."""

    @abstractmethod
    def contains_many(self, keys: Sequence[EntryKey]) -> list[bool]:
        """Whether each key has a complete entry, without fetching payloads."""

    def contains(self, key: EntryKey) -> bool:
        return self.contains_many([key])[0]

    @abstractmethod
    def delete(self, key: EntryKey) -> None:
        """Remove the entry if present (idempotent)."""

    @abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of the counters."""

    def longest_prefix(self, keys: Sequence[EntryKey], *, batch: int = 16) -> int:
        """How many leading ``keys`` (in prefix order) have complete entries.

        Probes in batches that double in size, so a short hit costs one small round trip and
        a long one O(log n) round trips, never one per key.
        """
        found = 0
        step = max(1, batch)
        while found < len(keys):
            chunk = keys[found : found + step]
            present = self.contains_many(chunk)
            for ok in present:
                if not ok:
                    return found
                found += 1
            step *= 2
        return found

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until queued writes are stored; ``True`` if none is left pending."""
        return True

    def close(self) -> None:
        """Release resources (flushing first where the tier writes asynchronously)."""
        self.flush()

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
