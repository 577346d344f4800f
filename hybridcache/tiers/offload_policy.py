"""What the offload coordinator demotes when the device evicts, and the memory it needs.

A tier can only ever serve a prefix up to a snapshot (the reader stops at the last complete
snapshot), so what an evicted entry is worth below the device depends on whether a snapshot
sits at or after it on some path:

* a **snapshot** is always worth keeping (it is what makes the KV below it usable, and it is
  the expensive thing to recompute);
* **KV of a unit below a snapshot** (on any path the engine served) is kept, since a reader
  needs every unit below the snapshot;
* **KV of a request-unique tail** (past the deepest snapshot of every path through it, never
  hit) is dropped: no reader can use it without a snapshot after it, and it is typically
  the bulk of the bytes of one-off prompts;
* KV hit at least ``min_kv_hits`` times is kept regardless (a shared prefix that may get a
  snapshot later), and KV of a unit on no path the coordinator saw is kept (unknown: err on
  the side of a hit);
* a model without recurrent state needs no snapshot: all its KV is kept.

"Below a snapshot" needs the request's path (the index is a flat dict of chained digests,
without parent or child links). :class:`PathMemory` records each request's digest list when
the coordinator sees it (``prefetch``), and once the request is gone (freed, so its nodes
became evictable) finds the deepest snapshot on its path and marks the units below it.
Bounded, so memory stays flat on a long-running engine; an entry that fell out of it counts
as unknown (kept).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridcache.tiers.errors import TierConfigError

KV_RULES = ("below-snapshot", "all")
PRIORITIES = ("lru", "value")


@dataclass(frozen=True)
class DemotionPolicy:
    """The demotion rule (see the module notes for the reasoning).

    Args:
        kv: ``"below-snapshot"`` (default): demote KV of a unit only if it lies below a
            snapshot on a path the engine served, was hit ``min_kv_hits`` times, or is on no
            known path; ``"all"``: demote every evicted KV unit.
        snapshots: demote evicted snapshots (turn off only for KV-only experiments: a tier
            without snapshots never serves a hybrid model).
        min_kv_hits: KV hit at least this often is kept even past the last snapshot
            (``0``: hits do not matter).
        priority: ``"lru"``: every demoted entry gets priority 0, so a HostTier evicts least
            recently used first; ``"value"``: prefill FLOPs saved per byte times
            ``hits + 1``, normalised so one unit of never-hit KV is 1.0 (HostTier evicts the
            lowest first, so cheap-to-recompute bytes go first).
        ttl_s: TTL of demoted entries (a session's lifetime); ``None``: the tier's tenant
            or default TTL.
    """

    kv: str = "below-snapshot"
    snapshots: bool = True
    min_kv_hits: int = 1
    priority: str = "lru"
    ttl_s: float | None = None

    def __post_init__(self) -> None:
        if self.kv not in KV_RULES:
            raise TierConfigError(f"DemotionPolicy.kv: one of {KV_RULES}, got {self.kv!r}")
        if self.priority not in PRIORITIES:
            raise TierConfigError(
                f"DemotionPolicy.priority: one of {PRIORITIES}, got {self.priority!r}"
            )
        if isinstance(self.min_kv_hits, bool) or not isinstance(self.min_kv_hits, int):
            raise TierConfigError("DemotionPolicy.min_kv_hits: need an int")
        if self.min_kv_hits < 0:
            raise TierConfigError("DemotionPolicy.min_kv_hits: must be >= 0")
        if self.ttl_s is not None and not (
            isinstance(self.ttl_s, int | float) and not isinstance(self.ttl_s, bool)
        ):
            raise TierConfigError("DemotionPolicy.ttl_s: need seconds or None")
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise TierConfigError("DemotionPolicy.ttl_s: must be positive")


class PathMemory:
    """Which cached units lie below a snapshot on a path the engine served (bounded).

    Args:
        max_units: digests remembered (least recently marked are forgotten first).
        max_paths: requests tracked at once; beyond it the oldest is settled as it stands.
    """

    def __init__(self, max_units: int = 1 << 20, max_paths: int = 4096) -> None:
        self.max_units = max_units
        self.max_paths = max_paths
        self._marks: OrderedDict[bytes, bool] = OrderedDict()
        self._tracked: dict[Any, tuple[str, Any]] = {}
        self._forced: list[Any] = []  # pushed out by max_paths: settled at the next call

    def __len__(self) -> int:
        return len(self._marks)

    def track(self, request: Any) -> None:
        """Remember ``request`` (a port :class:`~hybridcache.port.RequestView`): its digests
        are read at settle time, so digests appended while decoding count too."""
        self._tracked[request] = (request.id, request)  # views hash by record
        if len(self._tracked) > self.max_paths:
            oldest = next(iter(self._tracked))
            _, req = self._tracked.pop(oldest)
            self._forced.append(req)

    def settle(
        self, live: Callable[[str], Any], has_snapshot: Callable[[str | None, bytes], bool]
    ) -> int:
        """Mark the paths of tracked requests that are no longer live; returns how many.

        Args:
            live: ``request id -> view of the live request or None`` (the port's
                ``request``); a view unequal to the tracked one is a new request.
            has_snapshot: ``(tenant, digest) -> bool``: a snapshot at the end of that unit
                exists on the device or in a tier.
        """
        done = [k for k, (rid, req) in self._tracked.items() if live(rid) != req]
        reqs = [self._tracked.pop(k)[1] for k in done] + self._forced
        self._forced = []
        for req in reqs:
            self._mark(list(req.digests), lambda d, t=req.tenant: has_snapshot(t, d))
        return len(reqs)

    def _mark(self, digests: list[bytes], has_snapshot: Callable[[bytes], bool]) -> None:
        deepest = 0
        for i in range(len(digests) - 1, -1, -1):
            if has_snapshot(digests[i]):
                deepest = i + 1
                break
        marks = self._marks
        for i, d in enumerate(digests):
            below = i < deepest
            if below or d not in marks:
                marks[d] = below or marks.get(d, False)
            marks.move_to_end(d)
        while len(marks) > self.max_units:
            marks.popitem(last=False)

    def covered(self, digest: bytes) -> bool | None:
        """``True``: below a snapshot on a served path; ``False``: only past every known
        snapshot; ``None``: on no path remembered."""
        return self._marks.get(digest)
