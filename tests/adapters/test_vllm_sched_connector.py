"""``HybridCacheScheduler`` together with ``HybridCacheConnector`` in vLLM's real ``Scheduler``.

The tensor-backed simulated worker (:mod:`vllm_connector_harness`) runs the connector's
worker side and checks every KV position and every restored state a step reads. A first
scheduler (ours, with the connector) runs a workload and saves the snapshots our manager
keeps; a second, fresh one (empty device cache) must resume requests from the tier with
exact bytes, treat damaged entries as misses, and leave no block behind. The same runs with
vLLM's own manager + the connector give the reference hit counts.
"""

from __future__ import annotations

import random

import pytest

try:
    from hybridcache.adapters.vllm import HybridCacheScheduler
except ImportError as exc:
    pytest.skip(f"vLLM adapter not importable: {exc}", allow_module_level=True)

import tiers_testlib  # noqa: E402
import vllm_connector_harness as ch  # noqa: E402
import vllm_sched_harness as h  # noqa: E402
from vllm_connector_harness import Recording, external  # noqa: E402
from vllm_sched_harness import assert_ours_clean  # noqa: E402

from hybridcache.adapters.vllm import connector_config as cc  # noqa: E402
from hybridcache.adapters.vllm.manager_external import ConnectorKVCacheManager  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("uniproc")]
BLOCK = h.BLOCK


def chats(seed: int = 0, sessions: int = 3, turns: int = 3) -> dict[str, list[h.Turn]]:
    """Chat sessions on a shared system prompt whose answers cross block boundaries (so
    turn-end states exist), and two questions on a document."""
    return h.chats_and_document(seed, chats=sessions, turns=turns, first=(60, 11),
                                later=(30, 9), answers=(40, 40), questions=2)


def run(model_dir, extra, sessions, ours=True, tier=None, **kw):
    """:func:`vllm_connector_harness.run` with our scheduler (``ours``) or vLLM's, then
    checks that nothing leaked."""
    res, sched, worker = ch.run(model_dir, extra, sessions, tier=tier,
                                scheduler_cls=HybridCacheScheduler if ours else None, **kw)
    if ours:
        assert isinstance(sched.kv_cache_manager, ConnectorKVCacheManager)
        assert_ours_clean(sched)
        stats = sched.kv_cache_manager.stats_counters
        assert stats.external_loads == stats.external_loads_completed + stats.external_loads_dropped
    else:
        h.assert_native_clean(sched)
    return res, sched, worker


def test_second_scheduler_resumes_from_the_tier_exactly(model_dir, host_tier):
    sessions = chats()
    extra = host_tier("ours")
    first, s1, w1 = run(model_dir, extra, sessions)
    assert external(s1) == 0
    c1 = s1.kv_cache_manager.stats_counters
    assert c1.boundary_offers > 0 and c1.external_loads == 0
    saved = w1.connector.worker_stats()
    assert saved["saves"] > 0 and saved["save_failures"] == 0
    rec = Recording(cc.shared_host_tier(extra["host_name"], 0))
    second, s2, w2 = run(model_dir, extra, sessions, tier=rec)
    c2 = s2.kv_cache_manager.stats_counters
    # Requests resumed from the tier (every KV position and state checked by the worker),
    # and the loaded prefixes became device-cache entries that later requests hit.
    assert external(s2) > 0 and c2.external_loads_completed == c2.external_loads > 0
    assert c2.external_tokens == external(s2)
    assert second.outputs == first.outputs
    assert sum(second.hits.values()) > sum(first.hits.values())
    for rid, n in second.hits.items():
        assert n % BLOCK == 0 and n >= first.hits[rid], rid
    loaded = w2.connector.worker_stats()
    assert loaded["loads"] == c2.external_loads and loaded["load_failures"] == 0
    src = cc.shared_host_tier(extra["host_name"], 0)
    assert rec.gets
    for key, entry in rec.gets:  # loaded bytes are the saved bytes
        tiers_testlib.assert_same(entry, src.get(key))
    assert s2.kv_cache_manager.manager.metrics.snapshots_saved > 0

    # Repeating the same prompts, nothing can resume deeper than each prompt's last
    # boundary, which both managers keep; the comparison is in the next test.


def continuations(sessions: dict[str, list[h.Turn]], res: h.DriveResult,
                  seed: int) -> dict[str, list[h.Turn]]:
    """Each chat's whole history after ``res`` plus a new user turn (a restarted engine
    continuing the conversations)."""
    rng = random.Random(seed)
    out = {}
    for s, turns in sessions.items():
        if not s.startswith("s"):
            continue
        history: list[int] = []
        for k, turn in enumerate(turns):
            history += turn.new_tokens + res.outputs[f"{s}/{k}"]
        out[s] = [h.Turn(history + h.tokens(rng, 37), 8)]
    return out


def test_restarted_engine_continues_chats_deeper_than_native(model_dir, host_tier):
    """vLLM's manager + connector vs ours + connector: a first engine serves the chats, a
    new one (empty device cache) serves each chat's next turn. vLLM's align mode keeps
    only prompt-end states, so the new turn resumes at the previous prompt's last boundary;
    ours also hands the connector the turn-end state (after the answer)."""
    sessions = chats(5)
    got = {}
    for ours in (False, True):
        extra = host_tier("ours" if ours else "native")
        first, _, _ = run(model_dir, extra, sessions, ours=ours)
        nxt = continuations(sessions, first, 6)
        second, s2, _ = run(model_dir, extra, nxt, ours=ours)
        got[ours] = (first, second, external(s2))
    (n1, n2, n_ext), (o1, o2, o_ext) = got[False], got[True]
    assert o1.outputs == n1.outputs and o2.outputs == n2.outputs
    print(f"\ncached tokens, 1st engine: native+connector {sum(n1.hits.values())}, ours+connector "
          f"{sum(o1.hits.values())}; next turns on a new engine: native+connector "
          f"{sum(n2.hits.values())} (external {n_ext}), ours+connector "
          f"{sum(o2.hits.values())} (external {o_ext})")
    assert sum(o1.hits.values()) >= sum(n1.hits.values())
    for rid, n in o2.hits.items():
        assert n >= n2.hits[rid] and n % BLOCK == 0, rid
    assert o_ext > n_ext > 0


