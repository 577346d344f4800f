"""A live cache that changes eviction policy ranks its entries as a manager that had run the
new policy all along (hybridcache.policy_switch): same victims, in the same order."""

from __future__ import annotations

import itertools
import random

import pytest

from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.policy_switch import switch_eviction
from tests.core.conftest import tiny_spec

U = 4
CAPACITY = 4 << 20  # nothing is evicted by the workload below


def _workload(mgr: HybridCacheManager, seed: int) -> None:
    """Sessions that extend themselves (outputs included: turn-end snapshots, demoted
    prompt-end ones, KV past the last snapshot) and share a prefix, and repeats (hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(1 << 20) for _ in range(6 * U)]
    sessions = [shared + [rng.randrange(1 << 20) for _ in range(rng.randrange(1, 5) * U + 1)]
                for _ in range(4)]
    ids = itertools.count()
    for _ in range(24):
        s = rng.randrange(len(sessions))
        prompt = sessions[s]
        out = [rng.randrange(1 << 20) for _ in range(rng.choice((0, 0, 3, 9)))]
        rid = str(next(ids))
        m = mgr.add_request(rid, prompt)
        mgr.allocate(rid, len(prompt) + len(out) - m.hit_tokens)
        if out:
            mgr.append_tokens(rid, out)
        mgr.commit(rid, len(prompt) + len(out))
        mgr.free(rid)
        if rng.random() < 0.6:  # the next turn extends this one
            sessions[s] = prompt + out + [rng.randrange(1 << 20) for _ in range(rng.randrange(1, 4) * U)]


def _victims(mgr: HybridCacheManager) -> list[tuple[str, bytes]]:
    """Every entry, in the order the policy evicts them (kind, digest)."""
    ev, out = mgr.index.evictor, []
    drop = ev._drop

    def record(kind, node, keep_slot):
        out.append((kind, node.digest))
        return drop(kind, node, keep_slot)

    ev._drop = record
    mgr.clear()
    return out


def _value_ranks(mgr: HybridCacheManager) -> dict[bytes, tuple[str, float]]:
    """Value eviction's priority of every evictable entry. (Its order within a tie is the
    order entries were first queued, which no other policy records: a switch into value
    eviction is compared by priorities, and by victims only for tick-ranked policies.)"""
    index, out = mgr.index, {}
    for run in index.heads.values():
        for pos in range(run.held, len(run.digests)):
            out[run.digests[pos]] = ("kv", round(index.kv_q.unit_priority(run, pos), 12))
    for node, (prio, _) in index.snap_q._live.items():
        out[node.digest + b"s"] = ("state", round(prio, 12))
    return out


def _manager(eviction: str, admission: str) -> HybridCacheManager:
    cfg = CacheConfig(hash_unit=U, admission=admission, eviction=eviction, marconi_window=1 << 10)
    return HybridCacheManager(tiny_spec(), CAPACITY, cfg)


PAIRS = [("value", "marconi"), ("marconi", "value"), ("value", "lru"), ("lru", "marconi"), ("marconi", "lru")]
ADMISSIONS = ["last-token+branch-point", "last-token+turn-end+branch-point+interval:8"]


@pytest.mark.parametrize("old,new", PAIRS)
@pytest.mark.parametrize("admission", ADMISSIONS)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_switch_ranks_entries_as_a_fresh_manager_with_the_new_policy(old, new, admission, seed):
    fresh = _manager(new, admission)
    _workload(fresh, seed)
    live = _manager(old, admission)
    _workload(live, seed)
    assert live.index.evictions == {"kv": 0, "state": 0}
    assert any(n.snap_demoted for n in live.index.handles.values()) == ("turn-end" in admission)
    switch_eviction(live, new)
    assert live.config.eviction == new and type(live.index.kv_q) is type(fresh.index.kv_q)
    live.check_invariants()
    if new == "value":
        want = _value_ranks(fresh)
        assert len(want) > 40
        assert _value_ranks(live) == want
    else:
        want = _victims(fresh)
        assert len(want) > 40
        assert _victims(live) == want


def test_a_switch_keeps_the_cache_and_its_hits():
    live = _manager("value", ADMISSIONS[1])
    _workload(live, 4)
    before = {d: (n.snap, n.pages) for d, n in live.index.handles.items()}
    units = live.index.kv_units
    switch_eviction(live, "marconi")
    live.check_invariants()
    assert live.index.kv_units == units
    handles = live.index.handles  # (per-unit queues make handles for every queued unit)
    assert {d: (handles[d].snap, handles[d].pages) for d in before} == before
    _workload(live, 5)  # keeps serving (and evicting, ranking new entries) under the new policy
    live.check_invariants()
    switch_eviction(live, "value")
    evictable = [r for r in live.index.heads.values() if r.held < len(r.digests)]
    assert len(live.index.kv_q) == len(evictable) > 0  # every run queued (none left stale)
    _workload(live, 6)
    live.check_invariants()
    live.clear()  # every entry stayed in the queues through both switches
    assert live.arena.pages_in_use == 0 and live.arena.slots_in_use == 0


@pytest.mark.parametrize(("ranking", "policy"), [("marconi", "marconi"), ("lru", "lru"), ("gdsf", "value")])
def test_set_weighting_switches_to_a_policy_and_back_to_a_value_weighting(ranking, policy):
    """The adaptive policy's hook (hybridcache.adoption.set_weighting): a ranking that is an
    eviction policy (``marconi``, ``lru``) switches the live cache's policy, a value
    weighting switches it back, re-ranked with that weighting's knobs set, as a cache that
    ran ``recency`` (ranked by the tick of the last release) all along ranks them. From
    ``gdsf`` too: a knob flip alone would leave the entries at GreedyDual priorities, on
    another scale than the ticks new entries get."""
    from hybridcache.adaptive import set_weighting

    live = _manager("value", ADMISSIONS[1])
    _workload(live, 7)
    set_weighting(live, ranking)
    assert live.index.eviction == live.config.eviction == policy
    set_weighting(live, "recency")
    assert live.index.eviction == live.config.eviction == "value"
    assert live.index.kv_q.uniform and live.index.snap_q.uniform and not live.index.kv_q.freq
    fresh = _manager("value", ADMISSIONS[1])
    set_weighting(fresh, "recency")
    _workload(fresh, 7)
    assert _value_ranks(live) == _value_ranks(fresh)
