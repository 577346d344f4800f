"""The ``suffix-start`` admission rule and its estimate (hybridcache.suffix_starts)."""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

import hybridcache.suffix_starts as ss
from hybridcache.invariants import check_manager
from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.port import EnginePort
from tests.core.conftest import tiny_spec

U = 4
RULES = "last-token+turn-end+branch-point"


def serve(m, rid, tokens, output=()):
    res = m.add_request(rid, tokens)
    m.allocate(rid, len(tokens) - res.hit_tokens + len(output))
    if output:
        m.append_tokens(rid, list(output))
    m.commit(rid, len(tokens) + len(output))
    m.free(rid)
    return res


def mgr(admission):
    return HybridCacheManager(tiny_spec(), 1 << 22, CacheConfig(hash_unit=U, admission=admission))


def doc(i, n=40):
    return [1000 * (i + 1) + t for t in range(n)]


def question(i, j, n=8):
    return [500 + 37 * i + 11 * j + t for t in range(n)]


def test_a_second_question_on_a_new_document_resumes_at_the_documents_end():
    """Four documents asked twice teach the estimate (suffix 8 tokens: each second question
    leaves its document's end); the fifth document's first question saves a state at
    (48 - 1 - 8) // 4 * 4 = 36, and its second question resumes from it. Without the rule
    that question has only the prompt end of the first (past the branch): no hit."""
    hits = {}
    for rules in (RULES, RULES + "+suffix-start"):
        m = mgr(rules)
        for i in range(4):
            serve(m, f"{i}a", doc(i) + question(i, 0), output=[7] * 4)
            serve(m, f"{i}b", doc(i) + question(i, 1), output=[7] * 4)
        serve(m, "4a", doc(4) + question(4, 0), output=[7] * 4)
        res = serve(m, "4b", doc(4) + question(4, 1), output=[7] * 4)
        assert res.kv_hit_tokens == 40
        hits[rules] = res.hit_tokens
        check_manager(m)
        m.suffix_starts.sanity_check()
    assert hits == {RULES: 0, RULES + "+suffix-start": 36}


def test_sessions_that_extend_their_turns_get_no_estimate_and_no_extra_state():
    """Each turn extends the last one's prompt and output: every match stops at a turn end
    the estimate remembers, so it predicts nothing and the rule saves nothing."""
    saved = {}
    for rules in (RULES, RULES + "+suffix-start"):
        m = mgr(rules)
        for s in range(3):
            ctx = doc(s, 20)
            for t in range(5):
                out = [900 + 10 * s + t] * 6
                serve(m, f"{s}.{t}", ctx, output=out)
                ctx = ctx + out + question(s, t, 6)
        saved[rules] = m.metrics.snapshots_saved
        assert m.suffix_starts.estimate() is None or rules == RULES
    assert saved[RULES] == saved[RULES + "+suffix-start"]


def test_the_ports_planned_save_points_show_the_rules_point_before_the_allocation():
    port = EnginePort(mgr(RULES + "+suffix-start"))
    for i in range(4):
        for j in range(2):
            r = port.add_request(f"{i}{j}", doc(i) + question(i, j))
            a = port.allocate(f"{i}{j}", 48 - r.hit_tokens + 4)
            port.append_tokens(f"{i}{j}", [7] * 4)
            port.commit(f"{i}{j}", 52)
            port.free(f"{i}{j}")
    port.add_request("x", doc(4) + question(4, 0))
    planned = port.planned_save_points("x", 0, 52)
    a = port.allocate("x", 52)
    assert (36, False) in planned
    assert [(s.boundary, False) for s in a.save_points if s.boundary != 52] == [p for p in planned if not p[1]]


def brute(suffixes: deque, spare: bool = False) -> int | None:
    """The estimate by its definition: the suffix-start rule's needs MIN_MATCHES matches, at
    least half of them siblings; the spare one's (spare-suffix-start) MIN_MATCHES siblings."""
    sib = sorted(s for s in suffixes if s is not None)
    if spare and len(sib) < ss.MIN_MATCHES:
        return None
    if not spare and (len(suffixes) < ss.MIN_MATCHES or 2 * len(sib) < len(suffixes)):
        return None
    return sib[min(len(sib) - 1, int(ss.QUANTILE * len(sib)))]


