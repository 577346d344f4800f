"""Eviction policies are registered by name: adding one is a file and a registration."""

from __future__ import annotations

import pytest

from hybridcache.errors import UnknownNameError
from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.policies import PolicyParts, policy_names, register_policy
from hybridcache.policies.lru import LRUQueue
from hybridcache.policies.value import RunValueQueue, ValueQueue, greedy_dual_priority
from tests.core.conftest import tiny_spec

U = 4


class _DeepestFirst(LRUQueue):
    """A test policy's queue: the deepest unit first (its priority is minus the depth)."""

    def add(self, item, tick, flops, nbytes, hits):
        super().add(item, -item.depth, flops, nbytes, hits)
        self._od = type(self._od)(sorted(self._od.items(), key=lambda kv: kv[1]))


@register_policy("test-deepest-first")
def _build(settings) -> PolicyParts:
    return PolicyParts(_DeepestFirst(), LRUQueue())


def test_a_registered_policy_is_selectable_by_name():
    assert "test-deepest-first" in policy_names()
    spec = tiny_spec(state=False)
    cfg = CacheConfig(hash_unit=U, eviction="test-deepest-first", admission="none")
    m = HybridCacheManager(spec, 1 << 20, cfg)
    for rid, base in (("a", 0), ("b", 1000)):
        m.add_request(rid, list(range(base, base + 40)))
        m.allocate(rid, 40)
        m.commit(rid, 40)
        m.free(rid)
    assert m.clear() == 20
    m.check_invariants()
    assert not m.index.nodes
    with pytest.raises(ValueError, match="registered already"):
        register_policy("lru")(_build)
    with pytest.raises(UnknownNameError, match="test-deepest-first"):
        HybridCacheManager(spec, 1 << 20, CacheConfig(eviction="nope"))


@pytest.mark.parametrize("eviction,depth", [("test-deepest-first", 9), ("lru", 4)])
def test_the_policy_alone_chooses_the_victim(eviction, depth):
    """A short prompt released first, a long one later: LRU takes the short one's tail,
    the test policy the long one's (so the registered policy, not a built-in, ranked)."""
    spec = tiny_spec(state=False)
    m = HybridCacheManager(spec, 1 << 20, CacheConfig(hash_unit=U, eviction=eviction, admission="none"))
    for rid, n in (("short", 20), ("long", 40)):
        m.add_request(rid, list(range(1000 * len(rid), 1000 * len(rid) + n)))
        m.allocate(rid, n)
        m.commit(rid, n)
        m.free(rid)
    assert m.index.kv_q.peek()[1].depth == depth


def test_both_value_queues_rank_by_the_one_greedy_dual_function():
    spec = tiny_spec()
    m = HybridCacheManager(spec, 1 << 20, CacheConfig(hash_unit=U, admission="last-token"))
    assert isinstance(m.index.kv_q, RunValueQueue) and isinstance(m.index.snap_q, ValueQueue)
    m.add_request("a", list(range(41)))
    m.allocate("a", 41)
    m.commit("a", 41)
    m.free("a")
    idx = m.index
    kv_prio, kv_node = idx.kv_q.peek()
    assert kv_prio == greedy_dual_priority(0.0, 0, kv_node.kv_flops, idx.kv_q._per)
    snap_prio, snap_node = idx.snap_q.peek()
    scale = idx.snap_q._scale
    assert snap_prio == greedy_dual_priority(0.0, 0, snap_node.snap_flops, 1.0 / idx.snap_bytes / scale)
