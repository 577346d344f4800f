"""The ``spare-suffix-start`` admission rule: the suffix-start point taken as a spare one.

It is saved only into free room or into the slot of a demoted snapshot (a spare, or a
prompt-end state ranked first to evict), never by evicting what the other rules made.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridcache.invariants import check_manager
from hybridcache.manager import CacheConfig, HybridCacheManager
from tests.core.conftest import tiny_spec
from tests.core.test_suffix_starts import U, doc, question, serve

#: tiny_spec's arena block (9 pages of 4 tokens; one state slot).
BLOCK = HybridCacheManager(tiny_spec(), 1 << 22, CacheConfig(hash_unit=U)).layout.block_bytes


def mgr(admission: str, blocks: int = 455) -> HybridCacheManager:
    return HybridCacheManager(tiny_spec(), blocks * BLOCK, CacheConfig(hash_unit=U, admission=admission))


#: Prompt-end states and branch points, with spare checkpoints every 16 tokens: the
#: documents are 40 tokens, so the spare below a document's end is at 32.
SPARES = "last-token+branch-point+spare-interval:16"


def teach(m: HybridCacheManager) -> None:
    """Documents asked twice (49-token prompts: a 40-token document, a 9-token question):
    each second question leaves its document's end, a suffix of 9 tokens, so the estimate
    places the next document's suffix start at (49 - 1 - 9) // 4 * 4 = 36."""
    for i in range(4):
        serve(m, f"{i}a", doc(i) + question(i, 0, 9))
        serve(m, f"{i}b", doc(i) + question(i, 1, 9))


def second_question_hit(m: HybridCacheManager) -> int:
    """The hit of the fifth document's second question, after its first."""
    teach(m)
    serve(m, "4a", doc(4) + question(4, 0, 9))
    res = serve(m, "4b", doc(4) + question(4, 1, 9))
    assert res.kv_hit_tokens == 40
    check_manager(m)
    return res.hit_tokens


