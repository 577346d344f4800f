"""Finding and fetching device-cache entries across a stack of tiers (fastest first).

The coordinator asks two questions of the tiers: *which tier holds each of these keys*
(:meth:`TierLookup.locate`, batched ``contains_many``: one round trip per tier and probe
window, no payload moved) and *give me these entries* (:meth:`TierLookup.fetch`, batched
``get_many`` per tier). Between the two an entry may move (a HostTier spilled it to Redis)
or vanish (eviction, expiry, a corrupt value deleted by the tier, an outage), so a miss in
the tier the probe named is retried in the others before it counts as a hole.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridcache.tiers.base import Tier
from hybridcache.tiers.format import Entry
from hybridcache.tiers.keys import EntryKey
from hybridcache.tiers.offload_plan import OffloadMetrics


class TierLookup:
    """Batched existence checks and reads over ``tiers``, counted in ``metrics``."""

    def __init__(self, tiers: Sequence[Tier], names: Sequence[str], metrics: OffloadMetrics):
        self.tiers = list(tiers)
        self.names = list(names)
        self.metrics = metrics

    def locate(self, keys: list[EntryKey]) -> list[int | None]:
        """The index of the first tier holding each key (``None``: no tier does)."""
        where: list[int | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        self.metrics.probed_keys += len(keys)
        for t, tier in enumerate(self.tiers):
            if not todo:
                break
            present = tier.contains_many([keys[i] for i in todo])
            rest = []
            for i, ok in zip(todo, present, strict=True):
                if ok:
                    where[i] = t
                else:
                    rest.append(i)
            todo = rest
        return where

    def fetch(self, keys: list[EntryKey], sources: list[int]) -> list[tuple[Entry | None, int]]:
        """``(entry, tier index)`` per key, read from the tier ``sources`` names (batched per
        tier); a miss there is retried in every other tier. Keys are in load order: after
        the first key no tier holds, the rest get no second chance (the load stops there)."""
        out: list[tuple[Entry | None, int]] = [(None, -1)] * len(keys)
        by_tier: dict[int, list[int]] = {}
        for i, t in enumerate(sources):
            by_tier.setdefault(t, []).append(i)
        for t, idx in by_tier.items():
            got = self.tiers[t].get_many([keys[i] for i in idx])
            for i, entry in zip(idx, got, strict=True):
                self._count(t, entry is not None)
                out[i] = (entry, t)
        for i, (entry, _) in enumerate(out):
            if entry is not None:
                continue
            for t, tier in enumerate(self.tiers):
                if t == sources[i]:
                    continue
                again = tier.get(keys[i])
                self._count(t, again is not None)
                if again is not None:
                    out[i] = (again, t)
                    break
            if out[i][0] is None:
                break
        return out

    def _count(self, t: int, hit: bool) -> None:
        counter = self.metrics.tier_hits if hit else self.metrics.tier_misses
        name = self.names[t]
        counter[name] = counter.get(name, 0) + 1
