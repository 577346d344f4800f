"""The adaptive policy's shadows wait for the live cache's pressure.

The shadows (:mod:`hybridcache.shadow`) compare candidate settings by what each would have
saved, and the live cache follows the best. Before the live cache evicts an entry its rules
value, no candidate can do better than the setting it starts from, where every candidate
saves within that setting's points (:meth:`AdmissionPolicy.saves_within
<hybridcache.admission.AdmissionPolicy.saves_within>`, true of the default candidates):
with nothing evicted every candidate holds the same KV and a subset of the same states,
and the weightings only order evictions. Replaying the sampled requests into the shadows
before then only prepares them for later, and a workload that never fills the cache paid
for nothing: 0.11 of the fixed manager's instructions on 2,000 chat requests at 64 GiB,
where the live cache first evicts such an entry at request 2,897.

So the sampled requests wait here, in order, and the shadows are fed them only once the
live cache first evicts KV, or a snapshot that was not ranked first to evict (a spare, a
prompt-end state its turn end went past, a superseded turn end: ``PrefixIndex.floor_evictions``),
or once the backlog holds as many units as the shadows (one fill of every shadow: memory
stays of the order of the shadows' own). Then :data:`DRAIN_PER_REQUEST` of them after each
finished request, the ones sampled meanwhile queued behind them, so that no request pays
for the whole backlog at once. The shadows see the same requests in the same order as if
fed at once; only their decisions come later. A decision before the pressure saves no
more hits then, but what the setting admits shapes what the cache holds when the pressure
comes: over 600 generated cells, 9 moved by more than 0.001 (up and down; each set's mean hit
within 0.0003; docs/results.md, "The shadows wait for the live cache's pressure").

Rebuilt shadows (a raised sampling rate, :mod:`hybridcache.sample_rate`) start cold, so the
backlog is dropped with them; whether the live cache was under pressure stays known. A
change of workload (:mod:`hybridcache.shift`) leaves it as it is: the requests before the
change then count in the new window, which forgets them as it decays.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.admission import AdmissionPolicy
    from hybridcache.index import PrefixIndex

#: Whether the shadows wait for the live cache's pressure at all. Off, every sampled
#: request is fed at once, as before the backlog (tests).
WAIT_FOR_PRESSURE = True
#: Backlogged requests fed after each finished request once the live cache is under
#: pressure: the most shadow replays one request pays for (as four sampled requests would).
DRAIN_PER_REQUEST = 4


class Sampled(NamedTuple):
    """A sampled request, as the shadows replay it."""

    digests: list[bytes]
    prompt_len: int
    total: int
    tenant: str | None
    units: int


def backlog_for(rules: Sequence[AdmissionPolicy], limit_units: int, before: Backlog | None) -> Backlog:
    """A backlog for shadows of these candidates' ``rules`` (the first: where the live cache
    starts): waiting where every candidate saves within the first's points and the live
    cache was not under pressure yet (``before``: the backlog of the shadows it replaces)."""
    nested = WAIT_FOR_PRESSURE and all(r.saves_within(rules[0]) for r in rules)
    return Backlog(limit_units, nested and (before is None or before.waiting))


def live_pressure(index: PrefixIndex) -> bool:
    """Whether the live cache has evicted KV, or a snapshot not ranked first to evict."""
    ev = index.evictions
    return ev["kv"] > 0 or ev["state"] > index.floor_evictions


class Backlog:
    """Sampled requests not yet fed to the shadows, oldest first.

    Invariants: ``units`` is the sum of the queued requests' units; once ``waiting`` is
    false it stays false (the live cache was under pressure, or the backlog filled).
    """

    def __init__(self, limit_units: int, waiting: bool) -> None:
        """Args:
            limit_units: the units at which the backlog drains without pressure.
            waiting: whether to hold requests until the live cache is under pressure
                (false: each is released at once, as without a backlog).
        """
        self.limit = limit_units
        self.waiting = waiting
        self.units = 0
        self._queue: deque[Sampled] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, request: Sampled) -> None:
        self._queue.append(request)
        self.units += request.units

    def release(self, index: PrefixIndex) -> list[Sampled]:
        """The requests to feed now: none while waiting, else up to
        :data:`DRAIN_PER_REQUEST`, oldest first.

        Internal updates: ends the wait once the live cache is under pressure or the
        backlog is full."""
        if self.waiting:
            if self.units < self.limit and not live_pressure(index):
                return []
            self.waiting = False
        q = self._queue
        out = [q.popleft() for _ in range(min(DRAIN_PER_REQUEST, len(q)))]
        for r in out:
            self.units -= r.units
        return out

    def sanity_check(self) -> None:
        """Raise ``AssertionError`` if an invariant does not hold."""
        assert self.units == sum(r.units for r in self._queue), "backlog units"
        assert self.units >= 0
