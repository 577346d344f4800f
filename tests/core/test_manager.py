"""Behaviour of HybridCacheManager on hand-made request streams (hit counts by hand)."""

from __future__ import annotations

import pytest

from hybridcache.errors import (
    CapacityError,
    InvalidRequestError,
    OutOfSpaceError,
    UnknownNameError,
)
from hybridcache.events import EventLog
from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.presets import get_preset
from tests.core.conftest import tiny_spec

U = 4


def serve(m, rid, tokens, output=(), tenant=None, finished=True):
    """One whole request: prefill, decode ``output`` in one step, commit, free."""
    res = m.add_request(rid, tokens, tenant=tenant)
    n = len(tokens) - res.hit_tokens + len(output)
    a = m.allocate(rid, n)
    if output:
        m.append_tokens(rid, list(output))
    m.commit(rid, len(tokens) + len(output))
    m.free(rid, finished=finished)
    return res, a


def mgr(**kw):
    cap = kw.pop("capacity", 1 << 22)
    return HybridCacheManager(kw.pop("spec", tiny_spec()), cap, CacheConfig(hash_unit=U, **kw))


def test_copy_on_extend_never_targets_the_cached_snapshot():
    m = mgr(admission="last-token")
    serve(m, "a", list(range(22)))  # snapshot at (22-1)//4*4 = 20
    res = m.add_request("b", list(range(22)) + [99] * 10)
    assert res.hit_tokens == 20 and res.kv_hit_tokens == 20
    a = m.allocate("b", 12)
    cached = m.cached_snapshot_slots()
    assert len(a.state_copies) == 1
    (src,), (dst,) = a.state_copies.src, a.state_copies.dst
    assert src in cached and dst not in cached and dst == a.running_slot
    assert not a.init_state and a.start == 20
    assert a.block_table["attn"][:5] == m.requests["b"].pages[0][:5]


def test_identical_prompt_never_hits_its_last_token():
    m = mgr(admission="last-token")
    serve(m, "a", list(range(16)))
    res, _ = serve(m, "b", list(range(16)))
    assert res.hit_tokens == 12  # 16 tokens: the last is recomputed, so at most 3 units


def test_kv_hit_without_snapshot_is_counted_and_not_used():
    m = mgr(admission="none")
    serve(m, "a", list(range(40)))
    res, a = serve(m, "b", list(range(40)))
    assert (res.hit_tokens, res.kv_hit_tokens) == (0, 36)
    assert m.metrics.kv_hit_state_miss_tokens == 36 and a.init_state


def test_attention_only_model_uses_every_kv_hit():
    m = mgr(spec=tiny_spec(state=False), admission="none")
    serve(m, "a", list(range(40)))
    res, a = serve(m, "b", list(range(40)))
    assert res.hit_tokens == 36 and a.running_slot == -1


def test_state_only_model_hits_at_snapshots():
    m = mgr(spec=tiny_spec(attention=False), admission="interval:8")
    serve(m, "a", list(range(30)))
    res, _ = serve(m, "b", list(range(30)) + [7])
    assert res.hit_tokens == 24


def test_branch_point_and_turn_end():
    m = mgr(admission="branch-point+turn-end")
    doc = list(range(100, 140))
    serve(m, "a", doc + [1] * 9, output=[5] * 6)  # turn end: (49+6)//4*4 = 52
    res, _ = serve(m, "b", doc + [1] * 9 + [5] * 6 + [3] * 3)
    assert res.hit_tokens == 52
    # b diverges from a at 40 (doc): a branch point is saved there
    res, _ = serve(m, "c", doc + [2] * 8)
    assert res.hit_tokens == 0 and res.kv_hit_tokens == 40  # first visit saves it
    res, _ = serve(m, "d", doc + [4] * 8)
    assert res.hit_tokens == 40


def test_turn_end_is_dropped_when_request_is_aborted():
    m = mgr(admission="turn-end")
    serve(m, "a", list(range(10)), output=[1] * 10, finished=False)
    res = m.add_request("b", list(range(10)) + [1] * 10 + [2])
    assert res.hit_tokens == 0


