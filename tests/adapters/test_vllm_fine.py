"""Sub-block hits inside vLLM (``--prefix-match-unit``): ours vs vLLM at its strongest.

vLLM's real ``Scheduler`` runs both sides; the simulated worker of
:mod:`vllm_sched_harness` applies ``kv_cache_block_copies`` as vLLM's worker does (whole
blocks, every layer, before the state column copy and the forward pass) and checks every
KV position and every starting state it reads, so a tail restored from a wrong block, a
partial page not copied, or a tail written after it was cached fails the run. vLLM's side
is at its strongest setting: ``prefix_match_unit`` 16 and retention interval ``None``.
"""

from __future__ import annotations

import pytest

try:
    from hybridcache.adapters.vllm import HybridCacheScheduler
except ImportError as exc:  # vLLM missing or unsupported: nothing to test here
    pytest.skip(f"vLLM adapter not importable: {exc}", allow_module_level=True)

import vllm_sched_harness as h  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm_sched_harness import (  # noqa: E402
    DEFAULT_ADMISSION,
    assert_native_clean,
    assert_ours_clean,
    random_stream,
)

pytestmark = pytest.mark.vllm

UNIT = 16
ADMISSIONS = (DEFAULT_ADMISSION, DEFAULT_ADMISSION + "+interval:128", "last-token",
              "chunk-end+turn-end", "last-token+turn-end+branch-point")
EVICTIONS = ("value", "lru", "marconi")


def native_best(model_dir, **kw):
    return h.make_scheduler(model_dir, Scheduler, prefix_match_unit=UNIT, retention=None, **kw)


def ours_fine(model_dir, **kw):
    return h.make_scheduler(model_dir, HybridCacheScheduler, prefix_match_unit=UNIT, **kw)


def short_sessions(seed: int = 0) -> dict[str, list[h.Turn]]:
    """Sessions and questions whose prompts end inside 64-token blocks."""
    return h.chats_and_document(seed, chats=3, turns=3, first=(20, 7), later=(15, 3),
                                answers=(20, 12), questions=3)


def test_sub_block_hits_at_least_vllm_strongest_per_request(model_dir):
    sessions = short_sessions()
    native = native_best(model_dir, num_blocks=400)
    res_n = h.drive(native, sessions)
    ours = ours_fine(model_dir, num_blocks=400)
    res_o = h.drive(ours, sessions)
    assert_ours_clean(ours)
    assert res_o.outputs == res_n.outputs
    assert sum(res_o.hits.values()) > sum(res_n.hits.values())
    for rid, hit in res_o.hits.items():
        assert hit >= res_n.hits[rid], rid
    stats = ours.kv_cache_manager.stats()
    assert stats["tail_hits"] > 0 and stats["saves_dropped"] == 0
    # Hits inside a block: not every hit is a multiple of the block.
    assert any(hit % h.BLOCK for hit in res_o.hits.values())


def test_sub_block_tails_are_on_by_default_and_can_be_turned_off(model_dir):
    on = h.make_scheduler(model_dir, HybridCacheScheduler, num_blocks=400)
    assert on.kv_cache_manager.tails is not None and on.kv_cache_manager.tails.unit == 16
    ours = h.make_scheduler(model_dir, HybridCacheScheduler, num_blocks=400,
                            additional_config={"hybridcache": {"prefix_match_unit": 0}})
    assert ours.kv_cache_manager.tails is None
    res = h.drive(ours, short_sessions())
    assert all(hit % h.BLOCK == 0 for hit in res.hits.values())


def test_a_unit_that_does_not_divide_the_block_is_refused(model_dir):
    with pytest.raises(ValueError, match="does not divide"):
        h.make_scheduler(model_dir, HybridCacheScheduler, num_blocks=400,
                         additional_config={"hybridcache": {"prefix_match_unit": 24}})


def test_skipping_the_partial_page_copy_fails(model_dir, monkeypatch):
    """Mutation: restoring a tail's state but not its partial attention page."""
    ours = ours_fine(model_dir, num_blocks=400)
    tails = ours.kv_cache_manager.tails
    real = tails.restore

    def state_only(rid, tail, kv_blocks, state_blocks):
        real(rid, tail, [], state_blocks)

    monkeypatch.setattr(tails, "restore", state_only)
    with pytest.raises(AssertionError, match="KV at"):
        h.drive(ours, short_sessions())


def test_skipping_the_state_copy_fails(model_dir, monkeypatch):
    """Mutation: the partial page is copied but the request starts from a stale state."""
    ours = ours_fine(model_dir, num_blocks=400)
    tails = ours.kv_cache_manager.tails
    real = tails.restore
    monkeypatch.setattr(tails, "restore", lambda rid, tail, kv, st: real(rid, tail, kv, []))
    with pytest.raises(AssertionError, match="starts from state"):
        h.drive(ours, short_sessions())


@pytest.mark.parametrize("seed", range(26))
def test_random_streams_with_sub_block_tails(model_dir, seed):
    """Every admission rule and eviction policy (cycled by seed), pools large and tiny."""
    sessions, kw = random_stream(seed)
    kw["additional_config"] = {"hybridcache": {
        "admission": ADMISSIONS[seed % len(ADMISSIONS)],
        "eviction": EVICTIONS[seed % len(EVICTIONS)],
    }}
    native = native_best(model_dir, num_blocks=kw["num_blocks"], max_batched=kw["max_batched"])
    res_n = h.drive(native, sessions)
    ours = ours_fine(model_dir, **kw)
    res_o = h.drive(ours, sessions)
    assert_native_clean(native)
    assert_ours_clean(ours)
    assert res_o.outputs == res_n.outputs
