"""What the offload coordinator believes its tiers already hold (so it does not write twice).

Re-demoting an entry a tier already holds is a wasted copy and write, so the coordinator
remembers what it stored or loaded. That memory is a *belief*: Redis loses entries behind
the coordinator's back (a restart without persistence, ``maxmemory`` eviction, a flush,
another engine's delete). A belief that never expires would then stop the entry from ever
being written again, and every other engine would miss it for good. Two mechanisms keep the
belief honest:

* **Revalidation** (:meth:`StoredMemory.forget_all`): a prefetch probes the tiers anyway;
  every key the probe finds in no tier is forgotten, and so is every key of the request's
  path past the first unit whose KV is nowhere (the data behind a hole is as likely lost as
  the hole, and those units are useless to a reader until the hole is filled). Evicting them
  from the device then demotes them again.
* **Expiry**: a record lives at most ``max_age_s`` (and at most 0.9 x the entry's TTL), so
  even an entry that is never probed again is re-demoted on its first eviction after that.
  A redundant re-demotion costs one put; a stale belief costs every later hit.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from hybridcache.tiers.errors import TierConfigError
from hybridcache.tiers.keys import EntryKey


class StoredMemory:
    """A bounded, expiring set of keys believed to be held by a tier.

    Args:
        capacity: most keys remembered (the oldest are forgotten first).
        max_age_s: most seconds a record is trusted (``None``: until its TTL, or forever).
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        capacity: int,
        max_age_s: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise TierConfigError(f"stored_memory: need an int >= 0, got {capacity!r}")
        if max_age_s is not None and (
            isinstance(max_age_s, bool)
            or not isinstance(max_age_s, int | float)
            or not 0 < max_age_s < math.inf
        ):
            raise TierConfigError(f"stored_max_age_s: need a positive number, got {max_age_s!r}")
        self.capacity = capacity
        self.max_age_s = max_age_s
        self._clock = clock
        self._deadlines: OrderedDict[EntryKey, float] = OrderedDict()
        self.forgotten = 0  # records dropped by revalidation (a metric for tests and logs)

    def __len__(self) -> int:
        return len(self._deadlines)

    def remember(self, key: EntryKey, ttl_s: float | None) -> None:
        """Believe ``key`` is stored, with ``ttl_s`` left (``None``: no TTL)."""
        life = math.inf if ttl_s is None else 0.9 * ttl_s
        if self.max_age_s is not None:
            life = min(life, self.max_age_s)
        self._deadlines[key] = self._clock() + life
        self._deadlines.move_to_end(key)
        while len(self._deadlines) > self.capacity:
            self._deadlines.popitem(last=False)

    def known(self, key: EntryKey) -> bool:
        """Whether ``key`` is believed stored (an expired record is dropped here)."""
        deadline = self._deadlines.get(key)
        if deadline is None:
            return False
        if deadline < self._clock():
            del self._deadlines[key]
            return False
        return True

    def forget(self, key: EntryKey) -> None:
        """Stop believing ``key`` is stored (it is gone, or was found misfit)."""
        self._deadlines.pop(key, None)

    def forget_all(self, keys: Iterable[EntryKey]) -> None:
        """Revalidation: ``keys`` were found (or are presumed) missing from every tier."""
        for key in keys:
            if self._deadlines.pop(key, None) is not None:
                self.forgotten += 1
