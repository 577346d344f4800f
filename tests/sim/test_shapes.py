"""Workload shapes (hybridcache.sim.shapes): held-out lengths, counts and rates.

The default shape must leave every generated trace as it was (every recorded figure rests on
them), and each factor must move what it names, so that a sweep over drawn shapes holds a
policy to proportions nobody tuned for.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from hybridcache.sim.cli import main
from hybridcache.sim.generate import KINDS, generate
from hybridcache.sim.shapes import (
    DOCS_RANGE,
    LENGTH_SPAN,
    PACE_SPAN,
    SKEW_RANGE,
    TURN_SPAN,
    Shape,
    scaled,
)

#: sha256 of every kind's first 60 requests at seeds 0 and 3, generated before shapes existed
#: (commit d5ff6fc): the default shape draws and scales nothing.
BUILT = "49756559de46ed744baaeb061bbe3be6"


def _digest(shape: Shape | None) -> str:
    h = hashlib.sha256()
    for kind in KINDS:
        for seed in (0, 3):
            for r in generate(kind, 60, seed=seed, shape=shape):
                h.update(repr((r.timestamp, r.input_length, r.output_length, r.tenant, r.session_id)).encode())
                h.update(r.input_ids.tobytes())
                h.update(r.output_ids.tobytes())
    return h.hexdigest()[:32]


def test_the_default_shape_leaves_every_kind_as_built():
    assert _digest(None) == _digest(Shape()) == BUILT


def test_scaled_ranges():
    assert scaled(600, 1800, 1.0) == (600, 1800)
    assert scaled(600, 1800, 0.5) == (300, 900)
    assert scaled(2, 8, 0.1) == (1, 1)  # at least one, and hi >= lo
    assert scaled(20, 200, 4.0) == (80, 800)


def _sessions(reqs) -> dict[str, list]:
    out: dict[str, list] = {}
    for r in reqs:
        out.setdefault(r.session_id, []).append(r)
    return out


def _median(values) -> float:
    return float(np.median(np.asarray(list(values), dtype=float)))


@pytest.mark.parametrize("factor", [0.25, 3.0])
def test_each_length_factor_scales_what_it_names(factor):
    """Chat: the first turn's prompt is the system prompt plus a message; later turns
    append the last output and a message. Each factor moves its own part by about itself."""
    def parts(reqs) -> dict[str, float]:
        sessions = _sessions(reqs).values()
        msgs = [b.input_length - a.input_length - a.output_length for s in sessions for a, b in zip(s, s[1:])]
        return {"system": _median(s[0].input_length for s in sessions), "message": _median(msgs),
                "output": _median(r.output_length for r in reqs)}

    base = parts(generate("chat", 400, seed=9))
    for name, part in (("prefix", "system"), ("message", "message"), ("output", "output")):
        got = parts(generate("chat", 400, seed=9, shape=Shape(**{name: factor})))
        ratio = got[part] / base[part]
        assert factor * 0.7 < ratio < factor * 1.4, (name, ratio)
        for other in {"message", "output"} - {part}:  # the system prompt carries a message
            assert 0.7 < got[other] / base[other] < 1.4, (name, other)


def test_turns_pace_docs_and_skew_move_what_they_name():
    def turns(shape):
        return _median(len(s) for s in _sessions(generate("agent", 600, seed=2, shape=shape)).values())

    assert turns(Shape(turns=2.0)) > 1.5 * turns(Shape())

    def span(shape):  # seconds the first 300 requests take: more sessions at a time, sooner
        reqs = generate("chat", 300, seed=2, shape=shape)
        return reqs[-1].timestamp - reqs[0].timestamp

    assert span(Shape(pace=4.0)) < 0.5 * span(Shape())

    def documents(shape):
        reqs = generate("docs", 600, seed=4, tenants=1, shape=shape)
        firsts = [r.input_ids[:64].tobytes() for r in reqs]
        counts = sorted((firsts.count(f) for f in set(firsts)), reverse=True)
        return len(counts), counts[0] / len(reqs)

    assert documents(Shape(docs=3))[0] == 3
    assert documents(Shape(docs=40))[0] > 20
    assert documents(Shape(docs=40, skew=1.6))[1] > 1.5 * documents(Shape(docs=40, skew=0.6))[1]


def test_agentic_sessions_at_large_and_small_shapes():
    """Contexts stay in their buffers (a large shape's head, appends and outputs), and most
    requests still extend their context's previous prompt verbatim."""
    for shape in (Shape(prefix=4.0, message=4.0, output=4.0, turns=2.0), Shape(prefix=8.0, message=4.0),
                  Shape(prefix=0.25, message=0.25)):
        reqs = generate("agentic", 150, seed=1, shape=shape)
        assert len(reqs) == 150
        last: dict[str, np.ndarray] = {}
        extends = 0
        for r in reqs:
            prev = last.get(r.session_id)
            if prev is not None and len(prev) < r.input_length and np.array_equal(r.input_ids[: len(prev)], prev):
                extends += 1
            last[r.session_id] = r.input_ids
        assert extends > 0.8 * len(reqs), extends
    big = generate("agentic", 200, seed=1, shape=Shape(prefix=4.0))
    small = generate("agentic", 200, seed=1, shape=Shape(prefix=0.25))
    assert _median(r.input_length for r in big) > 4 * _median(r.input_length for r in small)


def test_draw_is_seeded_and_within_its_spans():
    assert Shape.draw(5) == Shape.draw(5) != Shape.draw(6)
    for seed in range(200):
        s = Shape.draw(seed)
        for f, span in (("prefix", LENGTH_SPAN), ("message", LENGTH_SPAN), ("output", LENGTH_SPAN),
                        ("turns", TURN_SPAN), ("pace", PACE_SPAN)):
            assert 1 / span - 1e-3 <= getattr(s, f) <= span + 1e-3
        assert DOCS_RANGE[0] <= s.docs <= DOCS_RANGE[1]
        assert SKEW_RANGE[0] <= s.skew <= SKEW_RANGE[1]
    logs = [math.log(Shape.draw(seed).prefix) for seed in range(200)]
    assert min(logs) < -0.8 * math.log(LENGTH_SPAN) and max(logs) > 0.8 * math.log(LENGTH_SPAN)
    assert Shape().label() == "default" and Shape(docs=3).label() == "docs=3"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"prefix": 0}, "shape prefix must be a finite number > 0, got 0"),
    ({"message": -1.0}, "shape message must be"),
    ({"pace": math.inf}, "shape pace must be"),
    ({"turns": True}, "shape turns must be"),
    ({"output": "2"}, "shape output must be"),
    ({"docs": 0}, "shape docs must be an int >= 1, got 0"),
    ({"docs": 2.5}, "shape docs must be an int >= 1"),
    ({"skew": -0.1}, "shape skew must be a finite number >= 0"),
])
def test_a_bad_shape_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Shape(**kwargs)


def test_generate_refuses_a_shape_that_is_not_a_shape():
    with pytest.raises(ValueError, match="shape must be a Shape, got"):
        generate("chat", 5, shape={"prefix": 2.0})


def test_cli_generate_at_a_drawn_shape(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    assert main(["generate", "--kind", "docs", "--requests", "12", "--shape", "3", "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"shape {Shape.draw(3).label()}" in said and len(out.read_text().splitlines()) == 12