def test_state_offers_are_checked_end_to_end(model_dir, host_tier, monkeypatch):
    """The harness can fail: offer the block below the one that holds the state."""
    real = ConnectorKVCacheManager._run_save

    def run_save(self, mreq, sp, end):
        kept = real(self, mreq, sp, end)
        offers = self._offers.get(mreq.id, [])
        offers[:] = [(g, b - 1 if b > 1 else b + 1, n) for g, b, n in offers]
        return kept

    monkeypatch.setattr(ConnectorKVCacheManager, "_run_save", run_save)
    extra = host_tier("bad")
    sessions = chats(1, sessions=2, turns=2)
    run(model_dir, extra, sessions)
    with pytest.raises(AssertionError, match="wrong state"):
        run(model_dir, extra, sessions)


@pytest.mark.parametrize("damage", ["flip", "drop-all"])
def test_damaged_entries_are_misses(model_dir, redis_server, damage):
    extra = ch.redis_extra(redis_server.url)
    sessions = chats(2, sessions=2, turns=2)
    first, s1, w1 = run(model_dir, extra, sessions)
    assert w1.connector.tier.flush(timeout_s=10)
    client = redis_server.client()
    if damage == "flip":
        assert ch.flip_chunks(redis_server) > 0
    else:
        client.flushall()
    second, s2, w2 = run(model_dir, extra, sessions)
    stats = w2.connector.worker_stats()
    c2 = s2.kv_cache_manager.stats_counters
    assert stats["loads"] == 0 and c2.external_loads_completed == 0
    assert second.outputs == first.outputs
    if damage == "flip":
        # Offered, allocated, refused by the worker: vLLM frees the request and
        # recomputes it; everything the load allocated went back unregistered.
        assert stats["load_failures"] > 0 and c2.external_loads_dropped == c2.external_loads > 0
    else:
        assert external(s2) == 0 and c2.external_loads == 0
    for conn in (s1.connector, w1.connector, s2.connector, w2.connector):
        conn.shutdown()


def test_loads_under_memory_pressure(model_dir, host_tier):
    """A small pool: loads compete with running requests and evictions; no leak, same
    outputs, every restored block checked."""
    sessions = chats(3, sessions=4, turns=3)
    extra = host_tier("small")
    first, _, _ = run(model_dir, extra, sessions, num_blocks=40)
    second, s2, _ = run(model_dir, extra, sessions, num_blocks=40)
    assert second.outputs == first.outputs
    assert s2.kv_cache_manager.stats_counters.external_loads_completed > 0
    assert s2.kv_cache_manager.manager.index.evictions["kv"] > 0


@pytest.mark.parametrize("seed", [5, 10, 14, 22, 34])
def test_random_streams_resume_from_the_tier(model_dir, host_tier, seed):
    """Random sessions, pools of 24 to 400 blocks, every admission and eviction policy:
    an engine serves them, a new one continues every chat, a third repeats them all. Every
    restored block is checked, nothing leaks, outputs match the first engine.

    The token budget is vLLM's default (whole prompts), so several loads and prefills are
    admitted in one step: seeds 10 and 34 (24 blocks) admitted two loads that then waited
    for each other's blocks forever when the in-flight reservation ignored state slots.
    """
    sessions, kw = h.random_stream(seed)
    kw.pop("max_batched")
    extra = host_tier("r")
    first, _, _ = run(model_dir, extra, sessions, **kw)
    _, s2, _ = run(model_dir, extra, continuations(sessions, first, seed), **kw)
    third, s3, _ = run(model_dir, extra, sessions, **kw)
    assert third.outputs == first.outputs
    assert external(s2) > 0 and external(s3) > 0
    assert sum(third.hits.values()) > sum(first.hits.values())


def test_request_aborted_during_its_load_releases_everything(model_dir, host_tier):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request, RequestStatus

    sessions = {"d0": chats(4)["d0"]}
    extra = host_tier("abort")
    run(model_dir, extra, sessions)
    sched, worker = ch.make(model_dir, extra, scheduler_cls=HybridCacheScheduler)
    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    req = Request("d0/0", sessions["d0"][0].new_tokens, sp, None,
                  block_hasher=get_request_block_hasher(BLOCK, sha256))
    sched.add_request(req)
    out = sched.schedule()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not out.num_scheduled_tokens
    assert sched.kv_cache_manager.num_tracked == 1
    kv_out = worker.step(out, {})
    sched.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)
    from vllm.v1.outputs import ModelRunnerOutput

    mro = ModelRunnerOutput(req_ids=[], req_id_to_index={})
    mro.kv_connector_output = kv_out
    sched.update_from_output(out, mro)
    assert sched.kv_cache_manager.stats_counters.external_loads_dropped == 1
    assert_ours_clean(sched)


def test_other_connectors_are_refused(model_dir, tmp_path):
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                           kv_connector_extra_config={"shared_storage_path": str(tmp_path)})
    with pytest.raises(ValueError, match="only HybridCacheConnector"):
        h.make_scheduler(model_dir, HybridCacheScheduler, 100, kv_transfer_config=ktc)