def test_speculative_rejected_snapshots_are_never_registered():
    m = mgr(admission="interval:4")
    m.add_request("a", list(range(8)))
    m.allocate("a", 8)
    m.commit("a", 8)
    a = m.allocate("a", 4, num_draft=3)  # inputs 8..11; boundary 12 is saved by the step
    assert [s.boundary for s in a.save_points] == [12] and len(a.draft_slots) == 3
    running = a.running_slot
    m.accept("a", 2)  # tokens 8, 9 accepted; the state after input 10 is in draft slot 1
    assert m.requests["a"].slot == a.draft_slots[1] and running not in m.cached_snapshot_slots()
    m.append_tokens("a", [50, 51])
    m.commit("a", 10)
    assert m.metrics.snapshots_rejected == 1
    before = m.arena.slots_in_use
    assert before == 3  # running + snapshots at 4 and 8
    m.free("a")
    res = m.add_request("b", list(range(8)) + [50, 51, 52, 53, 54])
    assert res.hit_tokens == 8  # not 12: the rejected boundary never became a snapshot


def test_eviction_trades_snapshots_for_pages():
    spec = tiny_spec()
    probe = mgr(spec=spec)
    cap = 4 * probe.layout.block_bytes  # 4 blocks; a block is 9 pages or 1 snapshot
    m = mgr(spec=spec, capacity=cap, admission="interval:4", eviction="lru")
    serve(m, "a", list(range(9)))  # running slot + snapshots at 4, 8 -> 3 state blocks... 1 KV slab
    assert m.arena.stats().state_blocks == 2 and m.arena.stats().kv_blocks == 1
    serve(m, "b", list(range(200, 200 + 4 * 9 * 2)))  # 18 pages + running slot: needs room
    assert m.index.evictions["state"] >= 1
    s = m.arena.stats()
    assert s.used_bytes <= s.capacity_bytes


def test_slot_need_takes_kv_victims_only_from_unpinned_slabs():
    spec = tiny_spec()
    probe = mgr(spec=spec)
    m = mgr(spec=spec, capacity=3 * probe.layout.block_bytes, admission="none", eviction="lru")
    serve(m, "a", list(range(4 * 9 * 2)))  # 18 pages = 2 full slabs + the running slot
    assert m.arena.stats().kv_blocks == 2 and m.arena.free_block_count == 1
    m.add_request("b", [7] * 3)
    a = m.allocate("b", 3, num_draft=1)  # running slot (free block) + draft slot: a slab must go
    assert len(a.draft_slots) == 1
    # one page for b's KV, then the 9 pages of the one slab no request pins for the draft
    # slot; the 8 cached pages left in the slab that b's new page pins are kept, although
    # LRU ranks them first (they were the deepest units of a)
    assert m.index.evictions["kv"] == 10
    assert m.arena.stats().state_blocks == 2 and m.arena.stats().kv_blocks == 1


def test_slot_need_spares_hot_slab_mates_of_the_victim():
    """The victim's slab mates can be the hottest entries: a slot need evicts entries in
    rank order, never the victim's whole slab (which here holds y's head)."""
    spec = tiny_spec()
    probe = mgr(spec=spec)
    assert probe.layout.pages_per_block == 9
    m = mgr(spec=spec, capacity=4 * probe.layout.block_bytes, admission="last-token", eviction="lru")
    x = list(range(1000, 1020))  # 5 units: pages 0-4 of slab 0
    y = list(range(2000, 2033))  # 8 full units: pages 5-8 (slab 0) and 9-12 (slab 1)
    serve(m, "x", x)
    serve(m, "y", y)
    assert serve(m, "y2", y)[0].hit_tokens == 32  # y is hot, x is the oldest entry
    m.add_request("z", list(range(3000, 3004)))
    m.allocate("z", 4, num_draft=1)  # running slot + draft slot: one block must be freed
    m.free("z", finished=False)
    assert m.index.evictions["kv"] == 5  # x's units only (a whole slab would be 9)
    assert m.add_request("y3", y).kv_hit_tokens == 32  # y's head, in x's slab, survived


def test_out_of_space_changes_nothing():
    spec = tiny_spec()
    probe = mgr(spec=spec)
    m = mgr(spec=spec, capacity=2 * probe.layout.block_bytes, admission="none")
    m.add_request("a", list(range(30)))
    m.allocate("a", 30)  # 8 pages (1 slab) + running slot (1 block)
    m.add_request("b", list(range(500, 530)))
    with pytest.raises(OutOfSpaceError):
        m.allocate("b", 30)
    req = m.requests["b"]
    assert not req.allocated and m.arena.pages_in_use == 8 and m.arena.slots_in_use == 1


