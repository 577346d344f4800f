"""``lru``: the least recently released entry goes first (O(1) everything).

KV and state valued as one (as in :mod:`.value`): a run's tail unit with no snapshot is KV
past the last snapshot on its path, which serves no hit until a state exists there, so it
is ranked first, below every entry of either queue (``STRANDED``), and the run's next tail
is checked when it goes. SGLang's hybrid radix cache does the same when it deletes a leaf
left without its Mamba state (``_iteratively_delete_tombstone_leaf``). ``lru-plain`` is
LRU without the rule: vLLM's free-block queue, whose KV blocks past the last cached state
age like any other (the ``vllm-align`` emulation; :mod:`.lru_plain`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from hybridcache.policies import PolicyParts, PolicySettings, register_policy
from hybridcache.policy import EvictionQueue


def lru_priority(tick: int) -> float:
    """An entry's priority under LRU: the tick it last became evictable."""
    return float(tick)


#: The tick of a stranded tail: below every real tick (ticks start at 0).
STRANDED = -1


class LRUQueue(EvictionQueue):
    """Oldest access first; O(1) everything (no stranded-KV rule: ``lru-plain``)."""

    def __init__(self) -> None:
        self._od: OrderedDict[object, int] = OrderedDict()
        # Stranded tails ranked first (StrandedLRUQueue): item -> the tick it had.
        self._demoted: dict[object, int] = {}

    def add(self, item, tick, flops, nbytes, hits):
        if self._demoted:
            self._demoted.pop(item, None)
        self._od[item] = tick
        self._od.move_to_end(item)

    def discard(self, item):
        self._od.pop(item, None)
        if self._demoted:
            self._demoted.pop(item, None)

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


class StrandedLRUQueue(LRUQueue):
    """:class:`LRUQueue` whose stranded run tail goes first (module docstring), once the
    index sets :attr:`stranded` (models with state; the index sets it on a queue that
    declares it)."""

    #: Whether a run's tail unit is KV past the last snapshot on its path (see
    #: :attr:`hybridcache.policies.value.RunValueQueue.stranded`).
    stranded: Callable[[Any], bool] | None = None

    def release_range(self, run, lo, hi, tick, nbytes):
        super().release_range(run, lo, hi, tick, nbytes)
        self.run_changed(run)

    def run_changed(self, run):
        """Rank the run's tail first if it is stranded (back to its tick if it no longer is)."""
        if self.stranded is None or not run.digests:
            return
        item = self.unit(run, len(run.digests) - 1)
        od = self._od
        if item not in od:
            return
        if self.stranded(run):
            if item not in self._demoted:
                self._demoted[item] = od[item]
                od[item] = STRANDED
                od.move_to_end(item, last=False)
        elif item in self._demoted:
            # It got a state (a turn-end snapshot is registered after its request released
            # the run): back to its tick, at the recent end, where a tick that recent sits.
            od[item] = self._demoted.pop(item)
            od.move_to_end(item)


@register_policy("lru")
def build_lru(settings: PolicySettings) -> PolicyParts:
    return PolicyParts(StrandedLRUQueue(), LRUQueue())

