"""Change the eviction policy of a live cache: every cached entry is re-ranked by the new one.

The adaptive policy (:mod:`hybridcache.adaptive`) follows the best of a few candidate
settings; one of them evicts by Marconi's utility (:mod:`hybridcache.policies.marconi`),
whose queues are of another type than value eviction's. Changing a weighting is a knob on
the live queues; changing the policy means building the new policy's queues and putting
every evictable entry into them, ranked as a manager that had run the new policy all along
would rank it, from what the index keeps whatever the policy:

- the manager tick at which each entry last became evictable: a snapshot's
  (``UnitHandle.snap_tick``, and ``snap_demoted``: ranked first since, as a spare or an
  unused prompt-end snapshot; ``snap_superseded``: a session went past it, ranked first
  under value eviction), a KV unit's from the old queue (an LRU-type queue keys
  units by their tick; value eviction's release numbers carry it:
  :data:`~hybridcache.policies.value.TICK_SHIFT`);
- hits (the run's, and a snapshot's as they were when it was queued: a restore's hit is
  counted after the restore is released), FLOPs and bytes, which the index owns.

Entries go into the new queues in the order a fresh manager would have added them: by
tick, KV before snapshots within a tick, deeper units first (a request releases its holds
deepest first). Value eviction's aging clock starts again at zero (every entry's base is
the same: GreedyDual's clock only orders entries relative to each other). Stranded KV tails
are ranked first by the new queues themselves, as on every change of a run.

A switch between two policies without evictions in between (the cache as a fresh manager
with the new policy would hold it) ranks entries exactly as that manager:
``tests/core/test_policy_switch.py`` compares the victim order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from hybridcache.policies.lru import LRUQueue
from hybridcache.policies.value import TICK_SHIFT, RunValueQueue

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.index import PrefixIndex, UnitHandle
    from hybridcache.manager import HybridCacheManager
    from hybridcache.runs import Run


def switch_eviction(mgr: HybridCacheManager, eviction: str, marconi_alpha: float | None = None,
                    prepare: Callable[[], None] | None = None, *, rerank: bool = False) -> None:
    """Make ``eviction`` the live eviction policy of ``mgr``, re-ranking every cached entry
    (module docstring). A no-op when it is the policy already (and alpha is unchanged),
    unless ``rerank``: value eviction's ``recency`` weighting ranks by tick and the others by
    GreedyDual's clock, so a change between them rebuilds the queues as a switch does.
    ``prepare`` runs once the new queues exist and before they are filled (to set a knob
    such as value eviction's weighting, which ranks entries as they are added).

    Must not run inside an allocation (a slot batch holds set-aside entries of the old
    queue): managers call it between requests."""
    index = mgr.index
    alpha = index._policy_args[1]
    if not rerank and eviction == index.eviction and (marconi_alpha is None or marconi_alpha == alpha):
        return
    assert index.evictor._aside is None, "switch_eviction inside a slot allocation"
    kv_ticks = _kv_ticks(index)
    snaps = _queued_snapshots(index)
    range_units = index.evictor.range_units
    index.install_policy(eviction, marconi_alpha)
    index.evictor.range_units = range_units
    if prepare is not None:
        prepare()
    _rank_into(index, kv_ticks, snaps)
    mgr.config = replace(mgr.config, eviction=eviction, marconi_alpha=index._policy_args[1])


def _kv_ticks(index: PrefixIndex) -> dict[Run, list[int]]:
    """For every run with evictable units, the tick each of them (from ``held`` on) last
    became evictable, read from the old KV queue."""
    q = index.kv_q
    out: dict[Run, list[int]] = {}
    for run in index.heads.values():
        n, lo = len(run.digests), run.held
        if lo >= n:
            continue
        if isinstance(q, RunValueQueue):
            out[run] = _rel_ticks(run, lo)
        elif isinstance(q, LRUQueue):
            od, demoted, handles = q._od, q._demoted, index.handles
            ticks = []
            for pos in range(lo, n):
                node = handles.get(run.digests[pos])
                t = demoted.get(node, od.get(node, 0)) if node is not None else 0
                ticks.append(max(t, 0))
            out[run] = ticks
        else:  # a policy this module does not know: recency lost, ranked by value only
            out[run] = [0] * (n - lo)
    return out


def _rel_ticks(run: Run, lo: int) -> list[int]:
    """Ticks of units ``lo..`` of ``run`` from value eviction's release marks: a unit's
    last release is the latest mark at an end past it."""
    n = len(run.digests)
    best = [0] * (n + 1)
    for end, (_, order) in run.rel.items():
        best[end] = max(best[end], order >> TICK_SHIFT)
    ticks = [0] * (n - lo)
    cur = 0
    for pos in range(n - 1, lo - 1, -1):
        cur = max(cur, best[pos + 1])
        ticks[pos - lo] = cur
    return ticks


def _queued_snapshots(index: PrefixIndex) -> list[UnitHandle]:
    """Snapshots that are evictable now (cached, no pending restore)."""
    return [node for node in index.handles.values() if node.snap >= 0 and node.snap_ref == 0]


def _rank_into(index: PrefixIndex, kv_ticks: dict[Run, list[int]], snaps: list[UnitHandle]) -> None:
    """Add every evictable entry to the index's (new, empty) queues in the order a fresh
    manager would have: by tick, KV before snapshots, deeper units first."""
    kv_q, snap_q = index.kv_q, index.snap_q
    events: list[tuple[int, int, int, object, int]] = []
    for run, ticks in kv_ticks.items():
        lo = run.held
        for i, t in enumerate(ticks):
            events.append((t, 0, -(run.first + lo + i), run, lo + i))
    for node in snaps:
        events.append((node.snap_tick, 1, node.depth, node, -1))
    events.sort(key=lambda e: e[:3])
    value = isinstance(kv_q, RunValueQueue)
    if value:
        _rank_value_kv(index, kv_q, [e for e in events if not e[1]])
    else:
        unit, nbytes = index.handle, index.node_kv_bytes
        for t, kind, _, run, pos in events:
            if not kind:
                kv_q.add(unit(run, pos), t, run.flops, nbytes, 0)  # type: ignore[union-attr]
    for t, kind, _, node, _ in events:
        if kind:
            snap_q.add(node, t, node.snap_flops, index.snap_bytes, node.snap_queued_hits)  # type: ignore[union-attr]
    # Demoted snapshots go first (at the floor of the queues: their oldest tick, as when a
    # demotion finds no stranded tail in front), then stranded tails, the latest foremost,
    # as a fresh manager's queue ranks each when the release makes it evictable.
    for node in snaps:
        if node.snap_demoted:
            index.demote_snapshot(node)
        elif node.snap_superseded:
            index.supersede_snapshot(node)  # ranked first under value eviction only
    if not value:
        for _, kind, _, run, pos in events:
            if not kind and pos == len(run.digests) - 1:  # type: ignore[union-attr]
                kv_q.run_changed(run)


def _rank_value_kv(index: PrefixIndex, q: RunValueQueue, kv_events: list[tuple[int, int, int, object, int]]) -> None:
    """Value eviction's KV queue: release marks rebuilt from the ticks (at the new clock,
    numbered in event order, so ties go as the releases went), then each run queued once.

    Every run's marks and queue entry are reset first: marks left from an earlier period
    under value eviction carry that period's clock, and a run's queue sequence number from
    an old queue would read as queued in this one."""
    marks: dict[Run, dict[int, tuple[float, int]]] = {}
    last: dict[Run, int] = {}  # tick of each run's latest mark
    clock = q._clock.value
    for t, _, _, run, pos in kv_events:
        # A unit's base is the latest mark at an end past it. Units of a run that became
        # evictable at one tick come here deepest first: the deepest one's mark serves
        # the others (one release mark, as a fresh manager's single release gives).
        if last.get(run) == t:  # type: ignore[call-overload]
            continue
        last[run] = t  # type: ignore[index]
        q._order += 1
        marks.setdefault(run, {})[pos + 1] = (clock, (t << TICK_SHIFT) | q._order)  # type: ignore[index]
    for run in index.heads.values():
        run.rel = marks.get(run, {})
        run.qseq, run.qprio = 0, 0.0
    for run in marks:
        q.touch(run)
