"""Seeded synthetic token-level workloads: chat, agent, shared documents, and a mix.

Each kind reproduces one reuse pattern that decides how a hybrid cache performs:

- ``chat``: multi-turn sessions; every turn's prompt is the whole history (a tenant's system
  prompt, earlier turns and their outputs) plus a short new message. Reuse is a growing
  prefix: the state at the previous turn's end is what the next turn needs.
- ``agent``: long tool-laden system prompts shared by every session of a tenant, then many
  short steps that append tool results. Reuse at the shared system prompt (a branch point)
  and along each session.
- ``docs``: long shared documents (Zipf popularity) each asked several different questions
  in single-turn requests. Reuse ends inside the prompt, at the document's end: only a
  state saved there (or close before it) makes the KV usable.
- ``mixed``: the three together, interleaved in time.
- ``agentic``: long-context coding-agent sessions (:mod:`hybridcache.sim.agentic`): contexts
  of 50k to 250k tokens that nearly always extend the previous prompt verbatim by a small
  append, heavy-tailed think times, sub-agents with their own contexts, and compaction that
  drops most of a context now and then.

Tenants have their own system prompts and documents; the same text in two tenants is never
shared by the cache (tenant salts), which the per-tenant hit rates show. Everything derives
from one ``numpy`` generator seeded with ``seed``: the same arguments give the same trace.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from hybridcache.sim.shapes import Shape, scaled
from hybridcache.sim.traces import TraceRequest
from hybridcache.validation import integer_at_least

KINDS = ("chat", "agent", "docs", "mixed", "agentic")
VOCAB = 32_000


@dataclass
class _Session:
    """A generator of one session's requests, consumed in timestamp order."""

    tenant: str
    session_id: str
    prefix: np.ndarray  # the shared part every turn starts with
    turns: int
    msg: tuple[int, int]  # user message / tool result length range
    out: tuple[int, int]  # output length range
    think: float  # mean seconds between turns
    start: float
    #: A session with its own request pattern (agentic) supplies its requests directly.
    stream: Iterator[TraceRequest] | None = None


class _Gen:
    def __init__(self, seed: int, tenants: int, shape: Shape | None = None) -> None:
        self.rng = np.random.default_rng(seed)
        self.tenants = [f"tenant{i}" for i in range(max(1, tenants))]
        self.n_sessions = 0
        self.shape = shape or Shape()

    def count(self, lo: int, hi: int, factor: float) -> int:
        """A count drawn from ``lo..hi`` (both included), the range scaled by ``factor``."""
        a, b = scaled(lo, hi, factor)
        return int(self.rng.integers(a, b + 1))

    def tokens(self, lo: int, hi: int | None = None) -> np.ndarray:
        n = lo if hi is None else int(self.rng.integers(lo, hi + 1))
        return self.rng.integers(1, VOCAB, size=n, dtype=np.uint32)

    def tenant(self) -> str:
        return self.tenants[int(self.rng.integers(len(self.tenants)))]

    def sid(self, kind: str) -> str:
        self.n_sessions += 1
        return f"{kind}-{self.n_sessions}"


def _chat_sessions(g: _Gen, rate: float) -> Iterator[_Session]:
    sh = g.shape
    system = {t: g.tokens(*scaled(600, 1800, sh.prefix)) for t in g.tenants}
    msg, out = scaled(40, 400, sh.message), scaled(80, 500, sh.output)
    t = 0.0
    while True:
        t += float(g.rng.exponential(1.0 / (rate * sh.pace)))
        tenant = g.tenant()
        turns = g.count(2, 8, sh.turns)
        yield _Session(tenant, g.sid("chat"), system[tenant], turns, msg, out, 20.0, t)


def _agent_sessions(g: _Gen, rate: float) -> Iterator[_Session]:
    sh = g.shape
    tools = {t: g.tokens(*scaled(3000, 7000, sh.prefix)) for t in g.tenants}
    msg, out = scaled(150, 1500, sh.message), scaled(30, 200, sh.output)
    t = 0.0
    while True:
        t += float(g.rng.exponential(1.0 / (rate * sh.pace)))
        tenant = g.tenant()
        task = np.concatenate([tools[tenant], g.tokens(*scaled(100, 600, sh.prefix))])
        turns = g.count(4, 15, sh.turns)
        yield _Session(tenant, g.sid("agent"), task, turns, msg, out, 4.0, t)


def _docs_sessions(g: _Gen, rate: float) -> Iterator[_Session]:
    sh = g.shape
    n_docs = sh.docs
    docs = {t: [g.tokens(*scaled(6000, 24000, sh.prefix)) for _ in range(n_docs)] for t in g.tenants}
    pop = 1.0 / np.arange(1, n_docs + 1) ** sh.skew
    pop /= pop.sum()
    msg, out = scaled(20, 200, sh.message), scaled(50, 300, sh.output)
    t = 0.0
    while True:
        t += float(g.rng.exponential(1.0 / (rate * sh.pace)))
        tenant = g.tenant()
        doc = docs[tenant][int(g.rng.choice(n_docs, p=pop))]
        yield _Session(tenant, g.sid("docs"), doc, 1, msg, out, 0.0, t)


