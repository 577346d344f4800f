"""The long-trace script (``benchmarks/long_cells.py``): a cell's figures hang together (the
start and the best are candidates replayed as fixed managers, the gap is their
difference), on a short trace."""

from __future__ import annotations

import numpy as np

from benchmarks import long_cells as mod
from benchmarks.bench_manager import serve_requests
from hybridcache.adaptive import candidate_settings
from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.presets import get_preset
from hybridcache.sim.generate import generate
from hybridcache.sim.traces import TraceRequest


def test_a_cell_compares_the_adaptive_policy_with_its_candidates_fixed():
    spec = get_preset("kimi-linear-48b")
    r = mod.cell("kimi-linear-48b", "chat", 0, 1, 40)
    names = [c.name for c in candidate_settings(spec, 16)]
    assert list(r["fixed"]) == names
    assert r["start"] == r["fixed"][names[0]]
    assert r["best_rate"] == max(r["fixed"].values()) == r["fixed"][r["best"]]
    assert r["gap"] == r["adaptive"] - r["best_rate"]
    assert 0.0 < r["adaptive_flops"] <= 1.0 and r["fed"] > 0 and r["shadow_work"] > 0
    # The adaptive figure is the loop's own: the same requests through a fresh manager.
    _, hit, prompt = serve_requests(HybridCacheManager(spec, 1 << 30, CacheConfig(hash_unit=16, admission="adaptive")),
                                    generate("chat", 40, seed=0, tenants=2))
    assert r["adaptive"] == hit / prompt
    assert ("behind" in mod.line(r)) == (r["gap"] < -mod.TOLERANCE)
    # 40 requests end no exploration: nothing fed after one, and the bucket in credit.
    assert r["explored_at"] is None and r["fed_after"] == 0 and r["credit_over_live"] > 0
    assert "still exploring" in mod.line(r)
    ended = dict(r, explored_at=30, fed_after=2)
    assert "2 after the exploration, which ended at request 30" in mod.line(ended)


def test_flops_weigh_each_request_by_its_own_prompt():
    """A short prompt, then a long one twice: only the last hits, so the FLOPs saved are its
    hit's FLOPs over all three prompts' (attention's cost grows with the position: a long
    prompt's tokens weigh more than a short one's)."""
    spec = get_preset("kimi-linear-48b")
    rng = np.random.default_rng(0)
    short, long_ = rng.integers(0, 50_000, 96), rng.integers(0, 50_000, 4_000)
    reqs = [TraceRequest(0.0, len(ids), 0, input_ids=ids) for ids in (short, long_, long_)]
    hit, flops = mod.rates(HybridCacheManager(spec, 4 << 30, CacheConfig(hash_unit=16)), reqs)
    h = 3_984  # the last unit boundary before the long prompt's last token
    f = spec.flops.prefill_flops
    assert hit == h / (96 + 2 * 4_000)
    assert flops == f(0, h) / (f(0, 96) + 2 * f(0, 4_000))
    assert flops > hit


def test_a_request_the_cache_cannot_hold_counts_as_a_miss():
    """As in the simulator's replay: a prompt too long for the cache is served without a
    hit. Left out, a falcon-h1-7b agentic cell at 2 GiB read 0.849 over the 349 of 1,000
    requests it held, 0.051 over all of them."""
    spec = get_preset("kimi-linear-48b")
    rng = np.random.default_rng(1)
    short, huge = rng.integers(0, 50_000, 4_000), rng.integers(0, 50_000, 200_000)
    reqs = [TraceRequest(0.0, len(ids), 0, input_ids=ids) for ids in (short, huge, short)]
    refused: list[int] = []
    serve_requests(HybridCacheManager(spec, 1 << 30, CacheConfig(hash_unit=16)), reqs, refused)
    assert refused == [1]  # 1 GiB holds about 133,000 tokens of this model's KV
    hit, flops = mod.rates(HybridCacheManager(spec, 1 << 30, CacheConfig(hash_unit=16)), reqs)
    h, f = 3_984, spec.flops.prefill_flops
    assert hit == h / (2 * 4_000 + 200_000)
    assert flops == f(0, h) / (2 * f(0, 4_000) + f(0, 200_000))