def test_tenant_quota_limits_cached_bytes():
    m = mgr(admission="none", tenant_quotas={"small": 3 * 1024})
    serve(m, "a", list(range(40)), tenant="small")
    assert m.index.tenant_bytes["small"] <= 3 * 1024
    assert m.metrics.quota_rejections >= 1
    serve(m, "b", list(range(40)), tenant="big")
    assert m.index.tenant_bytes["big"] == 10 * m.index.node_kv_bytes


def test_tenants_do_not_share():
    m = mgr(admission="last-token")
    serve(m, "a", list(range(40)), tenant="x")
    res, _ = serve(m, "b", list(range(40)), tenant="y")
    assert res.hit_tokens == 0 and res.kv_hit_tokens == 0


@pytest.mark.parametrize(
    "call, msg",
    [
        (lambda m: m.add_request("x", [1, -1]), "negative"),
        (lambda m: m.add_request("x", [0.5]), "integers"),
        (lambda m: m.add_request("x", list(range(5000))), "max_model_len"),
        (lambda m: m.add_request("x", []), "empty"),
        (lambda m: m.free("nope"), "unknown request"),
        (lambda m: m.allocate("nope", 1), "unknown request"),
        (lambda m: m.commit("r", 100), "only 8 allocated"),
        (lambda m: m.allocate("r", 4090), "max_model_len"),
        (lambda m: m.allocate("r", 0), "must be > 0"),
        (lambda m: m.accept("r", 9), "num_accepted"),
    ],
)
def test_bad_input_is_rejected_before_any_change(call, msg):
    m = mgr()
    m.add_request("r", list(range(8)))
    m.allocate("r", 8)
    m.commit("r", 8)
    before = (m.arena.pages_in_use, m.arena.slots_in_use, set(m.requests), len(m.index.nodes))
    with pytest.raises(InvalidRequestError, match=msg):
        call(m)
    assert before == (m.arena.pages_in_use, m.arena.slots_in_use, set(m.requests), len(m.index.nodes))


def test_unknown_names_list_the_known_ones():
    with pytest.raises(UnknownNameError, match="kimi-linear-48b"):
        get_preset("llama-9000")
    with pytest.raises(UnknownNameError, match="lru, value, marconi"):
        mgr(eviction="fifo")
    with pytest.raises(UnknownNameError, match="last-token"):
        mgr(admission="sometimes")
    with pytest.raises(UnknownNameError, match="multiple of the hash unit"):
        mgr(admission="interval:6")


def test_snapshot_larger_than_budget_says_bytes():
    with pytest.raises(CapacityError, match=r"needs at least 43\d{6} B"):
        HybridCacheManager(get_preset("kimi-linear-48b"), 1 << 25)


def test_metrics_and_prometheus():
    m = mgr(admission="last-token")
    serve(m, "a", list(range(22)))
    serve(m, "b", list(range(22)))
    met = m.sync_metrics()
    assert (met.requests, met.prompt_tokens, met.hit_tokens, met.hit_requests) == (2, 44, 20, 1)
    assert 0 < met.prefill_flops_saved_frac < 1 and met.snapshot_copies == 1
    text = met.prometheus(labels={"model": "tiny"})
    assert 'hybridcache_hit_tokens_total{model="tiny"} 20' in text
    assert "# TYPE hybridcache_token_hit_rate gauge" in text


def test_turn_end_survives_a_rejected_speculative_boundary():
    m = mgr(admission="turn-end")
    m.add_request("a", [1, 2, 3, 4, 5, 6])
    m.allocate("a", 6)
    m.commit("a", 6)
    for tok in (7, 8):  # plain decode: boundary 8 goes to the turn-end slot
        m.allocate("a", 1)
        m.append_tokens("a", [tok])
        m.commit("a", m.requests["a"].num_tokens)
    a = m.allocate("a", 4, num_draft=3)  # inputs 8..11 would reach boundary 12
    assert [s.boundary for s in a.save_points] == [12]
    assert a.save_points[0].slot != m.requests["a"].rolling_slot
    m.accept("a", 1)  # only input 8 (token 9) is kept: 12 is rejected
    m.append_tokens("a", [9])
    m.commit("a", 9)
    m.free("a")
    res = m.add_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert res.hit_tokens == 8  # the state at 8 was not overwritten by the rejected 12


