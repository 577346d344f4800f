"""``lru``: the least recently released entry goes first (O(1) everything)."""

from __future__ import annotations

from collections import OrderedDict

from hybridcache.policies import PolicyParts, PolicySettings, register_policy
from hybridcache.policy import EvictionQueue


def lru_priority(tick: int) -> float:
    """An entry's priority under LRU: the tick it last became evictable."""
    return float(tick)


class LRUQueue(EvictionQueue):
    """Oldest access first; O(1) everything."""

    def __init__(self) -> None:
        self._od: OrderedDict[object, int] = OrderedDict()

    def add(self, item, tick, flops, nbytes, hits):
        self._od[item] = tick
        self._od.move_to_end(item)

    def discard(self, item):
        self._od.pop(item, None)

    def peek(self):
        if not self._od:
            return None
        item, tick = next(iter(self._od.items()))
        return lru_priority(tick), item

    def first(self, pred, aside):
        od, found, skipped = self._od, None, []
        for item, tick in od.items():
            if pred(item.pages):  # type: ignore[attr-defined]
                found = (float(tick), item)
                break
            skipped.append((item, tick))
        for item, _ in skipped:  # set aside: not scanned again by this caller
            del od[item]
        aside.extend(skipped)
        return found

    def floor(self):
        return lru_priority(next(iter(self._od.values()))) if self._od else None

    def demote(self, item, floor):
        od = self._od
        if item in od:
            # The tick is the priority peek() reports against the other queue: lower it too,
            # or this entry would hide older ones behind it.
            od[item] = min(od[item], int(floor))
            od.move_to_end(item, last=False)

    def put_back(self, aside):
        od = self._od
        for item, tick in reversed(aside):
            od[item] = tick
            od.move_to_end(item, last=False)
        aside.clear()

    def __len__(self):
        return len(self._od)


@register_policy("lru")
def build_lru(settings: PolicySettings) -> PolicyParts:
    return PolicyParts(LRUQueue(), LRUQueue())
