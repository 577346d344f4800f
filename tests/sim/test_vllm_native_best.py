"""vllm-native-best: vLLM's real Scheduler at prefix_match_unit 16, retention None (skipped
without vLLM)."""

from __future__ import annotations

import pytest

from hybridcache.sim.policies import build_policy, parse_policies
from hybridcache.sim.runner import run_one
from hybridcache.sim.vllm_native import unavailable_reason
from tests.sim.conftest import token_trace, toks


def test_policy_is_listed_and_uses_the_replay_unit(kimi):
    assert "vllm-native-best" in parse_policies("all")
    setup = build_policy("vllm-native-best", kimi, 16)
    assert setup.native and setup.config.hash_unit == 16
    assert build_policy("vllm-native", kimi, 16).config.hash_unit > 16


@pytest.mark.vllm
def test_native_best_hits_inside_the_block_by_hand(kimi):
    if unavailable_reason() is not None:
        pytest.skip(unavailable_reason())
    short, long = toks(1000, 1), toks(5000, 2)
    t = token_trace(short, short, long, long, long, out=8)
    best = run_one(t, build_policy("vllm-native-best", kimi, 16), 8 << 30)
    # The scheduler ends a chunk at the prompt's last 16-token boundary below its end
    # (992 of 1,000; 4,992 of 5,000) and vLLM's Mamba manager keeps that state at first
    # sight, inside the 1,920-token block: every repeat hits it.
    assert best.hit_tokens == 992 + 2 * 4992
    assert best.settings["engine"] == "vllm Scheduler"
    default = run_one(t, build_policy("vllm-native", kimi, 16), 8 << 30)
    assert default.hit_tokens == 2 * 3840 < best.hit_tokens


@pytest.mark.vllm
def test_native_best_respects_tenants(kimi):
    if unavailable_reason() is not None:
        pytest.skip(unavailable_reason())
    p = toks(600, 3)
    t = token_trace(p, p, p, out=4, tenants=["a", "b", "a"])
    best = run_one(t, build_policy("vllm-native-best", kimi, 16), 8 << 30)
    assert best.per_tenant["b"] == 0 and best.hit_tokens == 592


@pytest.mark.vllm
def test_manager_level_driver_at_unit_16_gives_every_block_back(kimi):
    """bench_manager's vLLM driver at prefix_match_unit 16: partial hits copy on write,
    and the blocks those copies retain go back to the pool (as vLLM's scheduler does)."""
    if unavailable_reason() is not None:
        pytest.skip(unavailable_reason())
    from hybridcache.sim import vllm_native as vn
    from hybridcache.sim.replay import Tally

    v = vn._vllm()
    mgr, hasher, block = vn.fine_manager(v, kimi, 8 << 30, 16)
    short, long = toks(1000, 1), toks(5000, 2)
    t = token_trace(short, short, long, long, out=8)
    tally = Tally(kimi)
    for i, r in enumerate(t.requests):
        vn._one(v, mgr, hasher, tally, str(i), r, block, 16)
    assert tally.hit.get("", 0) == 992 + 4992
    assert mgr.block_pool.get_num_free_blocks() == mgr.block_pool.num_gpu_blocks - 1


@pytest.mark.vllm
def test_native_best_counts_a_prompt_larger_than_the_pool_as_a_miss(kimi):
    """A prompt vLLM cannot hold at this capacity is aborted and counted as served without a
    hit (as the manager's replay counts a refused request); the requests after it go on."""
    if unavailable_reason() is not None:
        pytest.skip(unavailable_reason())
    short, huge = toks(1000, 1), toks(150_000, 2)
    t = token_trace(short, huge, short, out=4)
    best = run_one(t, build_policy("vllm-native-best", kimi, 16), 1 << 30)
    assert best.rejected_requests == 1
    assert best.prompt_tokens == 151_000 + 1000 and best.hit_tokens == 992
