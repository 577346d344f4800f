"""Value (GreedyDual) eviction ranks a prefix's head above its tail, and a snapshot never above
the KV pages it needs: the two properties hybridcache's default policy relies on."""

from __future__ import annotations

from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.sim.policies import stateless
from tests.sim.conftest import toks


def run(mgr, rid, prompt):
    m = mgr.add_request(rid, prompt)
    mgr.allocate(rid, len(prompt) - m.hit_tokens)
    mgr.commit(rid, len(prompt))
    mgr.free(rid)


def test_value_eviction_drops_the_tail_of_a_prefix_first(kimi):
    spec = stateless(kimi)
    # A pure-attention arena is slabs of 64 pages; one slab is the whole cache here.
    page = 16 * spec.kv_bytes_per_token
    mgr = HybridCacheManager(spec, 64 * ((page + 255) // 256 * 256), CacheConfig(eviction="value"))
    assert mgr.layout.num_pages == 64
    a = toks(40 * 16, 1)
    run(mgr, "a", a)
    run(mgr, "b", toks(30 * 16, 2))  # needs 30 pages, 24 are free: 6 of a's go
    # Deepest first: a keeps its first 34 units, capped at (640 - 1) // 16 = 39.
    assert mgr.add_request("a2", a).hit_tokens == 34 * 16


def test_snapshot_never_outranks_the_kv_it_needs(kimi):
    mgr = HybridCacheManager(kimi, 8 << 30, CacheConfig(eviction="value", admission="last-token"))
    run(mgr, "a", toks(20000, 3))
    kv = [n for n in mgr.index.nodes.values() if n.pages is not None]
    kv_prios = [mgr.index.kv_q.priority(n) for n in kv]
    (snap_prio, _), = mgr.index.snap_q._live.values()
    # 20,000 tokens of marginal FLOPs would rank the 41 MiB snapshot above the pages; capped
    # at a page's value per byte it ranks at most level with them.
    assert snap_prio <= min(kv_prios) + 1e-9


def test_min_seen_from_the_config_is_applied(kimi):
    cfg = CacheConfig(admission="last-token", min_seen=2)
    mgr = HybridCacheManager(kimi, 8 << 30, cfg)
    assert mgr.admission.min_seen == 2
    p = toks(1000, 4)
    run(mgr, "1", p)
    assert mgr.add_request("2", p).hit_tokens == 0
    mgr.free("2")
    run(mgr, "3", p)  # the second sight saves the snapshot
    assert mgr.add_request("4", p).hit_tokens == 992