class _Req:
    def __init__(self, digests, prompt_len, kv):
        self.hasher = type("H", (), {"digests": digests})()
        self.prompt_len, self.kv_hit_tokens, self.hit_tokens = prompt_len, kv, 0
        self.num_computed = self.num_tokens = prompt_len


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30), st.booleans(), st.booleans(),
                          st.sampled_from([0, 30])), max_size=150))
def test_the_window_its_estimate_preview_and_undo_agree_with_a_brute_force(ops):
    """Matches (some stopping at a remembered end), previews and undone matches in any
    order, for either rule (the save point's and the spare's bar): the estimate is the
    brute force's over the window, the boundary a match returns is the brute force's
    estimate placed below that prompt's end, a preview is what the match then returns, and
    an undo leaves the window as it was. A window of 16 (not 64) so that it fills and slides
    in most examples."""
    window, ss.WINDOW = ss.WINDOW, 16
    try:
        _replay(ops)
    finally:
        ss.WINDOW = window


def _expected_boundary(prompt_len: int, matched: int, suffix: int | None) -> int:
    if suffix is None:
        return 0
    b = (prompt_len - 1 - suffix) // U * U
    return b if matched < b < (prompt_len - 1) // U * U else 0


def _replay(ops):
    est, model = ss.SuffixStarts(), deque()
    ends = [bytes([k]) * 16 for k in range(4)]
    for k, units, is_end, undo, tail in ops:
        spare = bool(k & 2)
        digests = [bytes([100 + k])] * (units - 1) + [ends[k] if is_end else bytes([200 + k]) * 16]
        req = _Req(digests, units * U + 9 + tail, units * U)
        expect = est.preview(req, req.kv_hit_tokens, 0, U)
        before = (list(est.suffixes), list(est._sorted))
        own = None if digests[-1] in est._ends else req.prompt_len - req.kv_hit_tokens
        after = deque(list(model) + [own], maxlen=ss.WINDOW)
        got = est.note_match(req, U, spare=spare)
        assert got == _expected_boundary(req.prompt_len, req.kv_hit_tokens, brute(after, spare))
        if not spare:
            assert got == expect
        if undo:
            est.undo_match(req)
            assert (list(est.suffixes), list(est._sorted)) == before
        else:
            model = after
        if is_end and k % 2:
            est.note_end(_Req(digests, units * U, 0), U)
        est.sanity_check()
        assert list(est.suffixes) == list(model)
        assert est.estimate() == brute(model)
        assert est.estimate(spare=True) == brute(model, spare=True)


def test_the_spare_bar_places_a_boundary_where_the_save_points_does_not():
    """Ten siblings (own suffix 9) among 24 matches: too few for the save point's bar
    (half), enough for the spare one's (four siblings). A request whose own part is 39
    tokens (the 90th percentile with it is still 9) gets the spare's boundary at the
    prompt's end less 9, rounded down to the unit (past its match), and none from the
    save point's estimate."""
    est = ss.SuffixStarts()
    end = b"\xff" * 16  # a remembered prompt end: a match stopping there extends it
    est._ends[end] = None
    for i in range(24):
        sibling = i % 12 < 5
        digests = [bytes([i])] * 4 + [bytes([100 + i]) * 16 if sibling else end]
        est.note_match(_Req(digests, 5 * U + 9, 5 * U), U)
    assert len(est._sorted) == 10 and est.estimate() is None and est.estimate(spare=True) == 9
    digests = [b"x"] * 4 + [b"y" * 16]
    prompt = 5 * U + 39
    assert est.preview(_Req(digests, prompt, 5 * U), 5 * U, 0, U) == 0
    assert est.note_match(_Req(digests, prompt, 5 * U), U, spare=True) == (prompt - 1 - 9) // U * U
    est.sanity_check()


def test_an_undo_takes_back_only_the_refused_requests_own_match():
    est = ss.SuffixStarts()
    a, b = _Req([b"a" * 16] * 3, 20, 12), _Req([b"b" * 16] * 3, 20, 12)
    est.note_match(a, U)
    est.undo_match(b)  # b's allocation was refused, but b's match was never counted
    assert list(est.suffixes) == [8]
    est.undo_match(a)
    assert list(est.suffixes) == []
    est.sanity_check()
