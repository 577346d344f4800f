"""The end-to-end check: cached serving == uncached serving, and the check catches bugs."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridcache.adapters.reference import WorkloadShape
from hybridcache.adapters.reference.check import TOLERANCE, main, run_check

from .conftest import tiny_options


def _assert_ok(report) -> None:
    s = report.summary()
    assert report.mismatched_tokens == 0, s
    assert report.max_abs_diff <= TOLERANCE, s
    assert report.tokens_compared > 0 and report.requests > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kda", ["chunked", "recurrent"])
@pytest.mark.parametrize("spec_decode", [False, True])
def test_check_passes(seed, kda, spec_decode):
    report = run_check(tiny_options(seed=seed, kda=kda, spec_decode=spec_decode))
    _assert_ok(report)
    assert report.hit_tokens > 0  # the comparison covered restored snapshots
    assert report.cached.copies > 0
    if spec_decode:
        assert report.cached.spec_steps > 0 and report.cached.drafted > 0


def test_check_under_eviction_pressure_and_preemption():
    """A tight arena: snapshots and pages are evicted and requests preempted, still exact."""
    # 44 KiB: at 48 KiB every step fits once allocate counts before it takes (draft slots
    # are taken before pages), so nothing would be preempted.
    report = run_check(tiny_options(seed=5, requests=14, capacity=44 * 1024, spec_decode=True))
    _assert_ok(report)
    m = report.manager_stats
    assert m["evictions_kv"] > 0 and m["evictions_state"] > 0
    assert report.cached.preemptions > 0
    assert report.cached.accepted > 0 and report.manager_stats["snapshots_rejected"] >= 0


def test_spec_decode_falls_back_when_draft_slots_do_not_fit():
    """40 KiB = 10 blocks: a 159-token request alone cannot also hold 3 draft slots."""
    opts = tiny_options(
        seed=145884,
        requests=13,
        capacity=40 * 1024,
        spec_decode=True,
        prefill_chunk=32,
        admission="turn-end+interval:32",
    )
    report = run_check(opts)
    _assert_ok(report)
    assert report.cached.spec_fallbacks > 0 and report.cached.spec_steps > 0


@pytest.mark.parametrize("eviction", ["lru", "marconi"])
def test_check_other_eviction_policies(eviction):
    _assert_ok(run_check(tiny_options(seed=3, eviction=eviction, capacity=64 * 1024)))


def test_check_with_interval_and_chunk_end_snapshots():
    """Odd chunk sizes put snapshot boundaries inside chunks at many offsets."""
    opts = tiny_options(
        seed=4, prefill_chunk=23, admission="last-token+turn-end+interval:32+chunk-end"
    )
    report = run_check(opts)
    _assert_ok(report)
    assert report.manager_stats["snapshots_saved"] > report.requests


@pytest.mark.parametrize("mutation", ["skip-copy", "zero-state"])
def test_check_fails_when_the_snapshot_is_not_restored(mutation):
    """The check exists to catch KV hits used without their recurrent state."""
    report = run_check(tiny_options(seed=0, mutation=mutation))
    assert report.hit_tokens > 0
    assert not report.ok
    assert report.max_abs_diff > 1e-2


#: Documents asked one question each, three of them in a cache that holds about one: a
#: question often comes after the other documents evicted its document's KV.
DOCS_UNDER_PRESSURE = WorkloadShape(system_prompts=1, documents=3, document_len=(120, 200),
                                    p_chat=0.1, p_document=0.8, doc_turns=(1, 1))


@pytest.mark.parametrize(("seed", "kib"), [(0, 56), (1, 56), (3, 72)])
def test_check_passes_with_states_saved_from_the_record_of_evicted_units(seed, kib):
    """The default rules' ``seen-branch`` saves a state where a question leaves a document
    whose KV the cache let go (``hybridcache.seen_prefixes``), which ``branch-point`` never
    saves; later questions resume from those states. Cached outputs equal uncached ones
    with either rule, and the rules' hits differ, so the record's states were served
    (measured hit tokens, branch-point / seen-branch: 0 / 128, 432 / 752, 64 / 496)."""
    hits = {}
    for adm in ("last-token+turn-end+branch-point", "last-token+turn-end+seen-branch"):
        report = run_check(tiny_options(seed=seed, requests=16, capacity=kib * 1024,
                                        shape=DOCS_UNDER_PRESSURE, admission=adm))
        _assert_ok(report)
        hits[adm] = report.hit_tokens
    assert len(set(hits.values())) == 2 and hits["last-token+turn-end+seen-branch"] > 0, hits
    mutated = run_check(tiny_options(seed=seed, requests=16, capacity=kib * 1024, shape=DOCS_UNDER_PRESSURE,
                                     admission="last-token+turn-end+seen-branch", mutation="skip-copy"))
    assert not mutated.ok  # the hits restored states: without the copy the outputs differ


workloads = st.builds(
    WorkloadShape,
    system_prompts=st.integers(1, 3),
    system_len=st.tuples(st.integers(1, 30), st.integers(30, 70)),
    documents=st.integers(1, 2),
    document_len=st.tuples(st.integers(40, 90), st.integers(90, 150)),
    user_len=st.tuples(st.integers(1, 5), st.integers(5, 20)),
    max_new=st.tuples(st.integers(1, 3), st.integers(3, 9)),
    chat_turns=st.tuples(st.just(1), st.integers(1, 3)),
    p_chat=st.floats(0.2, 0.7),
    p_document=st.floats(0.1, 0.3),
)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=workloads,
    seed=st.integers(0, 10_000),
    chunk=st.integers(5, 70),
    unit=st.sampled_from([8, 16]),
    spec=st.booleans(),
    live=st.integers(1, 4),
)
def test_check_on_generated_workloads(shape, seed, chunk, unit, spec, live):
    opts = tiny_options(
        seed=seed,
        requests=6,
        shape=shape,
        prefill_chunk=chunk,
        hash_unit=unit,
        spec_decode=spec,
        max_live=live,
        capacity=160 * 1024,
    )
    _assert_ok(run_check(opts))


def test_cli_prints_one_json_line(capsys):
    code = main(["--seed", "1", "--requests", "3", "--capacity", str(1 << 20)])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and len(out) == 1
    line = json.loads(out[0])
    assert set(line) == {
        "requests",
        "tokens_compared",
        "hit_tokens",
        "prompt_tokens",
        "max_abs_diff",
        "mismatched_tokens",
    }
    assert line["requests"] == 3 and line["mismatched_tokens"] == 0
