"""vllm-native: vLLM's own KVCacheManager driven by the simulator (skipped without vLLM)."""

from __future__ import annotations

import pytest

from hybridcache.sim.policies import build_policy
from hybridcache.sim.runner import run_one
from hybridcache.sim.traces import Trace
from hybridcache.sim.vllm_native import NativeUnavailable, check_available, unavailable_reason
from tests.sim.conftest import token_trace, toks


def test_block_traces_are_refused():
    t = Trace("<mc>", "mooncake", [], block_tokens=512)
    assert "token traces only" in unavailable_reason(t)
    with pytest.raises(NativeUnavailable):
        check_available(t)


@pytest.mark.vllm
def test_native_hits_by_hand(kimi):
    if unavailable_reason() is not None:
        pytest.skip(unavailable_reason())
    short, long = toks(1000, 1), toks(5000, 2)
    t = token_trace(short, short, long, long, long, out=8)
    native = run_one(t, build_policy("vllm-native", kimi, 16), 8 << 30)
    # 1,000 tokens never fill a 1,920-token block. The 5,000-token prompt is cut at the last
    # block boundary before its end (3,840), whose state vLLM's manager keeps at first sight:
    # the 2nd and 3rd copies hit 3,840 tokens each.
    assert native.hit_tokens == 2 * 3840
    assert native.per_tenant == {"": 7680 / 17000}
    # The emulation saves a boundary only on its second sight (min_seen=2, as vLLM's engine
    # was measured to do end to end): one hit fewer.
    align = run_one(t, build_policy("vllm-align", kimi, 16), 8 << 30)
    assert align.hit_tokens == 3840
