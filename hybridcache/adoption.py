"""What adopting a candidate setting does to a live manager, beyond its admission rules.

The adaptive policy (:mod:`hybridcache.adaptive`) makes a candidate's setting the live one
when its shadow leads. Two parts of a setting are not rules the next request reads:

- its eviction ranking (:func:`set_weighting`): a weighting of value eviction is a knob
  on the live queues; an eviction policy of its own (SGLang's ``lru``, Marconi's utility)
  means re-ranking every cached entry into that policy's queues
  (:func:`hybridcache.policy_switch.switch_eviction`);
- for ``min_seen > 1`` (a state only for a boundary seen that often), the counts of the
  boundaries seen so far (:func:`carry_seen`), which the live cache never kept while its
  setting did not need them: without them the adopted setting saves no snapshot until
  every boundary has been seen again, which is not what the shadow that led measured.

Cached entries otherwise stay as the previous setting left them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridcache.errors import UnknownNameError
from hybridcache.policies.value import WEIGHTINGS
from hybridcache.policy_switch import switch_eviction

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.manager import HybridCacheManager

#: What a candidate's ``weighting`` may name: a weighting of value eviction, or an eviction
#: policy of its own (SGLang's LRU, Marconi's utility), which the live cache switches to.
RANKINGS = (*WEIGHTINGS, "lru", "marconi")


def set_weighting(mgr: HybridCacheManager, weighting: str) -> None:
    """Set how ``mgr`` ranks eviction victims: a weighting of value eviction
    (:data:`~hybridcache.policies.value.WEIGHTINGS`) or another eviction policy by name
    (:data:`RANKINGS`: ``lru``, ``marconi``).

    A value weighting on value eviction is a knob (no-op for a policy configured otherwise):
    between ``gdsf`` and ``gds`` entries queued already keep their rank until they are
    touched again; to or from ``recency`` (ranked by tick, not by the aging clock) they are
    ranked again as a policy switch ranks them. Anything else changes the eviction policy
    of the live cache, which re-ranks every cached entry into the new policy's queues
    (:func:`hybridcache.policy_switch.switch_eviction`): a Marconi candidate's lead comes from
    its utility ranking (FLOP efficiency beside recency over the oldest entries), which no
    weighting of GreedyDual's single priority reproduces; SGLang's (``lru``: KV past the
    last snapshot first, then the least recently released entry) is not the ``recency``
    weighting either: with SGLang's admission the two were 0.01-0.07 apart on agentic
    sessions at 1-2 GiB (docs/results.md, "`recency` ranked by tick").
    """
    if weighting not in RANKINGS:
        raise UnknownNameError(f"unknown weighting {weighting!r}; known: {', '.join(RANKINGS)}")
    if weighting not in WEIGHTINGS:
        switch_eviction(mgr, weighting)
        return

    def knobs() -> None:
        for q in (mgr.index.kv_q, mgr.index.snap_q):
            if hasattr(q, "freq"):
                q.freq = weighting == "gdsf"
                q.uniform = weighting == "recency"

    uniform = getattr(mgr.index.kv_q, "uniform", None)
    if mgr.index.eviction in RANKINGS:  # a candidate's own policy: back to value eviction
        switch_eviction(mgr, "value", prepare=knobs)  # re-ranked with the knobs set
    elif uniform is not None and uniform != (weighting == "recency"):
        # recency ranks by tick, the GreedyDual weightings by the aging clock: one scale
        # cannot be read as the other, so the entries are ranked again.
        switch_eviction(mgr, "value", prepare=knobs, rerank=True)
    else:
        knobs()


def carry_seen(live: HybridCacheManager, shadow: HybridCacheManager) -> None:
    """Give ``live`` the boundary counts its adopted ``min_seen`` setting's ``shadow`` kept.

    The shadow counted every boundary of the requests it replayed (all of them at rate 1,
    the sampled families' below it); each count is raised to the shadow's where that is
    higher, so a boundary the live cache counted itself keeps its own count."""
    seen = live._seen
    for digest, n in shadow._seen.items():
        if n > seen.get(digest, 0):
            seen[digest] = n
