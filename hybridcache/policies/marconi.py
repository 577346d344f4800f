"""``marconi``: Marconi's utility ``alpha * norm(flops / bytes) + norm(recency)``.

Min-max normalised over the candidates (:func:`marconi_utilities`, the policy's priority
function); the candidates are the ``window`` least recently used entries of each kind, a
bounded scan so that eviction stays cheap on large caches. The ranking is cached for a few
victims (:class:`MarconiChooser`). Ideas from the Marconi paper; no code of it.
"""

from __future__ import annotations

from itertools import islice
from typing import TYPE_CHECKING

from hybridcache.policies import PolicyParts, PolicySettings, register_policy
from hybridcache.policies.lru import STRANDED, StrandedLRUQueue

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.index import UnitHandle
    from hybridcache.runs import PagesPred


def marconi_utilities(ticks: list[int], effs: list[float], alpha: float) -> list[float]:
    """Utility of each candidate (lower goes first): recency and FLOP efficiency, each
    min-max normalised over the candidates, efficiency weighted by ``alpha``.

    Constant terms of the normalisation (a flat dimension scores 1) do not change the
    order and are left out.
    """
    t0, t1 = min(ticks), max(ticks)
    e0, e1 = min(effs), max(effs)
    rt = 1.0 / (t1 - t0) if t1 > t0 else 0.0
    re = alpha / (e1 - e0) if e1 > e0 else 0.0
    return [(e - e0) * re + (t - t0) * rt for t, e in zip(ticks, effs)]


class MarconiQueue(StrandedLRUQueue):
    """LRU order plus the per-entry FLOP efficiency that Marconi's utility needs. A
    stranded run tail (KV past the last snapshot on its path) is ranked first, as in
    :mod:`.lru`: Marconi evicts a radix node's KV and state together, so its tree never
    holds KV past a leaf's state; with the two kinds in separate queues the rule keeps it so."""

    def __init__(self) -> None:
        super().__init__()
        self.eff: dict[object, float] = {}

    def add(self, item, tick, flops, nbytes, hits):
        super().add(item, tick, flops, nbytes, hits)
        self.eff[item] = flops / max(nbytes, 1)

    def discard(self, item):
        super().discard(item)
        self.eff.pop(item, None)


def marconi_ranking(
    queues: dict[str, MarconiQueue], alpha: float, window: int, keep: int = 16
) -> list[tuple[str, object]]:
    """The ``keep`` lowest-utility entries among the ``window`` oldest of each queue,
    lowest first (Marconi's utility, min-max normalised over those candidates).

    The caller evicts from this ranking until it runs out or an entry turns stale, so the
    candidate scan is paid once per ``keep`` evictions instead of once per eviction.
    """
    cands: list[tuple[str, object, int, float]] = []
    for kind, q in queues.items():
        eff = q.eff
        cands += [(kind, item, tick, eff[item]) for item, tick in islice(q._od.items(), window)]
    if not cands:
        return []
    scores = marconi_utilities([c[2] for c in cands], [c[3] for c in cands], alpha)
    # Stranded tails first, whatever their utility (they serve nothing).
    scores = [sc - 4.0 - alpha if c[2] == STRANDED else sc for sc, c in zip(scores, cands)]
    # sorted()[:keep] is what nsmallest is defined as (same ties), and in C for ~128 items.
    best = sorted(range(len(scores)), key=scores.__getitem__)[:keep]
    return [(cands[i][0], cands[i][1]) for i in best]


class MarconiChooser:
    """Victims in the order of a cached Marconi ranking (re-ranked when used up)."""

    def __init__(self, kv_q: MarconiQueue, snap_q: MarconiQueue, alpha: float, window: int) -> None:
        self.kv_q, self.snap_q = kv_q, snap_q
        self.alpha, self.window = alpha, window
        self._ranked: list[tuple[str, UnitHandle]] = []

    def choose(self, pred: PagesPred | None, aside: list) -> tuple[str, UnitHandle] | None:
        """Marconi ranks a bounded window of candidates: if none of its KV candidates
        satisfies ``pred`` (is in an unpinned slab), take its best entry rather than stall."""
        got = self._stranded(pred)
        if got is not None:
            return got
        got = self._next(pred)
        return got if got is not None or pred is None else self._next(None)

    def _stranded(self, pred: PagesPred | None) -> tuple[str, UnitHandle] | None:
        """A stranded run tail (ranked first, at the front of the KV queue) goes before the
        cached ranking, which was made before the tail was stranded (the next tail of a
        run is stranded only once the one behind it went)."""
        q = self.kv_q
        if not q._demoted:
            return None
        for node, tick in q._od.items():
            if tick != STRANDED:
                return None
            if pred is None or pred(node.pages):  # type: ignore[attr-defined]
                return "kv", node  # type: ignore[return-value]
        return None

    def _next(self, pred: PagesPred | None) -> tuple[str, UnitHandle] | None:
        """Next entry of the cached ranking that is still evictable (and, for KV,
        satisfies ``pred``), re-ranking once when the ranking is used up. Entries skipped
        for ``pred`` keep their place at the low end of the ranking."""
        for attempt in range(2):
            ranking, skipped, found = self._ranked, [], None
            while ranking:
                kind, node = ranking.pop()
                q = self.kv_q if kind == "kv" else self.snap_q
                if node not in q.eff:
                    continue
                if pred is not None and kind == "kv" and not pred(node.pages):  # type: ignore[arg-type]
                    skipped.append((kind, node))
                    continue
                found = (kind, node)
                break
            ranking.extend(reversed(skipped))
            if found is not None or attempt:
                return found
            ranked = marconi_ranking({"kv": self.kv_q, "state": self.snap_q}, self.alpha, self.window)
            self._ranked = ranked[::-1]  # type: ignore[assignment]  # pop() = lowest utility
        return None


@register_policy("marconi")
def build_marconi(settings: PolicySettings) -> PolicyParts:
    alpha, window = settings.marconi_alpha, settings.marconi_window
    return PolicyParts(
        MarconiQueue(), MarconiQueue(), lambda kv, snap: MarconiChooser(kv, snap, alpha, window)
    )
