"""The count rule's z bound has a floor (``hybridcache.adaptive.Z_FLOOR``): shadows that see
every request know the requests seen exactly, but a switch is a bet on the requests to
come, and a lead the paired per-request differences cannot tell from zero is the
workload's noise. Without the floor, exact shadows switch on any lead over the 0.3 % margin
that holds for 24 requests."""

from __future__ import annotations

from hybridcache import adaptive
from hybridcache.presets import get_preset
from hybridcache.sim.generate import generate
from hybridcache.sim.replay import Replay
from hybridcache.sim.traces import Trace
from tests.sim.test_adaptive import ADAPTIVE, whole_trace


def test_exact_shadows_do_not_switch_on_a_lead_inside_the_noise(monkeypatch):
    """qwen3-next-80b, mixed requests, seed 17, 1 GiB (rate 1: the shadows are the live
    cache's size). Measured 2026-12-07 (thirty-ninth session): with the floor, two switches
    and 0.392; without it, three and 0.361. Fails with the floor at 0. Until the
    ``seen-branch`` rule (2026-12-07) the cell was mixed seed 9 (with the floor two
    switches and 0.314, without five and 0.263), then seed 11 (0.309 against 0.290) until
    vLLM's rules in the set ranked by value (``seen-twice-align``), with which seed 11 makes
    the same switches either way. The floor is not a gain on every cell: with that rule, on
    17 mixed, docs and agent cells of qwen3-next-80b at 1 GiB (seeds 5-16), it was ahead on
    2, behind on 8 (by up to 0.020, mixed seed 15) and level on 7 (docs/results.md, "Branch
    points the cache forgot"); with ``seen-twice-align``, on 64 cells (mixed, docs, agent
    and chat, seeds 5-20) ahead on 11, behind on 13, mean -0.0005 (docs/results.md, "vLLM's
    rules ranked by value")."""
    spec = get_preset("qwen3-next-80b")
    trace = Trace("<mixed:17>", "tokens", generate("mixed", 200, seed=17, tenants=2))
    out, floor_in_force = {}, adaptive.Z_FLOOR
    for floor in (floor_in_force, 0.0):
        monkeypatch.setattr(adaptive, "Z_FLOOR", floor)
        run = Replay(trace, spec, 1 << 30, ADAPTIVE)
        assert run.mgr.rate == 1.0
        out[floor] = (run.mgr.switches, whole_trace(run))
    (kept, kept_hit), (noisy, noisy_hit) = out[floor_in_force], out[0.0]
    assert len(kept) < len(noisy) and kept_hit > noisy_hit + 0.015, (out,)
