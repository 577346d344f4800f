"""Serve requests with the reference model through :class:`HybridCacheManager`.

One request's life (``docs/reference-model.md`` walks through it):

1. ``add_request`` hashes the prompt; just before the first step ``match`` says how many
   tokens are cached (KV in every attention layer *and* a state snapshot).
2. First ``allocate``: the hit's pages join the block table, a private running slot is
   handed out with a copy plan snapshot -> running slot, which :meth:`ArenaStorage.copy_slots`
   runs before anything is computed (or the slot is zeroed on a miss).
3. Chunked prefill from the hit point; every chunk's save points (hash-unit boundaries the
   admission policy wants, possibly inside the chunk) receive the KDA state at that token.
   ``commit`` registers full units and the saved snapshots.
4. Decode: one token per step, or with speculative decoding 1 + k inputs (the last token
   plus k n-gram drafts) verified in one pass whose per-position states land in the draft
   slots; ``accept`` keeps the state after the last accepted input and rolls back the rest.
5. ``free``: the turn-end snapshot (the state at the last unit boundary of prompt + reply)
   is registered for the next turn of the session.

If the arena cannot hold a step (``OutOfSpaceError``) the request is preempted: freed
without registering its turn end, and restarted later from its prompt (its committed units
and snapshots may then hit).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hybridcache.errors import CapacityError, OutOfSpaceError
from hybridcache.kernels.storage import ArenaStorage
from hybridcache.manager import Allocation, HybridCacheManager

from .config import ATTN_GROUP
from .model import PagedContext, ReferenceModel
from .workload import Session

MUTATIONS = ("skip-copy", "zero-state")


@dataclass(frozen=True)
class RunnerConfig:
    """How the runner schedules and decodes.

    Args:
        prefill_chunk: tokens per prefill step (need not be a multiple of the hash unit).
        max_live: requests served concurrently (round robin, one step each per round).
        spec_decode: verify n-gram drafts (exercises ``accept`` and roll-back).
        num_draft: drafts per speculative step; ngram: longest n-gram the drafter matches.
        tenant_per_request: salt every request into its own tenant, so nothing is shared
            (with admission ``none`` this is "caching disabled").
        mutation: TEST ONLY. ``skip-copy`` skips the copy plan, ``zero-state`` zeroes the
            running slot instead of restoring the snapshot (a KV hit used without its
            state). Both must make the check fail; see ``tests/reference``.
    """

    prefill_chunk: int = 64
    max_live: int = 4
    spec_decode: bool = False
    num_draft: int = 3
    ngram: int = 2
    tenant_per_request: bool = False
    mutation: str | None = None

    def __post_init__(self) -> None:
        if self.prefill_chunk <= 0 or self.max_live <= 0 or self.num_draft < 0 or self.ngram <= 0:
            raise ValueError("prefill_chunk, max_live and ngram must be positive, num_draft >= 0")
        if self.mutation is not None and self.mutation not in MUTATIONS:
            raise ValueError(f"mutation must be one of {MUTATIONS} or None")


@dataclass
class RequestResult:
    """What one finished request produced: per generated token its id and logits row;
    ``history`` is prompt + reply (the next turn's prompt starts with it)."""

    rid: str
    prompt_len: int
    hit_tokens: int
    tokens: list[int]
    logits: torch.Tensor
    history: list[int]


@dataclass
class RunStats:
    """Counters of one serving run.

    ``prefill_s`` / ``prefill_cpu_s``: wall and process CPU time of prefill steps (snapshot
    copies included); CPU time is the steadier figure on a shared machine.
    """

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    prefill_cpu_s: float = 0.0
    decode_s: float = 0.0
    copies: int = 0
    preemptions: int = 0
    spec_steps: int = 0
    spec_fallbacks: int = 0
    drafted: int = 0
    accepted: int = 0


@dataclass
class _Live:
    rid: str
    prompt: list[int]
    max_new: int
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    computed: int = 0
    hit: int = 0
    allocated: bool = False

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt)


