"""The ``agentic`` generator kind: seeded, and with the statistics it promises (loosely)."""

from __future__ import annotations

import numpy as np

from hybridcache.sim.generate import generate


def _extends(prev, r) -> bool:
    n = prev.input_length + prev.output_length
    return r.input_length > n and np.array_equal(r.input_ids[: prev.input_length], prev.input_ids) and \
        np.array_equal(r.input_ids[prev.input_length : n], prev.output_ids)


def test_same_seed_same_trace_other_seed_other_trace():
    a, b, c = (generate("agentic", 60, seed=s) for s in (4, 4, 5))
    assert [r.input_length for r in a] == [r.input_length for r in b]
    assert all(np.array_equal(x.input_ids, y.input_ids) for x, y in zip(a, b))
    assert [r.input_length for r in a] != [r.input_length for r in c]


def test_statistics():
    reqs = generate("agentic", 1500, seed=0, tenants=2)
    assert all(x.timestamp <= y.timestamp for x, y in zip(reqs, reqs[1:]))
    last: dict[str, object] = {}
    extends = 0
    for r in reqs:
        prev = last.get(r.session_id)
        extends += prev is not None and _extends(prev, r)
        last[r.session_id] = r
    assert 0.88 <= extends / len(reqs) <= 0.97
    main = np.array([r.input_length for r in reqs if "/s" not in r.session_id])
    assert np.percentile(main, 5) >= 40_000 and main.max() <= 250_000
    assert np.percentile(main, 95) >= 120_000
    ids = {r.session_id for r in reqs}
    assert any("/s" in s for s in ids), "sub-agents"
    assert any("/c" in s for s in ids), "compactions"
    # Think times of a session (sub-agents included): p50 ~10 s, p90 ~160 s.
    seen: dict[str, float] = {}
    gaps = []
    for r in reqs:
        s = r.session_id.split("/")[0]
        if s in seen:
            gaps.append(r.timestamp - seen[s])
        seen[s] = r.timestamp
    p50, p90 = np.percentile(gaps, [50, 90])
    assert 6 <= p50 <= 16 and 100 <= p90 <= 260


def test_compaction_drops_most_of_the_context():
    reqs = generate("agentic", 1500, seed=0, tenants=2)
    by_sid: dict[str, list] = {}
    for r in reqs:
        by_sid.setdefault(r.session_id, []).append(r)
    for sid, rs in by_sid.items():
        if "/c" in sid:
            parent = sid.rsplit("/c", 1)[0]
            parent = parent if parent in by_sid else f"{parent}/c{int(sid.rsplit('/c', 1)[1]) - 1}"
            before = [r for r in by_sid.get(parent, []) if r.timestamp < rs[0].timestamp]
            if before:
                assert rs[0].input_length < 0.7 * before[-1].input_length
