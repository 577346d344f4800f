"""Value (GreedyDual) eviction ranks a prefix's head above its tail, and a snapshot never above
the KV pages it needs: the two properties hybridcache's default policy relies on."""

from __future__ import annotations

import pytest

from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.port import EnginePort
from hybridcache.sim.policies import stateless
from tests.sim.conftest import toks


def run(mgr, rid, prompt) -> int:
    """Serve ``prompt`` as request ``rid`` to the end; returns its hit tokens."""
    m = mgr.add_request(rid, prompt)
    mgr.allocate(rid, len(prompt) - m.hit_tokens)
    mgr.commit(rid, len(prompt))
    mgr.free(rid)
    return m.hit_tokens


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
    (snap,) = [n for n in mgr.index.nodes.values() if n.snap >= 0]
    # The KV it needs: the units up to its own (the prompt's last unit lies past it).
    kv = [n for n in mgr.index.nodes.values() if n.pages is not None and n.depth <= snap.depth]
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


def _eviction_order(kimi, eviction: str) -> list[bool]:
    """Which KV evictions were stranded units, in order (see the test below)."""
    cfg = CacheConfig(eviction=eviction, admission="last-token")
    probe = HybridCacheManager(kimi, 1 << 30, cfg)
    mgr = HybridCacheManager(kimi, 4 * probe.layout.block_bytes, cfg)
    ppb = mgr.layout.pages_per_block
    stranded: set[bytes] = set()
    for rid, seed in (("a", 11), ("b", 12)):
        prompt = toks(1000, seed)
        m = mgr.add_request(rid, prompt)
        mgr.allocate(rid, 1200 - m.hit_tokens)
        mgr.append_tokens(rid, toks(200, seed + 100))
        mgr.commit(rid, 1200)
        digests = mgr.requests[rid].hasher.digests
        stranded.update(digests[(1000 - 1) // 16 : 1200 // 16])  # after the snapshot at 992
        mgr.free(rid)
    assert len(stranded) == 26
    port = EnginePort(mgr)  # evictions in order, from the event stream
    free_pages = 2 * ppb - 150  # the rest of a's and b's slab, and the free block
    c = toks((free_pages + 40) * 16, 13)
    m = mgr.add_request("c", c)
    mgr.allocate("c", len(c) - m.hit_tokens)
    return [ev.digests[0] in stranded for ev in port.take_events()
            if ev.action == "removed" and ev.kind == "kv"]


@pytest.mark.parametrize("eviction", ["value", "lru", "marconi"])
def test_kv_past_the_last_snapshot_goes_before_usable_kv(kimi, eviction):
    """KV and state valued as one, in every policy: KV on a path past its last snapshot
    serves no hit until a state exists there, so it is evicted before any KV that a
    snapshot makes usable.

    a and b each leave 13 units of output KV past their prompt-end snapshot (no turn-end
    rule). c needs 40 pages more than are free: the 26 stranded units must all go before
    the first usable one. Without the rule, value eviction drains a's run tail first,
    stranded and usable alike, while b's stranded tail stays; LRU drains a's (older) units,
    stranded and usable, before b's stranded ones (see the lru-plain case below)."""
    order = _eviction_order(kimi, eviction)
    assert order.count(True) == 26 and False in order
    first_usable = order.index(False)
    assert all(order[:first_usable]) and first_usable == 26, order


def test_plain_lru_keeps_stranded_kv_behind_usable_kv(kimi):
    """The mutation check of the test above: LRU without the rule (``lru-plain``, vLLM's
    free-block order) evicts a usable unit while stranded ones stay."""
    order = _eviction_order(kimi, "lru-plain")
    assert not all(order[:26]), order


@pytest.mark.parametrize("eviction", ["value", "lru", "marconi"])
def test_kv_that_branches_lead_through_is_not_stranded(kimi, eviction):
    """A run's tail past its last snapshot is stranded only while no run branches off it.

    a leaves units 62..74 past its prompt-end snapshot (end of unit 61); b and c branch off
    a's unit 67 (they diverge at token 1100) and end at snapshots of their own. a's units
    68..74 serve nothing (stranded); 62..67 lead to b's and c's snapshots. Evicting the
    stranded units (and b's one-unit stranded tail) must leave b's path whole. Fails when
    the stranded test ignores branches: the rule then strips a down to its snapshot and
    cuts b and c off."""
    import numpy as np

    mgr = HybridCacheManager(kimi, 4 << 30, CacheConfig(eviction=eviction, admission="last-token"))

    def serve(rid, prompt, out=0):
        m = mgr.add_request(rid, prompt)
        mgr.allocate(rid, len(prompt) + out - m.hit_tokens)
        if out:
            mgr.append_tokens(rid, toks(out, 99))
        mgr.commit(rid, len(prompt) + out)
        mgr.free(rid)
        return m.hit_tokens

    a = list(toks(1000, 1)) + list(toks(200, 99))
    serve("a", np.array(a[:1000], dtype=np.uint32), 200)
    b = np.array(a[:1100] + list(toks(500, 2)), dtype=np.uint32)
    assert serve("b", b) == 992
    assert serve("c", np.array(a[:1100] + list(toks(400, 3)), dtype=np.uint32)) == 992
    for _ in range(7 + 1):  # a's stranded 68..74 and b's stranded last unit
        assert mgr.index.evict_one()
    assert mgr.add_request("b2", b).hit_tokens == 1584
    mgr.free("b2")
    # What the policy is told about a's run now: its tail (unit 67) leads to b and c.
    (run_a,) = [r for r in mgr.index.heads.values() if r.first == 0]
    assert len(run_a.digests) == 68 and not mgr.index.kv_q.stranded(run_a)
    mgr.clear()  # the branch counts go with the runs
    assert not mgr.index.heads and not mgr.index.branches


@pytest.mark.parametrize(("weighting", "first_victim"), [("gdsf", "b"), ("recency", "a")])
def test_recency_weighting_ranks_by_last_release(kimi, weighting, first_victim):
    """The adaptive policy's ``recency`` weighting ranks by last release alone: a (served
    three times, so its KV has two hits) was released before b, so it goes first; under
    the default weighting its hits keep it and b goes first. (KV only: with states, the
    stranded-KV rule decides once a snapshot went. Between two evictions every release
    ties on the clock; ties go in release order, KV before states.)"""
    from hybridcache.adaptive import set_weighting

    mgr = HybridCacheManager(stateless(kimi), 1 << 30, CacheConfig(eviction="value", admission="none"))
    set_weighting(mgr, weighting)
    a, b = toks(4001, 21), toks(4001, 22)  # a's hits cover all its 250 units
    for rid in ("a1", "a2", "a3"):
        run(mgr, rid, a)
    run(mgr, "b", b)
    mgr.add_request("a", a)
    of_a = set(mgr.requests["a"].hasher.digests)
    mgr.free("a", finished=False)
    port = EnginePort(mgr)
    assert mgr.index.evict_one()
    (ev,) = [e for e in port.take_events() if e.action == "removed"]
    assert ("a" if ev.digests[0] in of_a else "b") == first_victim


def test_unknown_weighting_is_refused(kimi):
    from hybridcache.adaptive import set_weighting
    from hybridcache.errors import UnknownNameError

    mgr = HybridCacheManager(kimi, 8 << 30, CacheConfig(eviction="value"))
    with pytest.raises(UnknownNameError, match="recency"):
        set_weighting(mgr, "lfu")
    assert mgr.index.kv_q.freq and not mgr.index.kv_q.uniform


@pytest.mark.parametrize("eviction", ["value", "lru"])
def test_a_run_that_reconnects_a_split_off_piece_is_not_stranded(kimi, eviction):
    """Evicting a unit inside a run splits the rest off (unreachable until the unit is
    registered again). A request that registers it again continues into the piece, whose
    end has the snapshot: the unit is on that snapshot's path, not stranded. Fails when
    split-off pieces are not counted as branches: the reconnecting unit is then ranked
    first (as stranded) and the path breaks again at the next eviction."""
    mgr = HybridCacheManager(kimi, 4 << 30, CacheConfig(eviction=eviction, admission="last-token"))
    a = toks(2001, 31)  # snapshot at 2000, the end of unit 124
    run(mgr, "a1", a)
    (head,) = mgr.index.heads.values()
    mgr.index.evict_kv(mgr.index.handle(head, 60))  # units 61..124 split off
    assert mgr.add_request("a2", a).hit_tokens == 0
    mgr.free("a2", finished=False)
    run(mgr, "a3", a)  # registers unit 60 again: the path to the snapshot is whole
    assert mgr.add_request("a4", a).hit_tokens == 2000
    unit60 = mgr.requests["a4"].hasher.digests[60]
    mgr.free("a4", finished=False)
    (front,) = [r for r in mgr.index.heads.values() if r.first == 0]
    assert front.digests[-1] == unit60  # the run that reconnects ends at unit 60
    assert not mgr.index.kv_q.stranded(front)


def _hit_tokens(kimi, eviction: str, weighting: str | None, seed: int) -> int:
    """Hit tokens of 40 requests on prefixes of 4 documents (2k-12k tokens) at 1 GiB."""
    import random

    from hybridcache.adaptive import set_weighting

    mgr = HybridCacheManager(kimi, 1 << 30, CacheConfig(hash_unit=16, eviction=eviction,
                                                        admission="last-token+turn-end"))
    if weighting:
        set_weighting(mgr, weighting)
    rng = random.Random(seed)
    docs = [toks(rng.randrange(2000, 12000), 100 + i) for i in range(4)]
    hit = 0
    for i in range(40):
        doc = docs[rng.randrange(4)]
        hit += run(mgr, f"r{i}", doc[: rng.randrange(len(doc) // 2, len(doc) + 1)])
    return hit


@pytest.mark.parametrize("seed", range(6))
def test_recency_weighting_keeps_what_lru_keeps(kimi, seed, monkeypatch):
    """``recency`` ranks KV and states by the tick of their last release: under pressure it
    keeps what SGLang's ``lru`` keeps (the same hit tokens on three of these six workloads,
    within 2 % on the others, where the two policies' range eviction parts). Ranked at
    ``clock + 1`` (every release since the last eviction tied, ties broken by queue) it
    kept 8-19 % less on all six, and this fails on each. The ranking is compared alone: the
    rule of hybridcache.superseded, which value eviction adds on top of any weighting, is
    off here (with it, seeds 2 and 3 part by 5 % and 11 %)."""
    import hybridcache.manager as manager_module

    monkeypatch.setattr(manager_module, "supersede", lambda index, restore: None)
    lru, recency = _hit_tokens(kimi, "lru", None, seed), _hit_tokens(kimi, "value", "recency", seed)
    assert abs(recency - lru) <= 0.03 * lru, (recency, lru)


@pytest.mark.parametrize("seed", [5, 6, 8, 9])
def test_recency_takes_stranded_kv_as_lru_does(kimi, seed):
    """With vLLM align's admission (a state at the prompt end or a branch point, only for a
    boundary seen twice) few states fit a 1 GiB cache and most KV is stranded: it has no
    state yet, but finds the branch point that gets one. ``lru`` takes the tail found
    stranded last first, its whole run before any other; ``recency`` must do the same (the
    same hit tokens on these four document workloads). Taking one unit of each stranded
    run in turn, as the other weightings do, shortened every document's prefix and kept
    about half as much (0.20 against 0.45 on seed 5), and this fails on each."""
    from hybridcache.adoption import set_weighting
    from hybridcache.sim.generate import generate
    from hybridcache.sim.replay import Replay
    from hybridcache.sim.traces import Trace

    trace = Trace(f"<docs:{seed}>", "tokens", generate("docs", 120, seed=seed, tenants=2))
    hits = []
    for eviction in ("lru", "value"):
        cfg = CacheConfig(hash_unit=16, admission="last-token+branch-point", eviction=eviction, min_seen=2)
        replay = Replay(trace, kimi, 1 << 30, cfg, None)
        if eviction == "value":
            set_weighting(replay.mgr, "recency")
        replay.advance(None)
        hits.append(replay.hit_tokens)
    assert hits[0] > 0 and hits[1] == hits[0], hits
