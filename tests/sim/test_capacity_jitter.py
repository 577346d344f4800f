"""The capacity-jitter script's summary (``benchmarks/capacity_jitter.py``): the swings, the
cells that lose hits with a block more, and the adaptive verdict's flips, on rows whose
answers are known."""

from __future__ import annotations

from benchmarks import capacity_jitter as mod


def _row(gib: int, adaptive: list[float], peer: list[float]) -> dict:
    return {"cell": f"x@{gib}", "gib": gib, "block_mib": 41.0,
            "rates": {"hybridcache-adaptive": adaptive, "marconi": peer}}


def test_summary_counts_swings_losses_and_flips():
    rows = [
        _row(1, [0.50, 0.47, 0.52], [0.49, 0.49, 0.49]),  # adaptive dips at C: behind there only
        _row(1, [0.60, 0.61, 0.62], [0.60, 0.60, 0.60]),  # monotone, never behind
        _row(2, [0.80, 0.80, 0.80], [0.81, 0.81, 0.81]),  # behind at all three: no flip
    ]
    out = mod.summary(rows)
    lines = out.splitlines()
    # 1 GiB adaptive: swings 0.02 and 0.02; the first row loses 0.03 going C - k -> C.
    assert "| 1 | hybridcache-adaptive | 2 | 0.0200 | 0.0200 | 1 |" in lines
    assert "| 1 | marconi | 2 | 0.0000 | 0.0000 | 0 |" in lines
    # The dip at C: behind there (0.47 < 0.49 - 0.002), not on the mean (0.4967 > 0.49).
    assert "| 1 | 2 | 0 / 1 / 0 | 1 | 0 |" in lines
    assert "| 2 | 1 | 1 / 1 / 1 | 0 | 1 |" in lines


def test_a_block_is_a_state_slot_of_the_model():
    assert 40 << 20 < mod.block_bytes("kimi-linear-48b", 1 << 30) < 42 << 20