def test_rolling_back_state_without_draft_slots_is_refused():
    m = mgr()
    m.add_request("a", list(range(8)))
    m.allocate("a", 8)
    m.commit("a", 8)
    m.allocate("a", 3)
    with pytest.raises(InvalidRequestError, match="draft slots"):
        m.accept("a", 1)


def test_save_in_running_slot_relabels_instead_of_copying():
    m = mgr(admission="interval:8")
    m.add_request("a", list(range(20)))
    a = m.allocate("a", 8)
    (sp,) = a.save_points
    new_running = m.save_in_running_slot("a", 8)
    assert new_running == sp.slot and m.requests["a"].saves[8] == a.running_slot
    m.commit("a", 8)
    assert a.running_slot in m.cached_snapshot_slots()  # the slot the state was left in
    with pytest.raises(InvalidRequestError, match="not the end of the step"):
        m.save_in_running_slot("a", 4)


def test_cancel_save_registers_nothing_and_frees_the_slot():
    m = mgr(admission="interval:8")
    m.add_request("a", list(range(20)))
    a = m.allocate("a", 12)
    before = m.arena.slots_in_use
    m.cancel_save("a", a.save_points[0].boundary)
    assert m.arena.slots_in_use == before - 1
    m.commit("a", 12)
    assert not m.cached_snapshot_slots()
    with pytest.raises(InvalidRequestError, match="no save point"):
        m.cancel_save("a", 8)


def test_min_seen_skips_save_points_whose_tokens_are_not_known_yet():
    # interval:8 with 6 prompt tokens + 12 decode tokens allocated at once: boundaries 8 and
    # 16 lie past the known tokens; with min_seen=2 they count as never seen (no IndexError)
    m = mgr(admission="interval:8", min_seen=2)
    m.add_request("a", list(range(6)))
    a = m.allocate("a", 18)
    assert a.save_points == ()
    m.append_tokens("a", list(range(100, 112)))
    m.commit("a", 18)
    m.free("a")
    assert m.metrics.snapshots_saved == 0


