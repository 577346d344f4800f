"""When the adaptive manager may switch: paired comparisons of its shadows, tested sequentially.

Every shadow replays the same sampled requests, so the difference of two shadows' savings
on one request is a paired sample: the workload's own variation (a long prompt, a cold
family) cancels, and what is left is the settings' difference. :class:`PairTable` keeps,
for every shadow from the request it first evicted on (its *pressure onset*: before it,
more snapshots always look better), the windowed paired difference against every other
shadow. The table is never reset when the live cache switches: the evidence for a
candidate against the new current one has been gathering since that candidate's onset.

Beside the adaptive manager's count rule (a lead held at several evaluations in a row),
a switch is tested after every fed request: the lead must clear :func:`anytime_threshold`,
a confidence sequence's boundary (Robbins' normal mixture, as in Howard et al.,
"Time-uniform, nonparametric, nonasymptotic confidence sequences", Ann. Statist. 2021),
which holds at every sample size at once, so looking after every request costs no extra
false switches and a clear lead is taken as soon as it is clear. Used alone (the count
rule dropped) it was slower where the evidence is only moderate (a switch to a better,
not the best, candidate that the count rule makes early: docs/results.md).
"""

from __future__ import annotations

import math

from hybridcache.shadow import PairedDifference


def anytime_threshold(n: float, alpha: float, rho: float) -> float:
    """The z a paired mean must reach over ``n`` effective samples for the normal-mixture
    confidence sequence of level ``alpha`` (mixture width ``rho`` samples) to exclude zero.

    In z units the boundary on a sum of ``n`` samples of unit variance is
    ``sqrt((1 + rho / n) * (log(1 + n / rho) + 2 log(1 / alpha)))``: large for a few samples
    (a lead on three requests is no lead), tightest near ``rho`` and growing as
    ``sqrt(log n)`` after, the price of being allowed to look at every request.
    """
    if n <= 0:
        return math.inf
    return math.sqrt((1.0 + rho / n) * (math.log1p(n / rho) + 2.0 * math.log(1.0 / alpha)))


def upper_bound(pair: PairedDifference, alpha: float, rho: float) -> float:
    """An upper confidence bound, holding at every sample size at once, on the mean of
    ``pair``'s per-request difference: its mean plus :func:`anytime_threshold` standard
    errors (infinite before ``rho`` effective samples: too few to bound anything).

    Where the bound falls below what a switch needs (the margin), the candidate cannot
    become the one to follow on this evidence: the adaptive manager stops replaying it
    (``AdaptiveManager._race``, which also asks for a negative mean). This is the racing rule
    of algorithm configuration (Maron & Moore's Hoeffding races, F-Race) with a time-uniform
    bound, so that checking after every request adds no premature retirements.
    """
    n = pair.n
    if n < rho or not pair.w:
        return math.inf
    mean, var = pair.moments()
    return mean + anytime_threshold(n, alpha, rho) * pair.stderr(var)


class PairTable:
    """Windowed paired differences between shadows, each row from its shadow's onset.

    ``start(i)`` opens row ``i`` (shadow ``i`` came under pressure); :meth:`add` adds one
    fed request's savings (one per shadow, in the shadows' order) to every open row, so
    row ``i`` column ``j`` holds ``saved_i - saved_j`` over the requests since ``i``'s onset,
    decayed by the shadows' window.
    """

    __slots__ = ("rows", "k")

    def __init__(self, k: int) -> None:
        self.k = k
        self.rows: dict[int, list[PairedDifference]] = {}

    def start(self, i: int) -> None:
        if i not in self.rows:
            self.rows[i] = [PairedDifference() for _ in range(self.k)]

    def add(self, saved: list[float], decay: float, idle: frozenset[int] = frozenset()) -> None:
        """One fed request's savings; the rows and columns of ``idle`` shadows (not
        replayed: retired) are left as they are."""
        for i, row in self.rows.items():
            if i in idle:
                continue
            mine = saved[i]
            for j, pair in enumerate(row):
                if j != i and j not in idle:
                    pair.add(mine - saved[j], decay)

    def restart(self, i: int) -> None:
        """Forget every comparison with shadow ``i`` and open its row afresh (its cache was
        replaced: what it measured before says nothing of the new one)."""
        for j, row in self.rows.items():
            if j != i:
                row[i] = PairedDifference()
        self.rows[i] = [PairedDifference() for _ in range(self.k)]

    def lead(self, i: int, j: int) -> PairedDifference | None:
        """Shadow ``i``'s paired lead over shadow ``j`` (None before ``i``'s onset)."""
        row = self.rows.get(i)
        return row[j] if row is not None else None
