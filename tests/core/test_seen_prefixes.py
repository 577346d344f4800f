"""The ``seen-branch`` rule: a branch point found in a record of the units whose KV the cache
evicted lately (:mod:`hybridcache.seen_prefixes`), where the cached KV no longer shows it."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridcache.admission import AdmissionPolicy
from hybridcache.seen_prefixes import SeenPrefixes
from tests.core.test_manager import mgr, serve


def chain(tokens: list[int]) -> list[bytes]:
    """Chained unit digests, one token per unit, as the manager's hasher chains them."""
    out, prev = [], b""
    for t in tokens:
        prev = hashlib.sha256(prev + t.to_bytes(2, "big")).digest()
        out.append(prev)
    return out


DOC, OTHER = list(range(1000, 1100)), list(range(5000, 5200))


def _doc_questions(admission: str, min_seen: int = 1, eviction: str = "value") -> list[tuple[int, list[int]]]:
    """A 100-token document asked three times, its KV evicted by another document between
    the first two questions (a cache of 288 tokens): (hit, save points) per question."""
    m = mgr(admission=admission, capacity=8 * 9216, min_seen=min_seen, eviction=eviction)
    out = []
    for rid, toks in (("q1", DOC + list(range(1, 11))), ("o1", OTHER + [4]),
                      ("q2", DOC + list(range(21, 31))), ("q3", DOC + list(range(41, 51)))):
        res, alloc = serve(m, rid, toks, output=(77,))
        if rid.startswith("q"):
            out.append((res.hit_tokens, [s.boundary for s in alloc.save_points]))
    m.check_invariants()
    return out


@pytest.mark.parametrize(("eviction", "branch_point"), [
    ("value", [(0, [108]), (0, [108]), (0, [100, 108])]),
    ("lru", [(0, [108]), (0, [12, 108]), (12, [100, 108])]),  # LRU kept 12 tokens of it
])
def test_a_branch_whose_kv_is_gone_is_saved_from_the_record(eviction, branch_point):
    """The second question finds no KV of the document (the other one evicted it), so
    ``branch-point`` saves only its own end and the third question misses; ``seen-branch``
    finds the document's end in the record, saves it, and the third question resumes
    there. Value eviction takes the document's KV as tail ranges, LRU unit by unit: the
    index records both."""
    assert _doc_questions("last-token+branch-point", eviction=eviction) == branch_point
    assert _doc_questions("last-token+seen-branch", eviction=eviction) == [(0, [108]), (0, [100, 108]), (100, [108])]


def test_the_record_s_branch_counts_as_seen_twice():
    """With ``min_seen=2`` the point found in the record saves at once (an earlier prompt
    went past it); the questions' own ends, new each time, never do."""
    assert _doc_questions("last-token+seen-branch", min_seen=2) == [(0, []), (0, [100]), (100, [])]


def test_a_session_s_next_turn_saves_nothing_at_the_previous_turn_s_end():
    """A session's next turn whose KV went extends the previous turn: the record holds that
    turn's units, but its last one is an end, not a branch, and no state is saved there
    (108); the turn's own end (112) and the KV match's end (12, where eviction cut the
    previous turn's KV) are saved as ``branch-point`` saves them."""
    for admission in ("last-token+turn-end+branch-point", "last-token+turn-end+seen-branch"):
        m = mgr(admission=admission, capacity=8 * 9216)
        first = list(range(1000, 1100))
        serve(m, "t1", first, output=tuple(range(1, 9)))
        serve(m, "o", OTHER, output=(9,))
        _, alloc = serve(m, "t2", first + list(range(1, 9)) + list(range(20, 25)), output=(9,))
        assert [s.boundary for s in alloc.save_points] == [12, 112], admission
        m.check_invariants()


def test_seen_branch_parses_and_is_listed():
    pol = AdmissionPolicy.parse("last-token+seen-branch", 4)
    assert pol.seen_branch and not pol.branch_point
    from hybridcache.admission import ADMISSION_RULES
    assert "seen-branch" in ADMISSION_RULES


class Ended:  # what ended_turn reads of a request leaving the cache
    def __init__(self, digests: list[bytes], prompt_len: int, computed: int) -> None:
        self.hasher = type("H", (), {"digests": digests})()
        self.prompt_len, self.num_computed = prompt_len, computed


def test_the_record_finds_the_deepest_unit_the_cache_let_go():
    rec = SeenPrefixes(100)
    a = chain([1, 2, 3, 4, 5, 6])
    rec.evicted(reversed(a))  # KV goes tail first
    b = chain([1, 2, 3, 4, 9, 9, 9])
    assert rec.branch(b, 0, 7) == 4  # units 0-3 held, unit 4 differs
    assert rec.branch(b, 4, 7) == 0  # nothing deeper than the KV match
    assert rec.branch(a + chain([7]), 0, 7) == 6  # a went on past unit 5: a branch there
    rec.ended_turn(Ended(a, 6, 6), 1)  # ... unless a prompt or a turn ended there: an extension
    assert rec.branch(a + chain([7]), 0, 7) == 0
    assert rec.branch(chain([8, 2, 3]), 0, 3) == 0  # never held
    rec.sanity_check()


