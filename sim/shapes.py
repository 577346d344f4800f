"""Workload shapes: the generator's sizes, counts and rates, scaled, for held-out testing.

Why: every generated trace the policies were developed on has the same shapes (chat system
prompts of 600-1,800 tokens, twelve documents of 6k-24k tokens per tenant with Zipf 1.1
popularity, agent steps every 4 s on average, ...). Seeds change which requests come, not
how long prompts are or how skewed reuse is, so a mechanism tuned to those shapes would
look general on every seed. A :class:`Shape` scales them: :meth:`Shape.draw` gives a
random one from a seed, and a sweep over drawn shapes holds a policy to workloads whose
proportions nobody looked at (``benchmarks/sweep_adaptive.py --shapes``).

The default shape changes nothing: ``generate(kind, n, seed)`` and ``generate(kind, n,
seed, shape=Shape())`` give the same trace, request for request (the shape draws nothing
from the trace's generator).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from hybridcache.validation import integer_at_least, number_at_least

#: How far :meth:`Shape.draw` scales each factor, up or down (log-uniform): lengths by up
#: to 4x, turns by up to 2x (a session's context grows with both), the arrival rate by up
#: to 4x (how many sessions interleave), the documents per tenant between 3 and 48, and the
#: popularity exponent between 0.6 (nearly flat) and 1.6 (a few documents take most).
LENGTH_SPAN = 4.0
TURN_SPAN = 2.0
PACE_SPAN = 4.0
DOCS_RANGE = (3, 48)
SKEW_RANGE = (0.6, 1.6)


@dataclass(frozen=True)
class Shape:
    """Multipliers on the generator's shapes (1.0 and the defaults: the shapes as built).

    Attributes:
        prefix: shared prefixes: system prompts, tool preambles, documents, the agentic
            harness prompts and the files a context starts with.
        message: what a turn appends: user messages, questions, tool results.
        output: output lengths.
        turns: turns per chat or agent session, steps per agentic session.
        pace: session arrivals per second (more sessions interleave at a time).
        docs: documents per tenant.
        skew: the Zipf exponent of document popularity.
    """

    prefix: float = 1.0
    message: float = 1.0
    output: float = 1.0
    turns: float = 1.0
    pace: float = 1.0
    docs: int = 12
    skew: float = 1.1

    def __post_init__(self) -> None:
        if integer_at_least(self.docs, 1) is None:
            raise ValueError(f"shape docs must be an int >= 1, got {self.docs!r}")
        if number_at_least(self.skew, 0.0) is None:
            raise ValueError(f"shape skew must be a finite number >= 0, got {self.skew!r}")
        for name in ("prefix", "message", "output", "turns", "pace"):
            v = getattr(self, name)
            if number_at_least(v, 0.0, strict=True) is None:
                raise ValueError(f"shape {name} must be a finite number > 0, got {v!r}")

    @classmethod
    def draw(cls, seed: int) -> Shape:
        """A random shape: each length factor log-uniform in [1/4, 4], turns in [1/2, 2],
        pace in [1/4, 4], documents uniform in 3-48, skew uniform in 0.6-1.6."""
        rng = np.random.default_rng([0x5A4E, seed])

        def log_uniform(span: float) -> float:
            return round(float(math.exp(rng.uniform(-math.log(span), math.log(span)))), 3)

        return cls(prefix=log_uniform(LENGTH_SPAN), message=log_uniform(LENGTH_SPAN),
                   output=log_uniform(LENGTH_SPAN), turns=log_uniform(TURN_SPAN),
                   pace=log_uniform(PACE_SPAN), docs=int(rng.integers(DOCS_RANGE[0], DOCS_RANGE[1] + 1)),
                   skew=round(float(rng.uniform(*SKEW_RANGE)), 3))

    def label(self) -> str:
        """A compact name for tables: the factors that differ from the default."""
        base = Shape()
        parts = [f"{f.name}={getattr(self, f.name):g}" for f in fields(self)
                 if getattr(self, f.name) != getattr(base, f.name)]
        return ",".join(parts) or "default"


def scaled(lo: int, hi: int, factor: float) -> tuple[int, int]:
    """The range ``lo..hi`` scaled by ``factor``, at least 1 and ``hi >= lo`` (identity at 1)."""
    if factor == 1.0:
        return lo, hi
    a = max(1, round(lo * factor))
    return a, max(a, round(hi * factor))