def _session_requests(g: _Gen, s: _Session) -> Iterator[TraceRequest]:
    if s.stream is not None:
        yield from s.stream
        return
    history = s.prefix
    t = s.start
    for _ in range(s.turns):
        prompt = np.concatenate([history, g.tokens(*s.msg)])
        out = g.tokens(*s.out)
        yield TraceRequest(
            timestamp=t, input_length=len(prompt), output_length=len(out), tenant=s.tenant,
            session_id=s.session_id, input_ids=prompt, output_ids=out,
        )
        history = np.concatenate([prompt, out])
        t += float(g.rng.exponential(s.think)) + 1.0


def _check_args(kind: str, requests: object, seed: object, tenants: object) -> None:
    """Refuse what :func:`generate` cannot honour, naming the argument."""
    if kind not in KINDS:
        raise ValueError(f"unknown workload kind {kind!r}; known: {', '.join(KINDS)}")
    for name, value, least in (("requests", requests, 1), ("seed", seed, 0), ("tenants", tenants, 1)):
        if integer_at_least(value, least) is None:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def generate(kind: str, requests: int, seed: int = 0, tenants: int = 2,
             shape: Shape | None = None) -> list[TraceRequest]:
    """``requests`` requests of workload ``kind``, in timestamp order (see module docstring).

    ``shape`` scales the kind's lengths, counts and rates (:mod:`hybridcache.sim.shapes`:
    held-out workloads); the default shape gives the kinds as built.

    Raises:
        ValueError: unknown kind, or a count, seed or tenant count that is not an int of at
            least 1, 0 and 1 (a tenant count of 0 gave one tenant, and 5.5 requests six),
            or a shape that is not a :class:`Shape`.
    """
    from hybridcache.sim.agentic import agentic_sessions  # it builds on _Gen and _Session

    _check_args(kind, requests, seed, tenants)
    if shape is not None and not isinstance(shape, Shape):
        raise ValueError(f"shape must be a Shape, got {shape!r}")
    g = _Gen(seed, tenants, shape)
    sources = {
        "chat": [_chat_sessions(g, 0.5)],
        "agent": [_agent_sessions(g, 0.3)],
        "docs": [_docs_sessions(g, 1.0)],
        "mixed": [_chat_sessions(g, 0.3), _agent_sessions(g, 0.1), _docs_sessions(g, 0.3)],
        "agentic": [agentic_sessions(g, 1.0 / 1800)],
    }[kind]
    # Merge sessions (each a timestamp-ordered stream) by the time of their next request.
    heap: list[tuple[float, int, Iterator[TraceRequest], TraceRequest]] = []
    seq = 0
    pending = [next(src) for src in sources]
    out: list[TraceRequest] = []
    while len(out) < requests:
        # Open every session that starts before the earliest pending request.
        i = min(range(len(pending)), key=lambda k: pending[k].start)
        if not heap or pending[i].start <= heap[0][0]:
            stream = _session_requests(g, pending[i])
            first = next(stream)
            heapq.heappush(heap, (first.timestamp, seq, stream, first))
            seq += 1
            pending[i] = next(sources[i])
            continue
        _, _, stream, req = heapq.heappop(heap)
        out.append(req)
        nxt = next(stream, None)
        if nxt is not None:
            heapq.heappush(heap, (nxt.timestamp, seq, stream, nxt))
            seq += 1
    return out


def generate_change(first: str, second: str, requests: tuple[int, int], seed: int = 0,
                    tenants: int = 2) -> list[TraceRequest]:
    """A workload that changes kind: ``requests[0]`` requests of ``first``, then
    ``requests[1]`` of ``second`` after them in time and under other tenants (``b-``
    prefixed: nothing is reused across the change). What the adaptive policy's change
    detection is measured on (``benchmarks/sweep_shift.py``).

    Raises:
        ValueError: as :func:`generate`.
    """
    if not isinstance(requests, (tuple, list)) or len(requests) != 2:
        raise ValueError(f"requests must be two counts (before, after the change), got {requests!r}")
    _check_args(first, requests[0], seed, tenants)
    _check_args(second, requests[1], seed, tenants)  # both before any work
    a = generate(first, requests[0], seed=seed, tenants=tenants)
    b = generate(second, requests[1], seed=seed, tenants=tenants)
    for r in b:
        r.timestamp += a[-1].timestamp
        r.tenant = f"b-{r.tenant}"
    return a + b