@pytest.mark.parametrize("eviction", ["value", "lru"])
def test_prompt_end_snapshot_ranks_last_once_the_turn_end_is_cached(eviction):
    m = mgr(admission="last-token+turn-end", eviction=eviction)
    serve(m, "old", list(range(500, 522)))  # prompt-end snapshot only: nothing supersedes it
    prompt = list(range(22))
    serve(m, "a", prompt, output=list(range(100, 110)))  # snapshots at 20 (prompt) and 32
    assert sum(n.snap >= 0 for n in m.index.nodes.values()) == 3
    # still cached: a repeat of the prompt resumes from it while memory lasts...
    assert m.add_request("b", prompt + [7]).hit_tokens == 20
    # ...but it is the first entry to go, before even old's KV and snapshot
    node = m.index.nodes[m.requests["b"].hasher.digests[20 // U - 1]]
    m.free("b", finished=False)
    assert m.index.evict_one()
    assert m.index.evictions == {"kv": 0, "state": 1} and node.snap < 0


def test_prompt_end_keeps_its_rank_when_the_turn_end_is_refused():
    """The prompt end is ranked first only once the turn end is cached: where the tenant's
    quota refuses the turn end, the prompt end is the request's deepest state and keeps its
    rank (the next turn resumes from it)."""
    sizes = mgr().index
    quota = 8 * sizes.node_kv_bytes + sizes.snap_bytes  # the KV and the prompt end only
    m = mgr(admission="last-token+turn-end", eviction="value", tenant_quotas={"*": quota})
    serve(m, "a", list(range(22)), output=list(range(100, 110)))  # snapshots at 20 and 32
    cached = [n for n in m.index.nodes.values() if n.snap >= 0]
    assert [n.depth for n in cached] == [20 // U - 1] and m.metrics.quota_rejections == 1
    assert not cached[0].snap_demoted
    m.check_invariants()


def test_a_session_turn_end_is_valued_past_the_prompt_end_ranked_first_before_it():
    """A turn end is valued by the stretch past the prompt end (the output's tokens). Where
    the prompt end is ranked first to evict as the turn end is cached, the turn end of a
    session's turn (a request that extended the turn before) saves the whole turn, from
    where the session resumed: it is registered at that value (and its ``stored`` event
    carries it), and under pressure it outlives a state worth
    less than the turn (a one-off prompt's end), where valued at the output alone it went
    first. A request that extended nothing (a first turn, a document's question) keeps the
    output's value: nothing says a next turn will come."""
    m = mgr(admission="last-token+turn-end", eviction="value")
    flops, cap = m.spec.flops.prefill_flops, m._snap_flops_cap

    def state_at(tokens: int):
        return next(n for n in m.index.nodes.values() if n.snap >= 0 and n.depth == tokens // U - 1)

    serve(m, "old", list(range(500, 522)))  # its prompt end at 20: nothing supersedes it
    first = list(range(20))
    serve(m, "t1", first, output=[100, 101, 102, 103])  # prompt end at 16, turn end at 24
    assert state_at(24).snap_flops == flops(16, 24)
    m.index.events = log = EventLog()
    stored = log.subscribe()
    res, _ = serve(m, "t2", first + [100, 101, 102, 103] + list(range(200, 216)), output=[300, 301, 302, 303])
    assert res.hit_tokens == 24  # it resumed from t1's turn end: prompt end at 36, turn end at 44
    old, end = state_at(20), state_at(44)
    assert flops(36, 44) < old.snap_flops == min(flops(0, 20), cap) < min(flops(24, 44), cap)
    assert end.snap_flops == min(flops(24, 44), cap)
    # Valued so when it is stored: the event an offload tier ranks by carries the same value.
    states = {e.depth: e.flops for e in stored.take() if e.action == "stored" and e.kind == "state"}
    assert states == {36 // U - 1: min(flops(24, 36), cap), 44 // U - 1: end.snap_flops}, states
    while old.snap >= 0 and end.snap >= 0 and m.index.evict_one():
        pass
    gone = [name for name, n in (("old", old), ("end", end)) if n.snap < 0]
    assert gone == ["old"], gone
    m.check_invariants()


def test_prompt_end_snapshot_of_a_repeated_prompt_keeps_its_rank():
    m = mgr(admission="last-token+turn-end+branch-point", eviction="lru")
    prompt = list(range(22))
    serve(m, "a", prompt, output=list(range(100, 110)))
    serve(m, "b", prompt, output=list(range(200, 210)))  # a repeat: its prompt end is a branch
    order = [n.depth for n in m.index.snap_q._od]  # oldest first
    assert order == [32 // U - 1, 20 // U - 1, 32 // U - 1]  # a's turn end, the shared prompt end, b's


def test_a_save_point_the_room_holds_is_not_lost_to_the_steps_own_pages():
    """A slot needs an empty block (one slot per block here: a state outweighs a page). The
    rules' save points take their slots before the step's pages when the room holds both
    (``SavePointControl._rule_saves_first``). Taken after the pages, as they were, the turn
    end of ``b`` found every block either pinned or shared with ``b``'s own pages (which
    went into the free entries of ``a``'s KV slab) and was skipped, so ``c``, the next turn,
    resumed from the prompt end (12) instead of the turn end (16)."""
    m = mgr(admission="last-token+turn-end", capacity=4 * 9216)
    assert m.arena.layout.num_blocks == 4 and m.arena.layout.pages_per_block == 9
    serve(m, "a", list(range(1000, 1024)), output=(1, 2))  # KV slab 7/9 used, two snapshots
    b = list(range(2000, 2015))
    _, alloc = serve(m, "b", b, output=(3,))  # running slot + 4 pages + prompt end + turn end
    assert [s.boundary for s in alloc.save_points] == [12, 16]
    res, _ = serve(m, "c", b + [3] + list(range(3000, 3009)), output=(4, 5))
    assert res.hit_tokens == 16
    assert m.metrics.snapshots_skipped == 0
    m.check_invariants()


def test_a_step_the_room_cannot_hold_whole_saves_its_ends_before_its_checkpoints():
    """A prompt that nearly fills the cache leaves room for two of its 19 save points. The
    room goes to the prompt's end and the turn end (``points_by_priority``), not to the
    first two interval checkpoints in boundary order, as it did: then the next turn of the
    session resumed from 16 tokens instead of 148."""
    m = mgr(admission="last-token+turn-end+interval:8", capacity=8 * 9216)
    prompt = list(range(1000, 1143))
    _, alloc = serve(m, "a", prompt, output=(1, 2, 3, 4, 5))
    assert [s.boundary for s in alloc.save_points] == [140, 148]
    res, _ = serve(m, "b", prompt + [1, 2, 3, 4, 5] + list(range(7000, 7003)), output=(9,))
    assert res.hit_tokens == 148
    m.check_invariants()


def test_the_points_the_room_holds_with_the_pages_take_their_slots_before_them():
    """Three points wanted (the checkpoint at 8, the prompt's end at 16, the turn end at 20),
    room for two with the pages. The two first in priority take their slots before the
    pages; taken after them, only the turn end found a block (as in the test above) and the
    prompt's end was lost."""
    m = mgr(admission="last-token+turn-end+interval:8", capacity=4 * 9216)
    serve(m, "a", list(range(1000, 1020)), output=(1, 2))
    _, alloc = serve(m, "b", list(range(2000, 2019)), output=(3,))
    assert [s.boundary for s in alloc.save_points] == [16, 20]
    m.check_invariants()


def test_a_point_min_seen_will_not_save_takes_no_slot_from_one_it_will():
    """A 42,848-token document in a cache of 47,040 tokens (falcon-h1-7b at 2 GiB), between
    its questions another 23,000-token document. The third question wants its own end (new:
    seen once) and the document's branch point (seen twice), and the room holds one slot
    beside the pages. Ranked first, the question's end took that slot and was then refused
    by ``min_seen``; the branch point, after the pages, found no block, and no question
    ever resumed from the document (falcon-h1-7b docs~s1010 at 2 GiB: ``seen-twice-recency``
    0.034, now 0.090)."""
    m = HybridCacheManager(get_preset("falcon-h1-7b"), 2 << 30, CacheConfig(
        hash_unit=16, admission="last-token+branch-point", min_seen=2))
    doc, other = list(range(100_000, 142_848)), list(range(300_000, 323_000))
    hits, saved = [], []
    for i in range(6):
        res, alloc = serve(m, f"q{i}", doc + list(range(7 * i, 7 * i + 150)), output=tuple(range(9, 60)))
        hits.append(res.hit_tokens)
        saved.append([s.boundary for s in alloc.save_points])
        if i % 2:
            serve(m, f"o{i}", other + list(range(7 * i, 7 * i + 150)), output=tuple(range(9, 60)))
    assert saved[3] == [42_848] and hits[5] == 42_848
    assert m.metrics.snapshots_skipped == 0
    m.check_invariants()


def test_save_points_by_priority_put_the_ends_first_and_the_checkpoints_in_order():
    from hybridcache.admission import AdmissionPolicy, admission_points, points_by_priority

    class View:  # what admission reads of a request
        prompt_len, kv_hit_tokens, hit_tokens, suffix_start = 143, 40, 16, 0

    pol = AdmissionPolicy.parse("last-token+turn-end+branch-point+interval:32", U)
    wanted = admission_points(pol, View(), 16, 164, U)
    assert wanted == [(32, False), (40, False), (64, False), (96, False), (128, False), (140, False),
                      (160, False), (164, True)]
    assert points_by_priority(pol, View(), wanted, 16, 164, U) == [
        (164, True), (140, False), (40, False), (32, False), (64, False), (96, False), (128, False),
        (160, False)]
    # an interval point at the turn end's boundary is the turn end's rolling slot
    wanted = admission_points(pol, View(), 16, 161, U)
    assert (160, False) in wanted and (160, True) in wanted
    assert points_by_priority(pol, View(), wanted, 16, 161, U)[:2] == [(160, True), (140, False)]
    assert sum(b == 160 for b, _ in points_by_priority(pol, View(), wanted, 16, 161, U)) == 1


def test_last_block_saves_where_siblings_share_the_boundary():
    """``last-block:N`` saves the prompt-end state at the last multiple of N, which a
    sibling (another question on the same document) shares when the boundary lies in the
    document; ``last-token``'s point lies in the question, which no sibling shares."""
    doc = list(range(100, 118))  # 18 tokens: blocks of 8 end at 8 and 16
    first, second = doc + [1, 2, 3], doc + [7, 8, 9, 10]
    for admission, want in (("last-block:8", 16), ("last-token", 0)):
        m = mgr(admission=admission)
        serve(m, "a", first)  # last-block: (21 - 1) // 8 * 8 = 16; last-token: 20
        res, _ = serve(m, "b", second)
        assert res.hit_tokens == want, admission
    with pytest.raises(UnknownNameError, match="multiple of the hash unit"):
        mgr(admission="last-block:6")
    with pytest.raises(UnknownNameError, match="needs tokens"):
        mgr(admission="last-block")
