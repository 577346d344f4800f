"""The ``agentic`` generator kind: long-context coding-agent sessions.

What such a trace looks like (the statistics of the issue this kind was built for):

- a context starts with the tenant's harness prompt (system prompt and tool schemas,
  shared by every session of the tenant) and the files the agent reads first, 50k tokens or
  so, and grows by small appends (a tool result and the model's short output per step) up to
  about 250k tokens;
- about 93% of requests extend the previous prompt of their context verbatim; the others
  start a context: a new session, a *sub-agent* (its own harness prompt and task, a few
  steps, then its result is appended to the parent's context), or a *compaction* (the agent
  summarises and drops most of its context, then re-reads a few files);
- think times between steps are log-normal with p50 10 s and p90 160 s (tool runs, user
  replies; a long tail).

A context's tokens live in one preallocated buffer and every prompt is a view of its prefix
(a verbatim extension is exactly a longer view), so a trace of 100k-token prompts costs
memory once per context, not once per request.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from hybridcache.sim.generate import VOCAB, _Gen, _Session
from hybridcache.sim.shapes import scaled
from hybridcache.sim.traces import TraceRequest

#: Log-normal think time: median 10 s, p90 160 s (z(0.9) = 1.2816), capped at an hour.
THINK_MEDIAN_S = 10.0
THINK_SIGMA = math.log(160.0 / 10.0) / 1.2816
THINK_CAP_S = 3600.0
CONTEXT_MAX = 250_000
#: Per main step: chance that the agent hands a task to a sub-agent / compacts early.
SUBAGENT_P = 0.08
COMPACT_P = 0.006
#: An early compaction happens only once the context is this long (it drops most of it).
COMPACT_EARLY_FROM = 100_000


class _Context:
    """One growing token sequence (a main agent's or a sub-agent's), in one buffer."""

    def __init__(self, g: _Gen, head: np.ndarray, sid: str) -> None:
        self.g, self.sid = g, sid
        # Room for the longest context the shape allows and a step past it (a head longer
        # than that, from a large shape, gets its own room: the next step compacts it).
        size = max(len(head), round(CONTEXT_MAX * max(1.0, g.shape.prefix))) + round(40_000 * _grow(g))
        self.buf = np.empty(size, dtype=np.uint32)
        self.n = 0
        self.push(head)

    def push(self, tokens: np.ndarray) -> None:
        self.buf[self.n : self.n + len(tokens)] = tokens
        self.n += len(tokens)

    def room(self) -> int:
        return len(self.buf) - self.n

    def step(self, tenant: str, t: float, append: int, out: int) -> TraceRequest:
        """A request whose prompt is this context plus ``append`` new tokens; its output
        (``out`` tokens) joins the context, as the next prompt sends it back."""
        g = self.g
        self.push(g.rng.integers(1, VOCAB, size=append, dtype=np.uint32))
        prompt = self.buf[: self.n]
        self.push(g.rng.integers(1, VOCAB, size=out, dtype=np.uint32))
        return TraceRequest(
            timestamp=t, input_length=len(prompt), output_length=out, tenant=tenant,
            session_id=self.sid, input_ids=prompt, output_ids=self.buf[len(prompt) : self.n],
        )


def _grow(g: _Gen) -> float:
    """The most a shape scales one step's tokens (an append and an output)."""
    return max(1.0, g.shape.message, g.shape.output)


def think(g: _Gen) -> float:
    return min(THINK_CAP_S, float(g.rng.lognormal(math.log(THINK_MEDIAN_S), THINK_SIGMA)))


def _tool_result(g: _Gen) -> int:
    """Tokens a step appends: a tool result or a user message (median ~400, long tail;
    scaled by the shape's ``message``)."""
    m = g.shape.message
    return int(min(8000 * m, max(20 * m, g.rng.lognormal(math.log(400.0 * m), 1.0))))


def _output(g: _Gen) -> int:
    return g.count(30, 399, g.shape.output)


def _session(g: _Gen, tenant: str, harness: np.ndarray, sub_harness: np.ndarray,
             sid: str, start: float) -> Iterator[TraceRequest]:
    """One agent session: main steps, sub-agents in between, compaction when it is long."""
    sh = g.shape
    steps = g.count(40, 239, sh.turns)
    t = start
    ctx = _Context(g, np.concatenate([harness, g.tokens(*scaled(30_000, 50_000, sh.prefix))]), sid)
    n_sub = n_compact = 0
    for _ in range(steps):
        append, out = _tool_result(g), _output(g)
        limit = g.count(150_000, CONTEXT_MAX - 1, sh.prefix)
        early = ctx.n > COMPACT_EARLY_FROM * sh.prefix and g.rng.random() < COMPACT_P
        # (room for at least a step: a shape's long appends can need more than 20k)
        if ctx.n + append + out > limit or early or ctx.room() < max(20_000, append + out):
            # Compaction: a summary and a few files re-read replace the context.
            n_compact += 1
            head = np.concatenate([harness, g.tokens(*scaled(2_000, 8_000, sh.prefix)),
                                   g.tokens(*scaled(20_000, 40_000, sh.prefix))])
            ctx = _Context(g, head, f"{sid}/c{n_compact}")
        yield ctx.step(tenant, t, append, out)
        t += think(g) + 1.0
        if g.rng.random() < SUBAGENT_P:
            n_sub += 1
            sub = _Context(g, np.concatenate([sub_harness, g.tokens(*scaled(500, 3_000, sh.prefix))]),
                           f"{sid}/s{n_sub}")
            for _ in range(g.count(3, 10, sh.turns)):
                if sub.room() < 20_000:
                    break
                append, out = _tool_result(g), _output(g)
                if sub.room() < append + out:
                    break
                yield sub.step(tenant, t, append, out)
                t += think(g) + 1.0
            # The sub-agent's result comes back to the parent as the next step's append.


def agentic_sessions(g: _Gen, rate: float) -> Iterator[_Session]:
    """Sessions arriving at ``rate`` per second (each carries its own request stream)."""
    sh = g.shape
    harness = {t: g.tokens(*scaled(8_000, 16_000, sh.prefix)) for t in g.tenants}
    sub_harness = {t: g.tokens(*scaled(3_000, 6_000, sh.prefix)) for t in g.tenants}
    t = 0.0
    while True:
        t += float(g.rng.exponential(1.0 / (rate * sh.pace)))
        tenant = g.tenant()
        sid = g.sid("agentic")
        stream = _session(g, tenant, harness[tenant], sub_harness[tenant], sid, t)
        yield _Session(tenant, sid, harness[tenant], 0, (0, 0), (0, 0), 0.0, t, stream)
