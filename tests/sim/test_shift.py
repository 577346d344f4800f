"""The change detector of the adaptive policy (hybridcache.shift): it must signal a change
of workload soon after it happens and stay quiet on stationary ones, whose sizes are far
from independent (sessions grow, sub-agents and compactions come in runs)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridcache.errors import ConfigError
from hybridcache.shift import ShiftDetector
from hybridcache.sim.generate import generate, generate_change


@pytest.mark.parametrize("kind", ["chat", "agent", "docs", "mixed", "agentic"])
def test_no_signal_on_stationary_generated_workloads(kind):
    for seed in range(4):
        d = ShiftDetector()
        assert not any(d.add(r.input_length) for r in generate(kind, 2000, seed=seed, tenants=2)), (kind, seed)


@pytest.mark.parametrize(("first", "second", "within"), [
    ("agentic", "chat", 40), ("chat", "docs", 20), ("docs", "agent", 60), ("agent", "mixed", 60)])
def test_signals_a_change_of_kind_soon_after_it(first, second, within):
    """150 requests of one kind, then 300 of another: one signal, within ``within``
    requests of the change (measured: 31, 13, 52 and 43)."""
    reqs = generate(first, 150, seed=3, tenants=2) + generate(second, 300, seed=3, tenants=2)
    d = ShiftDetector()
    at = [i for i, r in enumerate(reqs) if d.add(r.input_length)]
    assert len(at) == 1 and 150 <= at[0] < 150 + within, at
    assert d.changes == 1


def test_equal_sizes_and_small_drift_are_one_workload():
    """A warm-up of equal prompts has no spread of its own: the least one (MIN_SPREAD)
    stands in, so 20 % larger prompts are not a change, four times larger ones are."""
    d = ShiftDetector()
    assert not any(d.add(3000) for _ in range(200))
    assert not any(d.add(3600) for _ in range(500))
    d = ShiftDetector()
    for _ in range(100):
        d.add(3000)
    at = [i for i in range(100) if d.add(12000)]
    assert at and at[0] < 20, at


def test_bad_parameters_are_refused():
    for kwargs in ({"delta": -0.1}, {"threshold": 0.0}, {"warmup": 1}):
        with pytest.raises(ConfigError):
            ShiftDetector(**kwargs)


def test_generated_change_of_kind_is_the_two_workloads_one_after_the_other():
    """``generate_change``: the first kind's requests as ``generate`` gives them, then the
    second's, later in time and under tenants of their own (nothing reused across it)."""
    reqs = generate_change("agentic", "chat", (150, 300), seed=3)
    first, second = generate("agentic", 150, seed=3), generate("chat", 300, seed=3)
    assert len(reqs) == 450
    assert [r.input_length for r in reqs] == [r.input_length for r in first + second]
    assert all(r.timestamp >= reqs[149].timestamp for r in reqs[150:])
    assert {r.tenant for r in reqs[:150]}.isdisjoint({r.tenant for r in reqs[150:]})
    assert all(r.tenant.startswith("b-") for r in reqs[150:])
    with pytest.raises(ValueError):
        generate_change("agentic", "nope", (10, 10))


def _plain_detector_signals(sizes: list[int]) -> tuple[list[int], list[tuple[float, float, float, float]]]:
    """The test as the module docstring states it, with ``max`` and Welford's update
    spelled out: the reference the written-out :meth:`ShiftDetector.add` must equal."""
    import math

    from hybridcache.shift import DELTA, MIN_SPREAD, THRESHOLD, WARMUP
    n, mean, m2, up, down, at, states = 0, 0.0, 0.0, 0.0, 0.0, [], []
    for i, size in enumerate(sizes):
        x = math.log(max(1, size))
        if n >= WARMUP:
            z = (x - mean) / max(MIN_SPREAD, math.sqrt(m2 / (n - 1)))
            up, down = max(0.0, up + z - DELTA), max(0.0, down - z - DELTA)
            if up > THRESHOLD or down > THRESHOLD:
                at.append(i)
                n, mean, m2, up, down = 0, 0.0, 0.0, 0.0, 0.0
        n += 1
        d = x - mean
        mean += d / n
        m2 += d * (x - mean)
        states.append((mean, m2, up, down))
    return at, states


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.integers(1, 100_000), st.integers(0, 100), st.lists(st.integers(0, 200), min_size=40, max_size=400),
       st.integers(0, 400), st.integers(1, 50))
def test_written_out_add_equals_the_plain_test(base, spread, draws, at, scale):
    """Prompt sizes within ``spread`` % of ``base`` (log spreads below and above
    MIN_SPREAD; sizes 0 and 1 included), times ``scale`` from request ``at`` on (a step
    change): the same signals, and the same statistics after every request, bit for bit."""
    percents = [100 + (p - 100) * spread // 100 for p in draws]
    sizes = [base * p // 100 * (scale if i >= at else 1) for i, p in enumerate(percents)]
    d = ShiftDetector()
    got, states = [], []
    for i, size in enumerate(sizes):
        if d.add(size):
            got.append(i)
        states.append((d.mean, d.m2, d.up, d.down))
    assert (got, states) == _plain_detector_signals(sizes)
