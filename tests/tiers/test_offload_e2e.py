"""Issue 6, end to end: the reference hybrid model serves a multi-turn agent session whose
device cache is lost between turns (cleared, or evicted by other traffic); the session
still hits from Redis, and every token and logits row equals the uncached run."""

from __future__ import annotations

import random

import pytest
import torch

from hybridcache.adapters.reference.check import TOLERANCE, compare
from hybridcache.adapters.reference.config import ReferenceConfig, model_spec
from hybridcache.adapters.reference.model import ReferenceModel
from hybridcache.adapters.reference.runner import RequestResult, Runner, RunnerConfig
from hybridcache.kernels.storage import ArenaStorage
from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.tiers import HostTier, RedisTier
from hybridcache.tiers.offload import LoadPlan, OffloadCoordinator

pytestmark = [
    pytest.mark.redis,
    pytest.mark.filterwarnings("ignore:The given buffer is not writable:UserWarning"),
]

CFG = ReferenceConfig()
UNIT = 16


def agent_turns(seed: int = 7, turns: int = 5) -> tuple[list[int], list[tuple[list[int], int]]]:
    """A system prompt, then per turn a tool result or user message and a reply length."""
    rng = random.Random(seed)
    system = [rng.randrange(CFG.vocab_size) for _ in range(90)]
    steps = [
        ([rng.randrange(CFG.vocab_size) for _ in range(rng.randint(8, 40))], rng.randint(5, 10))
        for _ in range(turns)
    ]
    return system, steps


def serve_session(
    *, caching: bool, tiers: list | None = None, noise: int = 0
) -> tuple[dict[str, RequestResult], OffloadCoordinator | None, dict[str, LoadPlan | None]]:
    """Serve the agent session turn by turn. With ``tiers`` the device cache is cleared
    after every turn, or, with ``noise``, evicted by that many unique 900-token prompts
    (other tenants' traffic) in an arena of ~1,500 tokens under LRU eviction."""
    spec = model_spec(CFG)
    cache_cfg = CacheConfig(
        hash_unit=UNIT,
        admission="last-token+turn-end+branch-point" if caching else "none",
        eviction="lru" if noise else "value",
    )
    capacity = (3 << 18) if noise else (3 << 20)
    manager = HybridCacheManager(spec, capacity, cache_cfg)
    storage = ArenaStorage(manager.layout, spec)
    runner = Runner(
        ReferenceModel(CFG),
        manager,
        storage,
        RunnerConfig(max_live=1, tenant_per_request=not caching),
    )
    coord = OffloadCoordinator(manager, storage, tiers) if tiers else None
    plans: dict[str, LoadPlan | None] = {}
    if coord is not None:
        runner.on_admit = lambda rid: plans.__setitem__(rid, coord.prefetch(rid))
    system, steps = agent_turns()
    rng = random.Random(99)
    history, results = list(system), {}
    for j, (message, max_new) in enumerate(steps):
        results.update(run_one(runner, f"agent/t{j}", history + message, max_new))
        history = list(results[f"agent/t{j}"].history)
        if coord is None:
            continue
        if noise:
            for k in range(noise):
                other = [rng.randrange(CFG.vocab_size) for _ in range(900)]
                run_one(runner, f"noise/{j}.{k}", other, 1)
        else:
            manager.clear()
            assert not manager.index.nodes
        assert coord.flush(10)
    return results, coord, plans


def run_one(runner: Runner, rid: str, prompt: list[int], max_new: int) -> dict[str, RequestResult]:
    runner.submit(rid, prompt, max_new)
    done: list[RequestResult] = []
    while not done:
        done = runner.step()
    return {r.rid: r for r in done}


@pytest.fixture(scope="module")
def reference() -> dict[str, RequestResult]:
    torch.set_num_threads(1)
    results, _, _ = serve_session(caching=False)
    assert not any(r.hit_tokens for r in results.values())
    return results


@pytest.mark.parametrize(
    "stack,noise",
    [("redis", 0), ("host+redis", 0), ("redis", 2)],
    ids=["cleared-redis", "cleared-host-spilling-to-redis", "evicted-by-traffic-redis"],
)
def test_agent_session_hits_from_redis_with_identical_outputs(
    reference, redis_url, make_tier, stack, noise
):
    torch.set_num_threads(1)
    redis: RedisTier = make_tier(redis_url)
    tiers: list = [redis] if stack == "redis" else [HostTier(64 << 10), redis]
    results, coord, plans = serve_session(caching=True, tiers=tiers, noise=noise)
    assert coord is not None

    compared, mismatched, worst = compare(results, reference)
    assert compared == sum(len(r.tokens) for r in reference.values()) > 0
    assert mismatched == 0 and worst <= TOLERANCE, (mismatched, worst)

    turns = sorted(rid for rid in results if rid.startswith("agent/"))
    assert results[turns[0]].hit_tokens == 0
    for prev, rid in zip(turns, turns[1:], strict=False):
        res, plan = results[rid], plans[rid]
        assert plan is not None, f"{rid}: nothing loaded"
        assert res.hit_tokens == plan.hit_tokens > 0
        assert plan.device_hit_tokens == 0  # the device had lost everything
        assert res.hit_tokens > len(results[prev].history) - 2 * UNIT  # the whole last turn
        assert plan.snapshot_boundary == plan.hit_tokens  # state came with the KV
    from_redis = sum(p.entries_by_tier.get(coord.tier_names[-1], 0) for p in plans.values() if p)
    assert from_redis > 0 and redis.stats().hits >= from_redis
    met = coord.metrics
    assert met.prefetch_hit_tokens == sum(results[r].hit_tokens for r in turns)
    assert met.prefetch_errors == met.demote_errors == met.load_invalid == 0
    if stack == "host+redis":
        assert met.spilled_entries > 0