def test_the_record_forgets_by_whole_generations():
    """A generation holds the cache's units, started at a request's end once it is full;
    the one before it is dropped whole then, so an evicted unit is remembered for at least
    one cache's worth of evictions."""
    rec = SeenPrefixes(5)
    a = chain([1, 2, 3, 4])
    rec.evicted(a)
    rec.evicted_one(chain([50])[0])  # 5 units: full, but a generation starts only at an end
    probe = a[:3] + chain([9])
    other = chain([60, 61])
    rec.ended_turn(Ended(other, 2, 2), 1)  # a new generation starts; other's end goes in it
    assert rec.branch(probe, 0, 4) == 3  # a is in the older generation
    assert rec.branch(other + chain([7]), 0, 3) == 0  # an end
    rec.evicted(chain([70 + i for i in range(5)]))
    rec.ended_turn(Ended(other, 2, 2), 1)  # another: a's generation is dropped
    assert rec.branch(probe, 0, 4) == 0
    rec.sanity_check()
    with pytest.raises(ValueError, match="cache_units"):
        SeenPrefixes(0)


def test_the_ends_are_bounded_where_nothing_is_evicted():
    """Ends of units the cache never registered (a tenant over its quota) are neither cached
    nor evicted: a record that never fills would keep every one. The ends alone start again
    at twice the cache's units, and the latest stay ends (a point there is no branch)."""
    rec = SeenPrefixes(4)
    for i in range(100):
        rec.ended_turn(Ended(chain([i, 1000]), 2, 2), 1)
        rec.sanity_check()
    assert len(rec._ends) < 8 and len(rec._old_ends) == 8
    last = chain([99, 1000])
    rec.evicted(reversed(last))
    assert rec.branch(last + chain([5]), 0, 3) == 0  # the end of the last prompt: no branch


prompts = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=30)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(prompts, st.integers(1, 12))
def test_the_bisection_is_the_scan_it_replaces(evicted, cache_units):
    """Against a scan of every unit, with runs evicted tail first (as the index evicts):
    the record stays prefix-closed (a unit is held only with every unit before it), so
    bisection finds the deepest held unit."""
    rec = SeenPrefixes(cache_units)
    for p in evicted:
        d = chain(p)
        for lo in range(len(d)):
            held = [x in rec._new or x in rec._old for x in d]
            assert held == sorted(held, reverse=True), "a unit held without its prefix"
            depth = sum(held)
            assert rec.branch(d, lo, len(d)) == (depth if depth > lo else 0)
        rec.evicted(reversed(d))
        rec.ended_turn(Ended([], 0, 0), 1)  # a request's end: where a generation may start
        rec.sanity_check()


def test_an_engine_plans_the_point_its_allocation_saves():
    """The port's plan for a request not allocated yet (where a vLLM chunk must end) holds
    the point the record finds, as its first allocation will."""
    from hybridcache.port import EnginePort

    m = mgr(admission="last-token+seen-branch", capacity=8 * 9216)
    port = EnginePort(m)
    serve(m, "q1", DOC + list(range(1, 11)), output=(77,))
    serve(m, "o1", OTHER + [4], output=(77,))
    toks = DOC + list(range(21, 31))
    m.add_request("q2", toks)
    planned = port.planned_save_points("q2", 0, len(toks))
    alloc = m.allocate("q2", len(toks))
    assert planned == [(100, False), (108, False)]
    assert [s.boundary for s in alloc.save_points] == [b for b, _ in planned]


def test_a_cache_copied_from_another_setting_keeps_a_record_exactly_when_its_rules_read_one():
    """A shadow restarted from another candidate's cache (``ShadowCache.copy_cache``) takes
    the rules it keeps, and the record with them: a ``seen-branch`` setting copied from
    a cache that kept none starts one (and the document's third question resumes at its
    end, as in a cache that ran the rule all along); a setting without the rule drops the
    copied one (it would feed a record it never reads)."""
    from hybridcache.config import CacheConfig
    from hybridcache.shadow import ShadowCache
    from tests.core.test_manager import U, tiny_spec

    def shadow(admission: str) -> ShadowCache:
        return ShadowCache(admission, tiny_spec(), 8 * 9216, CacheConfig(hash_unit=U, admission=admission))

    plain, seen = shadow("last-token"), shadow("last-token+seen-branch")
    assert plain.mgr.index.seen is None and seen.mgr.index.seen is not None
    serve(plain.mgr, "p0", [7] * 40, output=(77,))
    seen.copy_cache(plain)
    assert seen.mgr.index.seen is not None
    hits = []
    for rid, toks in (("q1", DOC + list(range(1, 11))), ("o1", OTHER + [4]),
                      ("q2", DOC + list(range(21, 31))), ("q3", DOC + list(range(41, 51)))):
        res, _ = serve(seen.mgr, rid, toks, output=(77,))
        hits.append(res.hit_tokens)
    assert hits[-1] == 100, hits
    seen.mgr.check_invariants()
    plain.copy_cache(seen)
    assert plain.mgr.index.seen is None
    plain.mgr.check_invariants()