def ngram_draft(tokens: list[int], max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last n-gram.

    Tries n = ``max_n`` down to 1; returns ``[]`` when no n-gram repeats (then the step is
    an ordinary decode step).
    """
    if k <= 0:
        return []
    L = len(tokens)
    for n in range(min(max_n, L - 1), 0, -1):
        tail = tokens[L - n :]
        for i in range(L - n - 1, -1, -1):
            if tokens[i : i + n] == tail:
                return tokens[i + n : i + n + k]
    return []


class Runner:
    """Greedy serving loop over a manager, its arena storage and the reference model."""

    def __init__(
        self,
        model: ReferenceModel,
        manager: HybridCacheManager,
        storage: ArenaStorage,
        config: RunnerConfig | None = None,
    ) -> None:
        self.model = model
        self.manager = manager
        self.storage = storage
        self.config = config or RunnerConfig()
        self.stats = RunStats()
        self._waiting: deque[_Live] = deque()
        self._live: list[_Live] = []
        self._blocked = False
        #: Called with each request id right after ``add_request``, before its first
        #: ``allocate`` (e.g. an offload coordinator's ``prefetch``, which loads a prefix
        #: from a lower tier so that the manager's match hits it).
        self.on_admit: Callable[[str], object] | None = None

    # ------------------------------------------------------------------ serving
    def serve(self, sessions: list[Session]) -> dict[str, RequestResult]:
        """Serve every turn of every session; a session's next turn is queued when its
        previous turn finishes, with the whole history as its prompt."""
        results: dict[str, RequestResult] = {}
        progress = {s.sid: 0 for s in sessions}
        by_id = {s.sid: s for s in sessions}
        history = {s.sid: list(s.prefix) for s in sessions}
        for s in sessions:
            self._queue_turn(s, history[s.sid], 0)
        while self._waiting or self._live:
            for res in self.step():
                results[res.rid] = res
                sid = res.rid.rsplit("/", 1)[0]
                sess = by_id[sid]
                history[sid] = list(res.history)
                progress[sid] += 1
                if progress[sid] < len(sess.turns):
                    self._queue_turn(sess, history[sid], progress[sid])
        return results

    def _queue_turn(self, sess: Session, history: list[int], j: int) -> None:
        turn = sess.turns[j]
        prompt = history + list(turn.user)
        self.submit(f"{sess.sid}/t{j}", prompt, turn.max_new)

    def submit(self, rid: str, prompt: list[int], max_new: int) -> None:
        """Queue one request (served by :meth:`step`)."""
        if not prompt or max_new <= 0:
            raise ValueError("a request needs a prompt and max_new > 0")
        self._waiting.append(_Live(rid, list(prompt), max_new, tokens=list(prompt)))

    def step(self) -> list[RequestResult]:
        """Admit waiting requests, then advance every live request by one step."""
        while self._waiting and len(self._live) < self.config.max_live and not self._blocked:
            r = self._waiting.popleft()
            tenant = r.rid if self.config.tenant_per_request else None
            self.manager.add_request(r.rid, r.prompt, tenant=tenant)
            if self.on_admit is not None:
                self.on_admit(r.rid)
            self._live.append(r)
        done: list[RequestResult] = []
        for r in list(self._live):
            try:
                finished = self._advance(r)
            except OutOfSpaceError:
                self._preempt(r)
                continue
            if finished:
                self.manager.free(r.rid, finished=True)
                self._live.remove(r)
                self._blocked = False
                done.append(self._result(r))
        return done

    def _result(self, r: _Live) -> RequestResult:
        s = self.stats
        s.requests += 1
        s.prompt_tokens += len(r.prompt)
        s.hit_tokens += r.hit
        return RequestResult(
            r.rid,
            len(r.prompt),
            r.hit,
            r.tokens[len(r.prompt) :],
            torch.stack(r.logits),
            list(r.tokens),
        )

    def _preempt(self, r: _Live) -> None:
        """Free a request that cannot get memory and queue it again from its prompt."""
        if len(self._live) == 1:
            raise CapacityError(
                f"request {r.rid!r} ({len(r.tokens)} tokens) does not fit in the arena alone; "
                "raise the capacity"
            )
        self.manager.free(r.rid, finished=False)
        self._live.remove(r)
        self._waiting.appendleft(_Live(r.rid, r.prompt, r.max_new, tokens=list(r.prompt)))
        self._blocked = True
        self.stats.preemptions += 1

    # ------------------------------------------------------------------ one step
    def _advance(self, r: _Live) -> bool:
        """One prefill chunk or one decode step; True when the request is finished."""
        if r.computed < len(r.prompt) or not r.allocated:
            t0, c0 = time.perf_counter(), time.process_time()
            self._prefill_chunk(r)
            self.stats.prefill_s += time.perf_counter() - t0
            self.stats.prefill_cpu_s += time.process_time() - c0
        else:
            t0 = time.perf_counter()
            self._decode(r)
            self.stats.decode_s += time.perf_counter() - t0
        return r.generated >= r.max_new

    def _first_allocation(self, r: _Live, a: Allocation) -> None:
        """Prepare the running slot: zero it on a miss, restore the snapshot on a hit."""
        r.allocated = True
        r.hit = a.hit_tokens
        mut = self.config.mutation
        if a.init_state or mut == "zero-state":
            self.storage.zero_slot(a.running_slot)
        elif mut != "skip-copy":
            self.stats.copies += self.storage.copy_slots(a.state_copies)

    def _context(self, a: Allocation, extra: dict[int, list[int]] | None = None) -> PagedContext:
        emit: dict[int, list[int]] = {}
        for sp in a.save_points:
            emit.setdefault(sp.boundary, []).append(sp.slot)
        for b, slots in (extra or {}).items():
            emit.setdefault(b, []).extend(slots)
        pages = a.block_table.get(ATTN_GROUP, [])
        return PagedContext(self.storage, a.start, a.num_tokens, pages, a.running_slot, emit)

    def _prefill_chunk(self, r: _Live) -> None:
        start = r.computed if r.allocated else self.manager.match(r.rid).hit_tokens
        n = min(self.config.prefill_chunk, len(r.prompt) - start)
        a = self.manager.allocate(r.rid, n)
        if a.start != start:
            raise AssertionError(f"manager started at {a.start}, match said {start}")
        if not r.allocated:
            self._first_allocation(r, a)
        logits = self.model.forward(r.prompt[start : start + n], start, self._context(a))
        end = start + n
        self.stats.prefill_tokens += n
        if end == len(r.prompt):
            self._emit_tokens(r, logits[-1:])
        self.manager.commit(r.rid, end)
        r.computed = end

    def _emit_tokens(self, r: _Live, logits: torch.Tensor) -> list[int]:
        """Greedy tokens from ``logits`` rows: recorded, appended here and in the manager."""
        new = logits.argmax(-1).tolist()
        r.logits.extend(logits.clone())
        r.tokens.extend(new)
        self.manager.append_tokens(r.rid, new)
        return new

    def _decode(self, r: _Live) -> None:
        """One decode step: the last token plus (speculative decoding) verified drafts."""
        cfg = self.config
        p = r.computed
        drafts: list[int] = []
        if cfg.spec_decode:
            room = r.max_new - r.generated - 1
            drafts = ngram_draft(r.tokens, cfg.ngram, min(cfg.num_draft, room))
        try:
            a = self.manager.allocate(r.rid, 1 + len(drafts), num_draft=len(drafts))
        except OutOfSpaceError:
            if not drafts:
                raise
            drafts = []  # draft slots do not fit: decode plainly (allocate changed nothing)
            self.stats.spec_fallbacks += 1
            a = self.manager.allocate(r.rid, 1)
        extra = {p + i + 1: [s] for i, s in enumerate(a.draft_slots)}
        logits = self.model.forward([r.tokens[p]] + drafts, p, self._context(a, extra))
        if not drafts:
            self._emit_tokens(r, logits)
            self.manager.commit(r.rid, p + 1)
            r.computed = p + 1
            return
        target = logits.argmax(-1).tolist()
        acc = 0
        while acc < len(drafts) and drafts[acc] == target[acc]:
            acc += 1
        self.manager.accept(r.rid, 1 + acc)
        self._emit_tokens(r, logits[: acc + 1])
        self.manager.commit(r.rid, p + 1 + acc)
        r.computed = p + 1 + acc
        s = self.stats
        s.spec_steps += 1
        s.drafted += len(drafts)
        s.accepted += acc
