"""Each policy's distinctive behaviour on hand-made traces, with hit counts worked out by hand.

Token traces use the default 16-token unit; the model is Kimi Linear 48B (vLLM's inflated
block for it is 1,920 tokens, hybridcache's checkpoint interval 16,160 tokens at unit 16).
Capacities are large enough that nothing is evicted, so the hits follow from admission
alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.errors import UnknownNameError
from hybridcache.sim.policies import (
    build_policy,
    checkpoint_interval,
    parse_policies,
    stateless,
    vllm_align_block,
)
from hybridcache.sim.replay import replay
from hybridcache.sim.runner import run_one
from tests.sim.conftest import token_trace, toks

BIG = 64 << 30


def hits(name, trace, spec, cap=BIG):
    """Per-request hit tokens of ``name`` (replayed one request longer each time)."""
    setup = build_policy(name, spec, 16)
    out, prev = [], 0
    for n in range(1, len(trace.requests) + 1):
        sub = type(trace)(trace.path, trace.format, trace.requests[:n])
        h = run_one(sub, setup, cap).hit_tokens
        out.append(h - prev)
        prev = h
    return out


def test_vllm_block_and_checkpoint_interval(kimi):
    # Per layer: KDA state 32*128*128*4 + 3*32*128*3*2 = 2,170,880 B; MLA 576*2 = 1,152 B/token.
    # 128 * ceil(2,170,880 / (128 * 1,152)) = 128 * 15.
    assert vllm_align_block(kimi) == 1920
    # 3 * 43,417,600 B / 8,064 B per token = 16,152.4 -> rounded up to the unit.
    assert checkpoint_interval(kimi, 16) == 16160
    assert checkpoint_interval(kimi, 512) == 16384


def test_short_prompt_never_hits_under_vllm_align_but_does_under_hybridcache(kimi):
    p = toks(1000, 1)
    t = token_trace(p, p, p)
    # hybridcache: a snapshot at the last unit boundary before the last token, 999//16*16 = 992.
    assert hits("hybridcache", t, kimi) == [0, 992, 992]
    # vLLM: 1,000 tokens are less than one 1,920-token block: nothing is ever cached.
    assert hits("vllm-align", t, kimi) == [0, 0, 0]


def test_vllm_align_saves_a_boundary_only_when_seen_before(kimi):
    p = toks(5000, 2)
    t = token_trace(p, p, p)
    # Last block boundary before the prompt end: 4999 // 1920 * 1920 = 3840. The first request
    # wants it (seen once: not saved), the second saves it, the third hits it.
    assert hits("vllm-align", t, kimi) == [0, 0, 3840]


def test_marconi_pays_off_a_shared_input_prefix_on_its_third_occurrence(kimi):
    shared = toks(1024, 3)
    t = token_trace(*(np.concatenate([shared, toks(100, 10 + i)]) for i in range(3)))
    # 1st: snapshot at its last token only. 2nd: KV hit 1024 but no snapshot there -> 0; it
    # saves one at the branch point 1024. 3rd: hits 1024.
    assert hits("marconi", t, kimi) == [0, 0, 1024]
    # States free: the KV hit is usable from the 2nd occurrence.
    assert hits("kv-only", t, kimi) == [0, 1024, 1024]


def test_hybridcache_checkpoints_let_the_second_occurrence_hit(kimi):
    shared = toks(20000, 4)
    t = token_trace(*(np.concatenate([shared, toks(100, 20 + i)]) for i in range(3)))
    # The 2nd request resumes from the checkpoint at 16,160; the 3rd from the branch point.
    assert hits("hybridcache", t, kimi) == [0, 16160, 20000]
    assert hits("marconi", t, kimi) == [0, 0, 20000]


def test_sglang_turn_end_state_serves_the_next_turn(kimi):
    p1, o1 = toks(500, 5), toks(100, 6)
    p2 = np.concatenate([p1, o1, toks(50, 7)])
    t = token_trace(p1, p2, outputs=[o1, toks(10, 8)])
    # The turn-end state sits at (500 + 100) // 16 * 16 = 592 and the next prompt repeats it.
    assert hits("sglang", t, kimi) == [0, 592]
    # Without turn-end states, the last-token state at 499 // 16 * 16 = 496 is the deepest.
    assert hits("marconi", t, kimi) == [0, 496]


def test_sglang_extra_track_interval(kimi):
    a = toks(1000, 9)
    b = np.concatenate([a[:900], toks(100, 11)])
    t = token_trace(a, b)
    # The first request leaves states every 256 tokens: 256, 512, 768 (and 992). The second
    # shares 900 tokens: KV hit 896 (56 whole units), deepest state at or below it 768.
    assert hits("sglang-extra", t, kimi) == [0, 768]
    assert hits("sglang", t, kimi) == [0, 0]


def test_tenants_never_share(kimi):
    p = toks(3000, 12)
    t = token_trace(p, p, p, p, tenants=["a", "b", "a", None])
    res = run_one(t, build_policy("kv-only", kimi, 16), BIG)
    # Only the 3rd request (tenant a again) hits: 2999 // 16 * 16 = 2992 tokens.
    assert res.hit_tokens == 2992
    assert res.per_tenant == {"": 0.0, "a": 2992 / 6000, "b": 0.0}


def test_stateless_copy_keeps_kv_and_flops(kimi):
    s = stateless(kimi)
    assert s.state_groups == () and s.flops == kimi.flops
    assert s.kv_bytes_per_token == kimi.kv_bytes_per_token


def test_policy_names():
    assert parse_policies("all")[0] == "hybridcache" and "vllm-native" in parse_policies("all")
    assert parse_policies("marconi, kv-only,marconi") == ["marconi", "kv-only"]
    with pytest.raises(UnknownNameError, match="known: hybridcache"):
        parse_policies("lru")


def test_turn_end_dropped_without_output_tokens(kimi):
    s = build_policy("sglang", kimi, 512, outputs_known=False)
    assert s.config.admission == "last-token"
    assert "turn-end" in build_policy("hybridcache", kimi, 16).config.admission


def test_requests_too_big_for_the_cache_count_as_misses(kimi):
    p = toks(40000, 13)
    t = token_trace(p, p)
    # 256 MiB holds a few snapshots but not 40,000 tokens of KV (~323 MB): both rejected.
    res = replay(t, kimi, 256 << 20, build_policy("hybridcache", kimi, 16).config, "hybridcache")
    assert res.rejected_requests == 2 and res.prompt_tokens == 80000 and res.token_hit_rate == 0.0


def test_pure_state_model_under_eviction_pressure():
    """Mamba2 has no KV pages (every node's pages are ``()``): a node a request holds must
    still leave the eviction queue, or a later eviction picks it while it is in use."""
    from hybridcache.presets import get_preset
    from hybridcache.sim.generate import generate
    from hybridcache.sim.traces import Trace

    spec = get_preset("mamba2-2.7b")
    t = Trace("<agent>", "tokens", generate("agent", 30, seed=2, tenants=2))
    for name in ("sglang-extra", "hybridcache"):
        r = run_one(t, build_policy(name, spec, 16), 1 << 30)
        assert r.evictions > 0 and 0 < r.token_hit_rate < 1


def test_adaptive_policy_is_known_but_not_in_all(kimi):
    from hybridcache.adaptive import AdaptiveManager
    from hybridcache.manager import HybridCacheManager

    assert "hybridcache-adaptive" not in parse_policies("all")
    assert parse_policies("hybridcache-adaptive,sglang") == ["hybridcache-adaptive", "sglang"]
    setup = build_policy("hybridcache-adaptive", kimi, 16)
    assert setup.config.admission == "adaptive" and setup.config.eviction == "value"
    assert isinstance(HybridCacheManager(kimi, 4 << 30, setup.config), AdaptiveManager)
    # On a trace that never fills the cache it behaves as the fixed policy, plus its spare
    # checkpoints (free room only): one every spare interval of each 3,000-token prompt.
    t = token_trace(toks(3000, 1), toks(3000, 2), out=50)
    a = replay(t, kimi, 64 << 30, setup.config, "a")
    b = replay(t, kimi, 64 << 30, build_policy("hybridcache", kimi, 16).config, "b")
    spare = HybridCacheManager(kimi, 64 << 30, setup.config).spare_interval
    assert a.token_hit_rate == b.token_hit_rate
    assert a.snapshots_stored == b.snapshots_stored + 2 * (3000 // spare)
