"""What the adaptive policy did, as :meth:`AdaptiveManager.adaptive_stats
<hybridcache.adaptive.AdaptiveManager.adaptive_stats>` reports it (a module of its own so
that the manager's keeps to the decisions)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.adaptive import AdaptiveManager


def adaptive_stats(m: AdaptiveManager) -> dict[str, object]:
    """The rate, the candidate in force, the shadows' work and figures.

    ``overhead_units`` is the shadows' units fed over the live units; ``waiting`` whether
    the sampled requests still wait for the live cache's pressure, and ``backlog`` how
    many do (:mod:`hybridcache.shadow_backlog`).

    The budget: ``exploring`` whether an exploration runs (no end recorded since the last
    restart), ``explored_at`` the finished request at which it last ended (None while it
    runs) and ``fed_since_explored`` the requests fed after it;
    ``credit`` is the overhead bucket in units (negative: the exploration's work not yet
    paid back) and ``resume_credit`` the credit at which paused shadows run again. Where
    the shadows sample at nearly the live cache's size (a few dozen states fit), the
    exploration can leave the bucket in debt by more live work than a trace of a thousand
    requests has, and the policy keeps what the exploration decided until the fall
    detector (:class:`~hybridcache.shift.DropDetector`) or a change of workload calls for
    another (docs/results.md, "On long traces the shadows do not run again after the
    exploration")."""
    explored = m.explored
    return {
        "rate": m.rate,
        "current": m.current,
        "running": m.running,
        "exploring": explored is None,
        "waiting": m._backlog.waiting,
        "backlog": len(m._backlog),
        "overhead_units": m.shadow_units / m.live_units if m.live_units else 0.0,
        "shadow_seconds": m.shadow_seconds,
        "switches": list(m.switches),
        "sampled": m.sampled,
        "explored_at": explored[0] if explored else None,
        "fed_since_explored": m.sampled - explored[1] if explored else 0,
        "credit": m._credit,
        "resume_credit": m._resume_credit,
        "retired": [m.shadows[i].name for i in sorted(m._retired)],
        "retirements": m.retirements,
        "reentries": m.reentries,
        "shifts": list(m.shifts), "drops": list(m.drops),
        "shadows": {s.name: {"admission": s.config.admission, "weighting": s.weighting,
                             "min_seen": s.config.min_seen, "score": s.score,
                             "hit_rate": s.hit_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
                             "lead_z": m._lead_z(i)}
                    for i, s in enumerate(m.shadows)},
    }
