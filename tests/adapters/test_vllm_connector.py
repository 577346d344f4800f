"""``HybridCacheConnector`` inside vLLM's real ``Scheduler``, with a tensor-backed worker.

A first scheduler (and worker) runs a workload and saves; a second one, with an empty
device cache, runs it again and must get external hits whose every KV position and
restored state the simulated worker checks (``vllm_connector_harness``), and whose loaded
entries are byte for byte the saved ones. Corrupt, truncated, deleted or unreachable
entries must be misses (no exception, no hit, same outputs); tenants must not share.
"""

from __future__ import annotations

import pytest

try:
    import hybridcache.adapters.vllm  # noqa: F401
except ImportError as exc:
    pytest.skip(f"vLLM adapter not importable: {exc}", allow_module_level=True)

import tiers_testlib  # noqa: E402
import vllm_connector_harness as ch  # noqa: E402
import vllm_sched_harness as h  # noqa: E402
from vllm_connector_harness import Recording, external, run  # noqa: E402

from hybridcache.adapters.vllm import connector_config as cc  # noqa: E402
from hybridcache.adapters.vllm import connector_plan as cp  # noqa: E402
from hybridcache.tiers import HostTier  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("uniproc")]
BLOCK = h.BLOCK


@pytest.fixture
def host_extra(host_tier) -> dict:
    return host_tier("conn")


def workload(seed: int = 0) -> dict[str, list[h.Turn]]:
    """Two chat sessions on a shared system prompt (3 turns) and two questions on a document."""
    return h.chats_and_document(seed, chats=2, turns=3, first=(50, 9), later=(40, 7),
                                answers=(20, 16), questions=2)


def test_second_scheduler_restores_exact_kv_and_state(model_dir, host_extra):
    sessions = workload()
    first, s1, w1 = run(model_dir, host_extra, sessions)
    assert external(s1) == 0
    saved = w1.connector.worker_stats()
    assert saved["saves"] > 0 and saved["save_failures"] == 0
    rec = Recording(cc.shared_host_tier(host_extra["host_name"], 0))
    second, s2, w2 = run(model_dir, host_extra, sessions, tier=rec)
    # Every prompt's longest boundary with a saved state comes back from the tier; the
    # worker checked every KV position and state the restored requests read.
    assert external(s2) > 0
    assert sum(second.hits.values()) > sum(first.hits.values())
    for rid, n in second.hits.items():
        assert n % BLOCK == 0
        assert n >= first.hits[rid]
    assert second.outputs == first.outputs
    loaded = w2.connector.worker_stats()
    assert loaded["loads"] > 0 and loaded["load_failures"] == 0
    # Loaded bytes are the saved bytes (HostTier copies at put: compare with what w1 put).
    assert rec.gets
    src = cc.shared_host_tier(host_extra["host_name"], 0)
    for key, entry in rec.gets:
        tiers_testlib.assert_same(entry, src.get(key))
        assert any(n.startswith("kv.") for n in entry.pieces)
    hybrid = [e for k, e in rec.gets if k.fingerprint.endswith(".hy")]
    assert hybrid and all(any(n.startswith("state.") for n in e.pieces) for e in hybrid)


def test_redis_across_schedulers_and_bytes(model_dir, redis_server):
    extra = ch.redis_extra(redis_server.url)
    sessions = workload(1)
    first, s1, w1 = run(model_dir, extra, sessions)
    assert w1.connector.tier.flush(timeout_s=10)
    second, s2, w2 = run(model_dir, extra, sessions)
    assert external(s2) > 0 and second.outputs == first.outputs
    assert w2.connector.worker_stats()["load_failures"] == 0
    assert w2.connector.worker_stats()["bytes_loaded"] > 0
    for conn in (s1.connector, w1.connector, s2.connector, w2.connector):
        conn.shutdown()  # closes its RedisTier (flushing first)


@pytest.mark.parametrize("damage", ["flip", "drop-chunks", "drop-all", "server-down"])
def test_damaged_entries_are_misses(model_dir, redis_server, damage):
    extra = ch.redis_extra(redis_server.url)
    sessions = workload(2)
    first, s1, w1 = run(model_dir, extra, sessions)
    assert w1.connector.tier.flush(timeout_s=10)
    client = redis_server.client()
    if damage == "flip":
        assert ch.flip_chunks(redis_server) > 0
    elif damage == "drop-chunks":
        assert client.delete(*client.keys("hc:*}:*")) > 0
    elif damage == "drop-all":
        client.flushall()
    else:
        redis_server.stop()
    second, s2, w2 = run(model_dir, extra, sessions)
    stats = w2.connector.worker_stats()
    # No load succeeded; requests that were offered a hit were recomputed from scratch,
    # with the simulated worker checking every page and state they read.
    assert stats["loads"] == 0
    assert second.outputs == first.outputs
    if damage in ("flip", "drop-chunks"):
        assert stats["load_failures"] > 0  # the manifest was there: offered, then refused
    else:
        assert external(s2) == 0
    assert all(n % BLOCK == 0 for n in second.hits.values())


def test_tenants_are_isolated(model_dir, host_extra):
    sessions = workload(3)
    alice = dict.fromkeys(sessions, "alice")
    run(model_dir, host_extra, sessions, salts=alice)
    _, s_bob, _ = run(model_dir, host_extra, sessions, salts=dict.fromkeys(sessions, "bob"))
    assert external(s_bob) == 0
    _, s_none, _ = run(model_dir, host_extra, sessions)
    assert external(s_none) == 0
    _, s_alice, _ = run(model_dir, host_extra, sessions, salts=alice)
    assert external(s_alice) > 0


