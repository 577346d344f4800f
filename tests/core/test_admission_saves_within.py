"""``AdmissionPolicy.saves_within``: where it holds, every point the rules save while
nothing is evicted the other rules save too. The adaptive policy's shadows wait for the
live cache's pressure on it (hybridcache.shadow_backlog): a candidate that could save a
point the live cache does not would make that wait lose decisions."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridcache.admission import AdmissionPolicy, admission_points
from hybridcache.candidates import candidate_settings
from hybridcache.presets import get_preset

UNIT = 16


@st.composite
def policies(draw: st.DrawFn) -> AdmissionPolicy:
    return AdmissionPolicy(
        last_token=draw(st.booleans()), turn_end=draw(st.booleans()), branch_point=draw(st.booleans()),
        seen_branch=draw(st.booleans()), interval=draw(st.sampled_from([0, 32, 64, 96, 128])),
        last_block=draw(st.sampled_from([0, 64, 128])), chunk_end=draw(st.booleans()),
        suffix_start=draw(st.booleans()), min_seen=draw(st.integers(1, 3)),
    )


@st.composite
def requests(draw: st.DrawFn) -> tuple[SimpleNamespace, int, int]:
    """A request as a step sees it with nothing evicted: the ``seen-branch`` point is the
    KV match's end past the hit, as ``SeenPrefixes.point`` gives with an empty record."""
    prompt = draw(st.integers(1, 40)) * UNIT + draw(st.integers(0, UNIT - 1))
    kv = draw(st.integers(0, prompt // UNIT)) * UNIT
    hit = draw(st.integers(0, kv // UNIT)) * UNIT
    last = (prompt - 1) // UNIT * UNIT
    seen = min(kv, last) if kv > hit else 0
    suffix = draw(st.integers(0, last // UNIT)) * UNIT
    req = SimpleNamespace(prompt_len=prompt, kv_hit_tokens=kv, hit_tokens=hit, seen_branch=seen,
                          suffix_start=suffix)
    start = draw(st.integers(hit // UNIT, prompt // UNIT + 4)) * UNIT
    end = start + draw(st.integers(1, 30)) * UNIT
    return req, start, end


@settings(max_examples=400, deadline=None, derandomize=True)
@given(a=policies(), b=policies(), step=requests())
def test_rules_that_save_within_others_save_no_point_the_others_do_not(a, b, step):
    req, start, end = step
    if not a.saves_within(b):
        return
    mine = set(admission_points(a, req, start, end, UNIT))
    theirs = set(admission_points(b, req, start, end, UNIT))
    assert mine <= theirs, (a, b, req, start, end)
    assert a.min_seen >= b.min_seen  # a point wanted n times: b saves it as soon as a does


def test_the_default_candidates_save_within_the_first_and_vllms_block_rules_do_not():
    """The default set waits for pressure; with vLLM's rules at its block (a state inside
    the prompt, at a block boundary, that the first candidate does not save) it may not."""
    spec = get_preset("kimi-linear-48b")
    first, *rest = candidate_settings(spec, UNIT)

    def rules(c):  # what a candidate's manager runs
        return replace(AdmissionPolicy.parse(c.admission, UNIT), min_seen=c.min_seen)

    assert rest and all(rules(c).saves_within(rules(first)) for c in rest)
    blocks = candidate_settings(spec, UNIT, align_blocks=True)[-1]
    assert blocks.name == "seen-twice-blocks" and not rules(blocks).saves_within(rules(first))


def test_each_rule_can_break_the_relation():
    """Every rule is checked: dropping any one check would let a wider setting through."""
    base = AdmissionPolicy(last_token=True, turn_end=True, seen_branch=True, interval=64)
    assert base.saves_within(base)
    assert replace(base, seen_branch=False, branch_point=True).saves_within(base)  # the same points, unevicted
    for wider in (dict(chunk_end=True), dict(suffix_start=True), dict(last_block=128), dict(interval=32)):
        assert not replace(base, **wider).saves_within(base), wider
    for missing in ("last_token", "turn_end", "seen_branch", "interval"):
        assert not base.saves_within(replace(base, **{missing: type(getattr(base, missing))()})), missing
    assert not base.saves_within(replace(base, min_seen=2))
