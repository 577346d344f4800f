"""Detect a change of workload from what the live cache sees for free: its requests' sizes.

The adaptive policy (:mod:`hybridcache.adaptive`) compares its candidates over a window that
decays by the KV bytes of the requests' prompts, retires the candidates that cannot win, and
after its exploration runs the shadows only within an overhead budget. All three suit a
stationary workload and all three hold it back after a change: small prompts after large
ones hardly decay the old savings (300 chat requests after 150 agentic sessions moved the
scores' ratios by 0.01-0.02), the best candidate for the new workload may be retired (it
comes back after 16 shadow fills), and the budget runs the shadows too rarely to see the
change. A detected change lets the manager forget all three (:meth:`AdaptiveManager._after_shift`).

:class:`ShiftDetector` is a two-sided Page-Hinkley test on the logarithm of the prompt
length, standardised by the running mean and deviation since the last change: it signals
when the cumulative excess of the standardised sizes beyond ``DELTA`` deviations, in either
direction, passes ``THRESHOLD``. The unit is the workload's own spread, so no size is a
constant here: a sustained shift of the mean by one deviation is flagged after about
``THRESHOLD / (1 - DELTA)`` = 100 requests, larger ones sooner (150 requests of one
generated kind, then another: agentic to chat flagged 31 requests after the change, chat to
docs 13, docs to agent 52). What sets the threshold is the false alarm: requests are not independent
(a session's turns grow together, sub-agents and compactions come in runs). At 50 the test
signalled in none of 20 stationary generated traces of 2,000 requests (five kinds, four
seeds) and once in Mooncake's 3,993 prompt lengths (at request 3,988; not in the adaptive
replay, whose prompts are whole 512-token blocks); at 25, twice and once (request 3,380).
Sizes only see changes that move them; a change that keeps the sizes and moves the reuse
is left to the window.
"""

from __future__ import annotations

import math

from hybridcache.errors import ConfigError

#: Tolerance, in deviations of the log prompt length: drift within it is not a change.
DELTA = 0.5
#: The cumulative excess that signals a change (module docstring).
THRESHOLD = 50.0
#: Requests the mean and deviation are learned from before the test runs.
WARMUP = 30
#: The least deviation assumed, in log size: prompts within about 40 % of each other are
#: one workload's spread even where the warm-up saw a single size (a synthetic stream of
#: equal prompts would otherwise signal on the first that differs).
MIN_SPREAD = 0.35


class ShiftDetector:
    """Two-sided Page-Hinkley test on standardised log prompt lengths (module docstring).

    Invariants: ``n``, ``mean`` and ``m2`` are Welford's running count, mean and sum of
    squared deviations of the log sizes since the last change; ``up`` and ``down`` are the
    cumulative excesses (both >= 0), zero until ``n`` reaches ``WARMUP``.
    """

    def __init__(self, delta: float = DELTA, threshold: float = THRESHOLD, warmup: int = WARMUP) -> None:
        if delta < 0 or threshold <= 0 or warmup < 2:
            raise ConfigError(f"ShiftDetector needs delta >= 0, threshold > 0 and warmup >= 2; "
                              f"got delta={delta}, threshold={threshold}, warmup={warmup}")
        self.delta, self.threshold, self.warmup = delta, threshold, warmup
        self.changes = 0
        self._restart()

    def _restart(self) -> None:
        self.n = 0
        self.mean = self.m2 = 0.0
        self.up = self.down = 0.0

    def add(self, prompt_tokens: int) -> bool:
        """Count one request's prompt; True when it completes a change (the test then
        starts again, learning the new workload's sizes from this request on).

        It runs for every finished request of the adaptive manager, so it is written with
        locals and comparisons in place of ``max`` (the same values as the formulas in the
        module docstring: ``tests/sim/test_shift.py`` checks them against the plain form).

        Internal updates: the running statistics and the cumulative excesses."""
        x = math.log(prompt_tokens) if prompt_tokens > 1 else 0.0
        n = self.n
        if n >= self.warmup:
            sd = math.sqrt(self.m2 / (n - 1))
            z = (x - self.mean) / (sd if sd > MIN_SPREAD else MIN_SPREAD)
            up = self.up + z - self.delta
            down = self.down - z - self.delta
            self.up = up = up if up > 0.0 else 0.0
            self.down = down = down if down > 0.0 else 0.0
            if up > self.threshold or down > self.threshold:
                self.changes += 1
                self._restart()
                # Welford's update from the fresh state: the mean is this size, m2 stays 0.
                self.n, self.mean = 1, x
                return True
        n += 1
        self.n = n
        mean = self.mean
        d = x - mean
        mean += d / n
        self.mean = mean
        self.m2 += d * (x - mean)
        return False
