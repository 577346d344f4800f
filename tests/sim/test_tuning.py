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
from hybridcache.sim.runner import run_one, tune_marconi
from hybridcache.sim.traces import Trace

SMALL = 2 << 30  # evicts on the mixed workload below, and its alphas differ
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
    alpha, best, extra = tune_marconi(t, setup, SMALL, None)
    n = best.next
    assert best.evictions > 0 and 0 < n < len(t.requests) and extra > 0
    rates = []
    for a in MARCONI_ALPHAS:
        cfg = dataclasses.replace(setup.config, marconi_alpha=a)
        rates.append(replay(t, kimi, SMALL, cfg, "marconi", limit=n).hit_tokens)
    assert alpha == MARCONI_ALPHAS[rates.index(max(rates))]  # first of the best
    # The continued winner is the fresh replay with the winning alpha.
    res = run_one(t, setup, SMALL)
    cfg = dataclasses.replace(setup.config, marconi_alpha=alpha)
    assert res.settings["marconi_alpha"] == alpha
    assert fields(res) == fields(replay(t, kimi, SMALL, cfg, "marconi"))


def test_no_eviction_in_the_window_skips_the_other_candidates(kimi):
    t = mixed()
    alpha, best, extra = tune_marconi(t, build_policy("marconi", kimi, 16), BIG, None)
    assert (alpha, extra, best.evictions) == (MARCONI_ALPHAS[0], 0.0, 0)
