"""What ``adaptive_stats()`` says of the exploration and the overhead bucket.

On a long trace at a small capacity the shadows sample at nearly the live cache's size,
and the exploration leaves the bucket in debt for longer than the trace: the policy keeps
what the exploration decided (docs/results.md, "On long traces the shadows do not run
again after the exploration"). The report makes that visible: where the exploration ended,
how many requests were fed since, and the bucket's credit against the one at which paused
shadows run again."""

from __future__ import annotations

import pytest

from hybridcache import adaptive
from hybridcache.adaptive import AdaptiveManager
from hybridcache.manager import CacheConfig
from hybridcache.presets import get_preset
from hybridcache.sim.generate import generate
from hybridcache.sim.replay import Replay
from hybridcache.sim.traces import Trace

PAIRS = 12  # a short exploration, so that it ends on a short trace
N = 160


@pytest.fixture
def run(monkeypatch):
    monkeypatch.setattr(adaptive, "EXPLORE_PAIRS", PAIRS)
    trace = Trace("<chat>", "tokens", generate("chat", N + 2, seed=4, tenants=2))
    return Replay(trace, get_preset("kimi-linear-48b"), 1 << 30, CacheConfig(hash_unit=16, admission="adaptive"))


def test_the_report_tells_where_the_exploration_ended_and_what_was_fed_since(run, monkeypatch):
    m = run.mgr
    assert isinstance(m, AdaptiveManager)
    stats = m.adaptive_stats()
    assert stats["explored_at"] is None and stats["fed_since_explored"] == 0 and stats["exploring"]
    # The bucket starts full; paused shadows run again once it is half full.
    assert stats["resume_credit"] == stats["credit"] / 2 > 0
    ended: list[tuple[int, int]] = []
    observe = AdaptiveManager._observe

    def watched(self, *args):
        observe(self, *args)
        if self._pressured == PAIRS and not ended:
            ended.append((self.finished, self.sampled))

    monkeypatch.setattr(AdaptiveManager, "_observe", watched)
    paused_checked = 0
    for i in range(N):
        run.advance(i + 1)
        m.check_invariants()  # the exploration's end is recorded exactly while it has ended
        stats = m.adaptive_stats()
        if not stats["running"]:  # paused shadows run again at the resume credit, not before
            assert stats["credit"] < stats["resume_credit"], stats
            paused_checked += 1
    assert ended, "the exploration never ended: the trace is too short for the test"
    assert not stats["exploring"]
    assert stats["explored_at"] == ended[0][0] < N
    assert stats["fed_since_explored"] == m.sampled - ended[0][1] >= 0
    assert paused_checked > 0, "the bucket never paused the shadows: the test checks nothing"
    assert not stats["running"]
    # Just short of the resume credit (by more than a request adds), the shadows stay
    # paused; at it, the next request runs them.
    most = adaptive.OVERHEAD_BUDGET * (max(r.input_length + r.output_length for r in run.trace.requests) // m.unit + 1)
    m._credit = stats["resume_credit"] - 2 * most
    run.advance(N + 1)
    assert not m.adaptive_stats()["running"]
    m._credit = stats["resume_credit"]
    run.advance(N + 2)
    assert m.adaptive_stats()["running"]


def test_a_change_of_workload_starts_the_exploration_again(run):
    m = run.mgr
    run.advance()
    assert m.adaptive_stats()["explored_at"] is not None
    m._after_shift(m.shifts)  # what a detected change of the requests' sizes does
    m.check_invariants()
    stats = m.adaptive_stats()
    assert stats["exploring"] and stats["explored_at"] is None and stats["fed_since_explored"] == 0
