"""The adaptive policy's opt-in candidates (not in the default set): with the Marconi candidate
(hybridcache.adaptive.MARCONI_CANDIDATE) adopting it switches the live cache's eviction
policy mid-trace; vLLM's rules at its own block (candidates.align_blocks_candidate)."""

from __future__ import annotations

import pytest

from hybridcache import adaptive
from hybridcache.manager import CacheConfig
from hybridcache.presets import get_preset
from hybridcache.sim.generate import generate
from hybridcache.sim.replay import Replay
from hybridcache.sim.traces import Trace


@pytest.mark.slow
def test_adopting_marconi_switches_the_live_eviction_policy(kimi, monkeypatch):
    default = adaptive.candidate_settings
    assert all(c.weighting != "marconi" for c in default(kimi, 16))
    monkeypatch.setattr(adaptive, "candidate_settings", lambda spec, unit: default(spec, unit, marconi=True))
    # Agent sessions at 1 GiB: Marconi's utility eviction leads there late (its shadow at
    # rate 1 is the real policy) and is adopted at request 184 of 260 (measured 2026-12-06,
    # since the count rule's z bound has its floor; agentic seed 4 until then, where it was
    # adopted at 104 and left at 160). The way back is forced at 200, so that the live
    # cache switches policy both ways with requests served after each switch.
    trace = Trace("<agent>", "tokens", generate("agent", 260, seed=10, tenants=2))
    run = Replay(trace, kimi, 1 << 30, CacheConfig(hash_unit=16, admission="adaptive"))
    run.advance(200)
    mgr = run.mgr
    assert mgr.current == "marconi" and [name for _, name in mgr.switches][-1] == "marconi", mgr.switches
    assert mgr.index.eviction == mgr.config.eviction == "marconi"
    mgr.check_invariants()
    mgr._adopt(mgr._shadow("no-prompt-end"))
    assert mgr.index.eviction == mgr.config.eviction == "value"
    run.advance()
    mgr.check_invariants()
    assert mgr.index.eviction == mgr.config.eviction == ("marconi" if mgr.current == "marconi" else "value")
    assert mgr.clear() > 0 and mgr.arena.pages_in_use == 0 and mgr.arena.slots_in_use == 0


def test_the_align_blocks_candidate_is_opt_in_at_vllms_block(kimi, monkeypatch):
    """``align_blocks=True`` adds vLLM's rules at its own block (Kimi Linear 48B: 1,920
    tokens, rounded up to the unit), which the shadows run like any other candidate; where
    the block is the unit it is ``seen-twice-align``'s rules with vLLM's LRU: vLLM's own
    setting, which the default set no longer holds (the set grows by it, no duplicate)."""
    default = adaptive.candidate_settings
    names = [c.name for c in default(kimi, 16)]
    assert "seen-twice-blocks" not in names
    extra = default(kimi, 16, align_blocks=True)
    assert extra[-1] == ("seen-twice-blocks", "last-block:1920+seen-branch", "recency", 2)
    assert default(kimi, 512, align_blocks=True)[-1].admission == "last-block:2048+seen-branch"
    jamba = get_preset("jamba-mini")  # vLLM's block 80: at a 128-token unit, one unit
    at_unit = default(jamba, 128, align_blocks=True)
    assert at_unit[:-1] == default(jamba, 128)
    assert at_unit[-1] == ("seen-twice-blocks", "last-token+seen-branch", "recency", 2)
    assert len({c[1:] for c in at_unit}) == len(at_unit)
    monkeypatch.setattr(adaptive, "candidate_settings", lambda spec, unit: default(spec, unit, align_blocks=True))
    trace = Trace("<docs>", "tokens", generate("docs", 120, seed=3, tenants=2))
    run = Replay(trace, kimi, 4 << 30, CacheConfig(hash_unit=16, admission="adaptive"))
    run.advance()
    mgr = run.mgr
    mgr.check_invariants()
    shadow = mgr._shadow("seen-twice-blocks")
    assert shadow.mgr.admission.last_block == 1920 and shadow.mgr.metrics.hit_tokens > 0