def test_consumer_does_not_save_and_producer_does_not_load(model_dir, host_extra):
    def role_run(role):
        sched, worker = ch.make(model_dir, host_extra, role=role)
        ch.drive(sched, worker, workload(4))
        return external(sched), worker.connector.worker_stats()["saves"]

    assert role_run("kv_consumer") == (0, 0)  # empty tier, and it saves nothing
    hits, saves = role_run("kv_producer")
    assert hits == 0 and saves > 0
    assert role_run("kv_producer")[0] == 0  # the tier is full, but a producer never loads
    hits, saves = role_run("kv_consumer")
    assert hits > 0 and saves == 0


# ---------------------------------------------------------------- pure logic and config
def test_best_hit_needs_a_state_at_the_end_and_no_gap():
    assert cp.best_hit([True, True, True], [False, False, False]) == (3, 0)
    assert cp.best_hit([True, False, True], [False, True, False]) == (3, 2)
    assert cp.best_hit([True, False, True], [False, False, True]) == (1, 0)
    assert cp.best_hit([False, True, True], [True, False, True]) == (3, 3)
    assert cp.best_hit([True, True, True, True], [False, True, False, True], 2) == (4, 4)
    assert cp.best_hit([True, True, True], [False, False, True], 2) == (3, 0)
    assert cp.load_kinds([True, True, False], 3) == ["kv", "kv", "hy"]
    assert cp.load_kinds([False, True, True], 2) == ["hy", "hy"]


def test_tenant_names():
    assert cp.tenant_of(None, "default") == "default"
    assert cp.tenant_of("alice", "default") == "alice"
    odd = cp.tenant_of("a:b{c}", "default")
    assert odd.startswith("x.") and odd != cp.tenant_of("a:b{d}", "default")


def test_group_offers_needs_every_state_group():
    offers = [(0, 5, 128), (1, 6, 128), (0, 7, 192), (0, 0, 256), (0, 9, 100)]
    assert cp.group_offers(offers, [0, 1], 64) == [(128, {0: 5, 1: 6})]
    assert cp.group_offers(offers, [0], 64) == [(128, {0: 5}), (192, {0: 7})]


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"tier": "disk"}, "tier"),
        ({"tier": "redis"}, "url"),
        ({"url": "redis://x", "secret": "short"}, "secret"),
        ({"url": "redis://x"}, "secret"),
        ({"tier": "host", "host_bytes": -1}, "host_bytes"),
        ({"tier": "host", "ttl_s": "soon"}, "ttl_s"),
        ({"tier": "host", "namespace": "a:b"}, "namespace"),
        ({"tier": "host", "hash_algo": "md5"}, "hash_algo"),
        ({"tier": "host", "colour": "red"}, "colour"),
    ],
)
def test_config_errors_name_the_field(extra, field, monkeypatch):
    monkeypatch.delenv("HYBRIDCACHE_TIER_SECRET", raising=False)
    with pytest.raises(cc.ConnectorConfigError, match=field):
        cc.parse_config(extra, "kv_both")


def test_config_roles_and_defaults():
    cfg = cc.parse_config({}, "kv_consumer")
    assert cfg.tier == "host" and cfg.load and not cfg.save
    cfg = cc.parse_config({"url": "redis://h:1", "secret": "x" * 16}, "kv_producer")
    assert cfg.tier == "redis" and cfg.save and not cfg.load
    with pytest.raises(cc.ConnectorConfigError, match="kv_role"):
        cc.parse_config({}, None)


def test_host_tier_refused_with_worker_processes():
    cfg = cc.parse_config({}, "kv_both")
    with pytest.raises(cc.ConnectorConfigError, match="uni"):
        cc.open_tier(cfg, "mp")
    assert isinstance(cc.open_tier(cfg, "uni"), HostTier)


def test_loaded_by_vllm_factory_and_plugin(model_dir, host_extra):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from hybridcache.adapters.vllm import plugin
    from hybridcache.adapters.vllm.connector import HybridCacheConnector

    cls = KVConnectorFactory.get_connector_class(ch.transfer_config(host_extra))
    assert cls is HybridCacheConnector
    assert KVConnectorFactory.supports_hma_config(ch.transfer_config(host_extra))
    plugin.register()
    plugin.register()  # idempotent, never raises
    assert KVConnectorFactory.get_connector_class_by_name("HybridCacheConnector") is cls
    sched, _ = ch.make(model_dir, host_extra)
    assert sched.recompute_kv_load_failures  # a failed load is a miss, not a failed request


def test_hybridcache_scheduler_takes_the_connector(model_dir, host_extra):
    """Combined with HybridCacheScheduler (tested in test_vllm_sched_connector.py)."""
    from hybridcache.adapters.vllm import HybridCacheScheduler
    from hybridcache.adapters.vllm.manager_external import ConnectorKVCacheManager

    sched = h.make_scheduler(model_dir, HybridCacheScheduler, 200,
                             kv_transfer_config=ch.transfer_config(host_extra))
    assert isinstance(sched.kv_cache_manager, ConnectorKVCacheManager)
    assert sched.connector._kv_cache_manager is sched.kv_cache_manager