def test_a_spare_suffix_start_serves_the_next_sibling_from_free_room():
    """With room to spare the rule saves the point the suffix-start rule would, as a spare
    (demoted: first to evict): the second question resumes at 36, not at the interval
    spare below the branch (32)."""
    assert second_question_hit(mgr(SPARES, blocks=100)) == 32
    m = mgr(SPARES + "+spare-suffix-start", blocks=100)
    teach(m)
    serve(m, "4a", doc(4) + question(4, 0, 9))
    node = next(h for h in m.index.handles.values() if h.depth == 36 // U - 1 and h.snap >= 0)
    assert node.snap_demoted
    assert serve(m, "4b", doc(4) + question(4, 1, 9)).hit_tokens == 36


def test_in_a_full_cache_it_takes_the_slot_of_a_demoted_snapshot():
    """30 blocks: no free room is left when the fifth document comes. Without the rule its
    second question finds no state below the branch (0); with it, the suffix-start spare
    takes the slot of the demoted snapshot the next eviction would have freed (one more
    state eviction, nothing else) and the question resumes at 36."""
    plain = mgr(SPARES, blocks=30)
    assert second_question_hit(plain) == 0 and plain.arena.free_block_count <= 1
    m = mgr(SPARES + "+spare-suffix-start", blocks=30)
    assert second_question_hit(m) == 36
    assert m.index.evictions["kv"] == plain.index.evictions["kv"] == 0


def test_it_takes_a_slot_only_from_a_demoted_snapshot_that_ranks_lowest():
    """``slot_from_demoted``: where the lowest-ranked entry is a demoted snapshot (below
    every KV entry) it is evicted and its slot handed over; where the lowest is KV (ties go
    to KV, as the victim chooser's) or a snapshot that is not demoted, nothing changes."""
    m = mgr(SPARES, blocks=30)
    teach(m)
    top, kv = m.index.snap_q.peek(), m.index.kv_q.peek_priority()
    assert top is not None and top[1].snap_demoted and (kv is None or kv > top[0])
    before = m.index.evictions["state"]
    slot = m.index.slot_from_demoted()
    assert slot is not None and slot >= 0 and m.index.evictions["state"] == before + 1
    m.arena.free_slot(slot)
    check_manager(m)
    for rules, blocks in ((SPARES, 12), ("last-token", 12)):
        m = mgr(rules, blocks=blocks)
        teach(m)
        choice = m.index.evictor.chooser.choose(None, [])  # the victim it names, as state_victim
        assert m.index.evictor.chooser.state_victim() is (choice[1] if choice[0] == "state" else None)
        top, kv = m.index.snap_q.peek(), m.index.kv_q.peek_priority()
        assert top is not None and (not top[1].snap_demoted or (kv is not None and kv <= top[0]))
        version, ev = m.index.version, dict(m.index.evictions)
        assert m.index.slot_from_demoted() is None
        assert (m.index.version, m.index.evictions) == (version, ev)
        check_manager(m)


def test_documents_among_chat_sessions_get_the_spare_but_not_the_save_point():
    """Each document asked twice beside a chat session of three turns: one match in four
    leaves a sibling (the others extend a turn), too few for the suffix-start rule's
    estimate (half) but enough for the spare one's (four siblings in the window). The fifth
    document's second question resumes at 36 with the spare rule, at 0 with the save-point
    rule or neither."""
    hits = {}
    for rules in (SPARES, SPARES + "+suffix-start", SPARES + "+spare-suffix-start"):
        m = mgr(rules, blocks=100)
        for i in range(5):
            ctx = question(9, i, 12)
            for t in range(4):
                out = [800 + 10 * i + t] * 4
                serve(m, f"s{i}.{t}", ctx, output=out)
                ctx = ctx + out + question(i, t + 2, 4)
            serve(m, f"{i}a", doc(i) + question(i, 0, 9))
            res = serve(m, f"{i}b", doc(i) + question(i, 1, 9))
        if m.admission.tracks_suffixes:
            assert m.suffix_starts.estimate() is None and m.suffix_starts.estimate(spare=True) == 9
        hits[rules] = res.hit_tokens
        check_manager(m)
    assert hits == {SPARES: 32, SPARES + "+suffix-start": 32, SPARES + "+spare-suffix-start": 36}


def test_a_policy_with_its_own_chooser_gets_no_displacement():
    """Marconi's chooser ranks a window of candidates and consumes its ranking as it
    chooses, so it cannot name its next victim without taking it: with it the rule takes
    free room only, though its snapshot queue's lowest entry is a demoted one here."""
    m = HybridCacheManager(tiny_spec(), 30 * BLOCK,
                           CacheConfig(hash_unit=U, admission=SPARES, eviction="marconi"))
    teach(m)
    version, ev = m.index.version, dict(m.index.evictions)
    assert m.index.slot_from_demoted() is None
    assert (m.index.version, m.index.evictions) == (version, ev)


def test_a_batching_engine_gets_no_displacement():
    """With save withdrawal on (a batching engine: a later request of the step may take a
    spare back, and the engine may drop a save inside a step), a spare never displaces a
    snapshot for a save the step may not keep: the rule uses free room only."""
    m = mgr(SPARES + "+spare-suffix-start", blocks=30)
    m.allow_save_withdrawal()
    assert second_question_hit(m) == 0
    m.take_withdrawn_saves()


def test_the_rule_parses_and_keeps_the_estimate():
    m = mgr("last-token+spare-suffix-start")
    assert m.admission.spare_suffix_start and m.admission.tracks_suffixes and not m.admission.suffix_start
    assert not mgr("last-token").admission.tracks_suffixes


@settings(max_examples=60, derandomize=True, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.booleans()), min_size=1, max_size=40),
    st.sampled_from([12, 20, 30, 60]),
    st.booleans(),
    st.booleans(),
)
def test_random_streams_keep_every_invariant(stream, blocks, intervals, batching):
    """Documents asked several questions (some with outputs) through a small cache, with and
    without interval spares and save withdrawal: after every request the manager's and the
    estimate's invariants hold, and nothing is ever counted as a hit beyond its KV hit."""
    rules = "last-token+turn-end+branch-point" + ("+spare-interval:16" if intervals else "")
    m = mgr(rules + "+spare-suffix-start", blocks=blocks)
    if batching:
        m.allow_save_withdrawal()
    for n, (d, q, with_output) in enumerate(stream):
        res = serve(m, f"r{n}", doc(d) + question(d, q, 9), output=[7] * 4 if with_output else ())
        assert res.hit_tokens <= res.kv_hit_tokens
        m.take_withdrawn_saves()
        check_manager(m)
        m.suffix_starts.sanity_check()
