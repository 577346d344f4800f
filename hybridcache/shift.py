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
is left to the window, and to :class:`DropDetector`: a sustained fall of the live cache's
own hit fraction, where the setting in force may have stopped leading.
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


class PageHinkley:
    """Page-Hinkley test on samples standardised by their running mean and deviation since
    the last signal; the one test behind both detectors of this module.

    ``step(x)`` adds a sample and returns True when the cumulative excess beyond ``delta``
    deviations (below the mean, and above it where ``rises``) passes ``threshold``; the
    deviation is at least ``min_spread``. After a signal the statistics start again, from
    the signalling sample where ``reseed`` (a change of sizes: the new workload's first
    size) or from nothing.

    It runs for every finished request of the adaptive manager, so it is written with
    locals and comparisons in place of ``max`` (the same values as the formulas in the
    module docstring: ``tests/sim/test_shift.py`` checks them against the plain form).

    Invariants: ``n``, ``mean`` and ``m2`` are Welford's running count, mean and sum of
    squared deviations since the last signal; ``up`` and ``down`` are the cumulative
    excesses (both >= 0, ``up`` stays 0 unless ``rises``), zero until ``n`` reaches ``warmup``.
    """

    def __init__(self, delta: float, threshold: float, warmup: int, min_spread: float, *,
                 rises: bool, reseed: bool) -> None:
        self.delta, self.threshold, self.warmup = delta, threshold, warmup
        self.min_spread, self.rises, self.reseed = min_spread, rises, reseed
        self.changes = 0
        self._restart()

    def _restart(self) -> None:
        self.n = 0
        self.mean = self.m2 = 0.0
        self.up = self.down = 0.0

    def step(self, x: float) -> bool:
        """Add one sample; True when it completes a signal.

        Internal updates: the running statistics and the cumulative excesses."""
        n = self.n
        if n >= self.warmup:
            sd = math.sqrt(self.m2 / (n - 1))
            spread = self.min_spread
            z = (x - self.mean) / (sd if sd > spread else spread)
            down = self.down - z - self.delta
            self.down = down = down if down > 0.0 else 0.0
            up = 0.0
            if self.rises:
                up = self.up + z - self.delta
                self.up = up = up if up > 0.0 else 0.0
            if up > self.threshold or down > self.threshold:
                self.changes += 1
                self._restart()
                if self.reseed:
                    # Welford's update from the fresh state: the mean is this sample, m2 stays 0.
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


class ShiftDetector(PageHinkley):
    """Two-sided Page-Hinkley test on standardised log prompt lengths (module docstring)."""

    def __init__(self, delta: float = DELTA, threshold: float = THRESHOLD, warmup: int = WARMUP) -> None:
        if delta < 0 or threshold <= 0 or warmup < 2:
            raise ConfigError(f"ShiftDetector needs delta >= 0, threshold > 0 and warmup >= 2; "
                              f"got delta={delta}, threshold={threshold}, warmup={warmup}")
        super().__init__(delta, threshold, warmup, MIN_SPREAD, rises=True, reseed=True)

    def add(self, prompt_tokens: int) -> bool:
        """Count one request's prompt; True when it completes a change (the test then
        starts again, learning the new workload's sizes from this request on)."""
        return self.step(math.log(prompt_tokens) if prompt_tokens > 1 else 0.0)


#: Requests averaged into one sample of :class:`DropDetector` (a request's hit fraction is
#: nearly 0 or nearly 1; the mean of a few is a level that can be tested).
DROP_BLOCK = 8
#: The cumulative excess, in the block means' own deviations, that signals a drop: a
#: sustained fall of one deviation is flagged after ``DROP_THRESHOLD / (1 - DELTA)`` = 20
#: blocks, 160 requests.
DROP_THRESHOLD = 10.0
#: Blocks the level and its deviation are learned from before the test runs.
DROP_WARMUP = 8
#: The least deviation assumed for a block mean (a fraction of the prompt).
MIN_DROP_SPREAD = 0.02


class DropDetector(PageHinkley):
    """One-sided Page-Hinkley test for a fall of the live cache's hit fraction.

    Why: the shadows compare the candidates during an exploration and then run within the
    budget, which the exploration's work leaves in debt for thousands of requests. A
    setting that led while the shadows watched can fall behind later, as a workload's
    sessions grow (agent at 4 GiB: ``checkpoints-3x`` 0.90 per quarter, then 0.83 and 0.78,
    while ``checkpoints-none`` stays at 0.90), and nothing would show it. A sustained fall of
    what the live cache saves is the live signal that the setting in force may be losing;
    the adaptive manager then explores again (:meth:`AdaptiveManager._after_shift`). A rise
    (the cache warming up) is not tested.

    Each sample is the mean hit fraction (hit tokens / prompt tokens) of ``DROP_BLOCK``
    finished requests; ``pending`` holds the current block's fractions (fewer than
    ``DROP_BLOCK``). After a signal the test starts from nothing.
    """

    def __init__(self) -> None:
        super().__init__(DELTA, DROP_THRESHOLD, DROP_WARMUP, MIN_DROP_SPREAD, rises=False, reseed=False)
        self.pending: list[float] = []

    def add(self, fraction: float) -> bool:
        """Count one finished request's hit fraction; True when it completes a drop.

        Internal updates: the current block, then (once it is full) the test's statistics."""
        pending = self.pending
        pending.append(fraction)
        if len(pending) < DROP_BLOCK:
            return False
        x = sum(pending) / DROP_BLOCK
        pending.clear()
        return self.step(x)
