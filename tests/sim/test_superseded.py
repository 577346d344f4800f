"""Checkpoints a session went past are ranked first to evict (hybridcache.superseded).

A session's second turn saves checkpoints inside its own new content; once the third turn
resumes from the second one's turn end, those are demoted, and so is the first turn's end
the second one resumed from. The first turn's checkpoints stay (a first request's
checkpoints are where siblings branch), a turn end a retried turn restored too stays, a
branch inside a turn demotes nothing, and a recency policy only records it.
"""

from __future__ import annotations

import numpy as np
import pytest

import hybridcache.manager as manager_module
from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.sim.generate import generate
from hybridcache.sim.policies import checkpoint_interval
from hybridcache.sim.replay import Replay
from hybridcache.sim.traces import Trace
from tests.sim.conftest import toks

RULES = "last-token+turn-end+interval:256"


def turn(mgr: HybridCacheManager, rid: str, prompt: np.ndarray, out: np.ndarray) -> int:
    """Serve ``prompt`` and append ``out`` as its output; returns the hit tokens."""
    m = mgr.add_request(rid, prompt)
    mgr.allocate(rid, len(prompt) + len(out) - m.hit_tokens)
    mgr.append_tokens(rid, out)
    mgr.commit(rid, len(prompt) + len(out))
    mgr.free(rid)
    return m.hit_tokens


def demoted(mgr: HybridCacheManager) -> dict[int, bool]:
    """Boundary (tokens) -> whether its cached snapshot is ranked first (demoted, or gone
    past by its session)."""
    return {(n.depth + 1) * mgr.unit: n.snap_demoted or n.snap_superseded
            for n in mgr.index.handles.values() if n.snap >= 0}


def session(spec, eviction: str = "value"):
    """Three turns of one session (600 + 50, then 400 + 50 more, then 100 more) in a cache
    with room for all of it; returns the manager and the three turns."""
    mgr = HybridCacheManager(spec, 16 << 30, CacheConfig(hash_unit=16, admission=RULES, eviction=eviction))
    p1, o1 = toks(600, 1), toks(50, 2)
    p2 = np.concatenate([p1, o1, toks(400, 3)])
    o2 = toks(50, 4)
    p3 = np.concatenate([p2, o2, toks(100, 5)])
    return mgr, (p1, o1), (p2, o2), (p3, toks(20, 6))


def test_the_checkpoints_a_session_went_past_are_demoted(kimi):
    mgr, (p1, o1), (p2, o2), (p3, o3) = session(kimi)
    turn(mgr, "1", p1, o1)  # cold: checkpoints 256, 512; prompt end 592; turn end 640
    assert turn(mgr, "2", p2, o2) == 640  # extends turn 1: 768, 1024; 1040; 1088
    before = demoted(mgr)
    assert before == {256: False, 512: False, 592: True, 640: False,
                      768: False, 1024: False, 1040: True, 1088: False}
    assert mgr.add_request("3", p3).hit_tokens == 1088
    assert demoted(mgr) == before  # a match alone changes nothing
    mgr.allocate("3", len(p3) + len(o3) - 1088)
    after = demoted(mgr)
    # Turn 2 extended turn 1, so its own checkpoints are behind the session now, and so is
    # the turn end it resumed from (640: only turn 2 restored it); turn 1's checkpoints (a
    # first request's) keep their rank, and so does the turn end being resumed.
    assert after == {**before, 640: True, 768: True, 1024: True}


def test_a_turn_end_restored_twice_keeps_its_rank(kimi):
    """A retried turn restored turn 1's end a second time: it is not only the session's way
    forward, so it keeps its rank when the session goes on."""
    mgr, (p1, o1), (p2, o2), (p3, o3) = session(kimi)
    turn(mgr, "1", p1, o1)
    assert turn(mgr, "retry", np.concatenate([p1, o1, toks(200, 9)]), toks(10, 10)) == 640
    turn(mgr, "2", p2, o2)
    turn(mgr, "3", p3, o3)
    after = demoted(mgr)
    assert not after[640] and after[768] and after[1024]


def test_a_branch_inside_a_turn_demotes_nothing(kimi):
    mgr, (p1, o1), (p2, o2), _ = session(kimi)
    turn(mgr, "1", p1, o1)
    turn(mgr, "2", p2, o2)
    before = demoted(mgr)
    branch = np.concatenate([p2[:1030], toks(300, 7)])  # leaves turn 2 at 1024: a sibling
    assert turn(mgr, "b", branch, toks(10, 8)) == 1024
    assert {b: d for b, d in demoted(mgr).items() if b in before} == before


def test_a_restored_checkpoint_keeps_its_rank(kimi):
    mgr, (p1, o1), (p2, o2), (p3, o3) = session(kimi)
    turn(mgr, "1", p1, o1)
    turn(mgr, "2", p2, o2)
    # A sibling resumes from 1024 (turn 2's checkpoint): it has served a hit since.
    assert turn(mgr, "b", np.concatenate([p2[:1030], toks(300, 7)]), toks(10, 8)) == 1024
    turn(mgr, "3", p3, o3)
    after = demoted(mgr)
    assert after[768] and not after[1024] and after[640]


def test_a_recency_order_records_the_rule_and_ranks_nothing_first(kimi, monkeypatch):
    """Under LRU the checkpoints a session went past are recorded (a switch into value
    eviction ranks them first, tests/core/test_policy_switch.py) and evicted in the order
    they would be without the rule."""
    from tests.core.test_policy_switch import _victims

    def serve(mgr):
        for rid, (p, o) in zip("123", turns):
            turn(mgr, rid, p, o)
        return mgr

    mgr, *turns = session(kimi, "lru")
    serve(mgr)
    assert {b for b, d in demoted(mgr).items() if d} == {592, 640, 768, 1024, 1040, 1184}  # + prompt ends
    monkeypatch.setattr(manager_module, "supersede", lambda index, restore: None)
    plain = serve(session(kimi, "lru")[0])
    assert _victims(mgr) == _victims(plain)


def _hit_rate(spec, trace: Trace, capacity: int) -> float:
    """Token hit rate of the simulator's replay under the fixed policy's interval checkpoints."""
    rules = f"last-token+turn-end+branch-point+interval:{checkpoint_interval(spec, 16)}"
    run = Replay(trace, spec, capacity, CacheConfig(hash_unit=16, admission=rules))
    run.advance()
    return run.hit_tokens / sum(run.tally.prompt.values())


@pytest.mark.slow
def test_long_agent_sessions_keep_their_hit_rate(kimi, monkeypatch):
    """The measured case (module docstring of hybridcache.superseded): agent sessions at
    4 GiB under the fixed policy's interval checkpoints, 1,000 requests: 0.918 with the
    rule, 0.875 without (2026-12-05)."""
    trace = Trace("<agent:0>", "tokens", generate("agent", 1000, seed=0, tenants=2))
    with_rule = _hit_rate(kimi, trace, 4 << 30)
    monkeypatch.setattr(manager_module, "supersede", lambda index, restore: None)
    without = _hit_rate(kimi, trace, 4 << 30)
    assert with_rule > without + 0.02, (with_rule, without)
