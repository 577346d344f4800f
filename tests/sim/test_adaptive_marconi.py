"""The adaptive policy with the Marconi candidate (hybridcache.adaptive.MARCONI_CANDIDATE, not
in the default set): adopting it switches the live cache's eviction policy mid-trace."""

from __future__ import annotations

import pytest

from hybridcache import adaptive
from hybridcache.manager import CacheConfig
from hybridcache.sim.generate import generate
from hybridcache.sim.replay import Replay
from hybridcache.sim.traces import Trace


@pytest.mark.slow
def test_adopting_marconi_switches_the_live_eviction_policy(kimi, monkeypatch):
    default = adaptive.candidate_settings
    assert all(c.weighting != "marconi" for c in default(kimi, 16))
    monkeypatch.setattr(adaptive, "candidate_settings", lambda spec, unit: default(spec, unit, marconi=True))
    # Agentic sessions at 1 GiB: Marconi's utility eviction leads there for a while (its
    # shadow at rate 1 is the real policy): adopted at request 104 of 200 and left for
    # ``no-prompt-end`` at 160, so the live cache switches policy both ways. (Seed 8 until
    # the rules' save points took their slots before the step's pages, 2026-12-05; there
    # it is no longer adopted. Of agentic seeds 0-11 at 1 GiB, 4 and 7 adopt it now.)
    trace = Trace("<agentic>", "tokens", generate("agentic", 200, seed=4, tenants=2))
    run = Replay(trace, kimi, 1 << 30, CacheConfig(hash_unit=16, admission="adaptive"))
    run.advance()
    mgr = run.mgr
    names = [name for _, name in mgr.switches]
    assert "marconi" in names and names[-1] != "marconi", mgr.switches  # adopted, then left
    assert mgr.index.eviction == mgr.config.eviction == ("marconi" if mgr.current == "marconi" else "value")
    mgr.check_invariants()
    assert mgr.clear() > 0 and mgr.arena.pages_in_use == 0 and mgr.arena.slots_in_use == 0
