"""vLLM's admission gate with the pages running prefills still owe (``reserves_prefills``).

vLLM admits a waiting request when its whole sequence fits in what is free now
(``full_sequence_must_fit``). A running request whose prefill is cut into chunks (at every
save point here) takes its later chunks' pages in later steps; a request admitted into that
room makes one of those allocations fail, and vLLM preempts a running request, losing its
computed tokens. The adapter's gate counts the owed pages too. No model runs: the simulated
worker of :mod:`vllm_sched_harness` checks every block of every step.
"""

from __future__ import annotations

import random

import pytest

try:
    from hybridcache.adapters.vllm import HybridCacheScheduler
    from hybridcache.adapters.vllm.manager import HybridKVCacheManager
except ImportError as exc:  # vLLM missing or unsupported: nothing to test here
    pytest.skip(f"vLLM adapter not importable: {exc}", allow_module_level=True)

import vllm_sched_harness as h  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm_sched_harness import DEFAULT_ADMISSION  # noqa: E402

pytestmark = pytest.mark.vllm

#: Checkpoints every 3 blocks: a 10-block prompt is prefilled in four chunks.
INTERVAL = {"hybridcache": {"admission": f"{DEFAULT_ADMISSION}+interval:192"}}


@pytest.mark.parametrize("reserve", [True, False])
def test_a_request_waits_for_the_pages_a_running_prefill_still_owes(model_dir, monkeypatch, reserve):
    """Request ``a`` (640 tokens, cut at 192, 384, 576) starts first; ``b`` (400 tokens)
    fits in a 20-block pool beside ``a``'s first chunk but not beside all of ``a``'s
    prompt. With the reserve ``b`` waits until ``a`` has its whole prompt and nothing is
    preempted; with vLLM's plain gate ``b`` is admitted at once and a request is
    preempted. Outputs equal vLLM's own manager's either way."""
    monkeypatch.setattr(HybridKVCacheManager, "reserves_prefills", reserve)
    rng = random.Random(5)
    sessions = {"a": [h.Turn(h.tokens(rng, 640), 4)], "b": [h.Turn(h.tokens(rng, 400), 4)]}
    native = h.make_scheduler(model_dir, Scheduler, num_blocks=20)
    res_n = h.drive(native, sessions)
    ours = h.make_scheduler(model_dir, HybridCacheScheduler, num_blocks=20, additional_config=INTERVAL)
    recorded = h.record_steps(ours)
    res = h.drive(ours, sessions)
    steps = [ids for ids, _ in recorded]
    assert res.outputs == res_n.outputs
    mgr = ours.kv_cache_manager
    assert mgr.num_tracked == 0 and not mgr.manager.requests
    mgr.port.check_invariants()
    first_b = next(i for i, s in enumerate(steps) if "b/0" in s)
    a_chunks = sum(1 for s in steps[:first_b] if "a/0" in s)
    if reserve:
        assert res.preemptions == 0
        assert a_chunks >= 4, steps[: first_b + 1]  # a's whole prompt before b starts
    else:
        assert first_b == 0 and res.preemptions > 0


@pytest.mark.parametrize("seed", [1, 2])
def test_the_reserve_cuts_preemptions_in_a_tight_pool(model_dir, monkeypatch, seed):
    """Interval checkpoints cut every prompt into chunks: in a 30-block pool vLLM's plain
    gate admits into the room running prefills still need and preempts them later
    (measured: 30 -> 9 and 23 -> 8 preemptions with the reserve). Outputs equal
    vLLM's own manager's; fewer tokens are computed again."""
    native = h.make_scheduler(model_dir, Scheduler, num_blocks=30)
    res_n = h.drive(native, h.decoding_sessions(seed))
    runs, computed = {}, {}
    for reserve in (True, False):
        monkeypatch.setattr(HybridKVCacheManager, "reserves_prefills", reserve)
        ours = h.make_scheduler(model_dir, HybridCacheScheduler, num_blocks=30, additional_config=INTERVAL)
        steps = h.record_steps(ours)
        runs[reserve] = h.drive(ours, h.decoding_sessions(seed))
        computed[reserve] = sum(n for _, n in steps)
        ours.kv_cache_manager.port.check_invariants()
    assert runs[True].outputs == runs[False].outputs == res_n.outputs
    assert runs[True].preemptions < runs[False].preemptions
    assert computed[True] < computed[False]
