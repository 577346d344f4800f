"""Marconi's alpha tuning and incremental replays: the shortcuts must not change results.

The sweep continues the winning tuning candidate instead of replaying its window again,
and skips the other candidates when the window evicted nothing; both are only valid if
they give exactly what the plain procedure (every candidate over the window, then a fresh
replay with the winner) gives.
"""

from __future__ import annotations

import dataclasses

from hybridcache.sim.generate import generate
from hybridcache.sim.policies import MARCONI_ALPHAS, build_policy
from hybridcache.sim.replay import Replay, replay
from hybridcache.sim.runner import TUNE_MIN_REQUESTS, run_one, tune_marconi, tune_window
from hybridcache.sim.traces import Trace

SMALL = 2 << 30  # evicts on the mixed workload below
#: Capacities that evict on it; the candidates' windows differ on at least one of them.
TUNED = (1 << 30, 2 << 30, 3 << 30)
BIG = 64 << 30  # holds all of it


def mixed(n: int = 160, seed: int = 3) -> Trace:
    return Trace("<mixed>", "tokens", generate("mixed", n, seed=seed, tenants=2))


def fields(r):
    d = r.as_json()
    for k in ("wall_s", "tune_s", "settings"):
        d.pop(k)
    return d


def test_advance_in_pieces_equals_one_replay(kimi):
    t = mixed()
    cfg = build_policy("hybridcache", kimi, 16).config
    run = Replay(t, kimi, SMALL, cfg)
    for stop in (1, 7, 40, 41, 100, None):
        run.advance(stop)
    assert run.evictions > 0
    assert fields(run.result("x")) == fields(replay(t, kimi, SMALL, cfg, "x"))


def test_tuning_matches_replaying_every_candidate(kimi):
    t = mixed()
    setup = build_policy("marconi", kimi, 16)
    differed = False
    for cap in TUNED:
        res = run_one(t, setup, cap)
        alpha, n = res.settings["marconi_alpha"], res.settings["marconi_tune_requests"]
        assert 0 < n < len(t.requests) and res.tune_s > 0
        rates = []
        for a in MARCONI_ALPHAS:
            cfg = dataclasses.replace(setup.config, marconi_alpha=a)
            rates.append(replay(t, kimi, cap, cfg, "marconi", limit=n).hit_tokens)
        assert alpha == MARCONI_ALPHAS[rates.index(max(rates))]  # first of the best
        differed |= len(set(rates)) > 1
        # The continued winner is the fresh replay with the winning alpha.
        cfg = dataclasses.replace(setup.config, marconi_alpha=alpha)
        assert fields(res) == fields(replay(t, kimi, cap, cfg, "marconi"))
    assert differed  # at some capacity the candidates did not all tie


def test_no_eviction_in_the_window_skips_the_other_candidates(kimi):
    t = mixed()
    alpha, best, extra = tune_marconi(t, build_policy("marconi", kimi, 16), BIG, None)
    assert (alpha, extra, best.evictions) == (MARCONI_ALPHAS[0], 0.0, 0)
    assert best.next == tune_window(len(t.requests), None)  # the whole window, one candidate


def test_tune_window_follows_the_fill():
    # Two fills' worth of requests, at least the minimum, at most 15 % of the trace.
    assert tune_window(4000, 67) == 134
    assert tune_window(4000, 260) == 520
    assert tune_window(4000, 20) == TUNE_MIN_REQUESTS
    assert tune_window(4000, 500) == 600
    assert tune_window(4000, None) == 600
    assert tune_window(120, 30) == tune_window(120, None) == TUNE_MIN_REQUESTS
    assert tune_window(10, None) == 10
