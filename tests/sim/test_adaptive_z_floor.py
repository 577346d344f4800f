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
    """qwen3-next-80b, mixed requests, seed 9, 1 GiB (rate 1: the shadows are the live
    cache's size). Measured 2026-12-06: with the floor, two switches and 0.314; without it,
    five in 200 requests (``prompt-turn-recency`` at request 48, which ends at 0.19 as a
    fixed policy, then back and forth between three others) and 0.263, against the starting
    setting's 0.329 as a fixed policy. Fails with the floor at 0."""
    spec = get_preset("qwen3-next-80b")
    trace = Trace("<mixed:9>", "tokens", generate("mixed", 200, seed=9, tenants=2))
    out, floor_in_force = {}, adaptive.Z_FLOOR
    for floor in (floor_in_force, 0.0):
        monkeypatch.setattr(adaptive, "Z_FLOOR", floor)
        run = Replay(trace, spec, 1 << 30, ADAPTIVE)
        assert run.mgr.rate == 1.0
        out[floor] = (run.mgr.switches, whole_trace(run))
    (kept, kept_hit), (noisy, noisy_hit) = out[floor_in_force], out[0.0]
    assert len(kept) < len(noisy) and kept_hit > noisy_hit + 0.02, (out,)
