"""Sub-block tails: hits and states at hash-unit granularity inside vLLM's inflated block.

In ``align`` mode vLLM's attention block is inflated to one state page (1,152 tokens for a
tiny Qwen3-Next with 8 GDN value heads, thousands for real models), and the manager's
entries sit on block boundaries. A prompt shorter than one block would never hit. A
*tail* is the prefix of one block column up to a hash-unit boundary ``t`` inside it:

- its KV: a copy of the column's attention block(s), valid for positions ``< t`` (vLLM
  addresses KV by position, so the tokens of one column live in one block);
- its state: a copy of the running state block at ``t``.

Both are copies into free blocks of the manager's arena (so the manager never hands them
out), made through vLLM's
block-copy channel (``SchedulerOutput.kv_cache_block_copies``, applied by the worker before
``preprocess_mamba`` and the forward pass). A tail is never written: a request that hits it
gets private blocks that receive copies of the tail's blocks (copy-on-extend), exactly as
vLLM's own partial hits do.

Where tails are made (the scheduler ends a prefill chunk there, and the copies run in the
next step, before the request computes past ``t``): the prompt's last unit boundary, a
branch point (the deepest unit whose KV another tail holds, when no state is cached there),
and, while decoding, every unit boundary (only the newest of a request is kept: the turn
end the next turn resumes from). Tails live in memory nothing else wants: making one never
evicts the manager's entries, and before each of the manager's allocations tails are
evicted (least recently used) until the blocks it may need are free; they also hold at
most half of the pool.

Only the block column of the manager's own hit is extended (its snapshot and pages cover
everything before), so a tail never depends on an entry the manager may evict.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.request import Request

from hybridcache.hashing import MultiModalItem, TokenHasher
from hybridcache.port import EnginePort

from . import core_access


@dataclass(eq=False)
class Tail:
    """A cached column prefix ``[col * block, boundary)``: KV copies and one state slot."""

    boundary: int
    pages: tuple[int, ...]  # vLLM block per attention group
    slot: int  # manager arena slot (its vLLM blocks: one per Mamba group)
    units: tuple[bytes, ...]  # digests of the column's units, the last one ends at boundary
    ready: bool = False  # its copies have run (set when the next step starts)


@dataclass
class FineHit:
    """A tail that extends a request's block-level hit, and how deep KV matches on."""

    tail: Tail | None
    hit_tokens: int
    kv_tokens: int


@dataclass
class _Pending:
    """Copies queued in this step, and who they come from (cancelled if it is freed)."""

    rid: str
    copies: list[tuple[int, int]]
    tail: Tail | None = None  # the tail these copies make
    source: Tail | None = None  # the tail these copies read (a restore)
    emitted: bool = False  # handed to the scheduler (then they run in this step)


@dataclass
class TailCache:
    """Tails of one vLLM engine (see module docstring).

    Args:
        manager: the port over the core whose arena the tails' blocks come from.
        unit: the hash unit (vLLM's ``--prefix-match-unit``).
        block: vLLM's block size (a multiple of ``unit``).
        state_blocks: vLLM block ids of a manager slot, one per Mamba group.
        max_blocks: most vLLM blocks tails may hold together.
    """

    manager: EnginePort
    unit: int
    block: int
    state_blocks: Callable[[int], list[int]]
    max_blocks: int
    by_key: dict[bytes, Tail] = field(default_factory=dict)
    kv: dict[bytes, Tail] = field(default_factory=dict)
    lru: OrderedDict[Tail, None] = field(default_factory=OrderedDict)
    hashers: dict[str, TokenHasher] = field(default_factory=dict)
    saves: dict[str, set[int]] = field(default_factory=dict)
    rolling: dict[str, Tail] = field(default_factory=dict)
    planned: dict[bytes, str] = field(default_factory=dict)  # branch point digest -> maker
    offered: dict[str, Tail] = field(default_factory=dict)  # hits told to vLLM, this step
    pending: list[_Pending] = field(default_factory=list)
    made: int = 0
    restored: int = 0
    evicted: int = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, rid: str, tokens: Sequence[int], tenant: str | None,
                    lora: str | None, mm: Sequence[MultiModalItem]) -> None:
        cfg = self.manager.config
        hasher = TokenHasher(self.unit, cfg.hash_algo, cfg.hash_seed, tenant, lora, mm)
        hasher.extend(list(tokens))
        self.hashers[rid] = hasher

    def append(self, rid: str, tokens: Sequence[int]) -> None:
        self.hashers[rid].extend(list(tokens))

    def forget(self, rid: str) -> None:
        """``rid`` is freed: drop its hasher and plans, and copies of its blocks not yet
        handed to the worker (its blocks may be handed out again in this very step)."""
        self.hashers.pop(rid, None)
        self.saves.pop(rid, None)
        self.rolling.pop(rid, None)
        self.offered.pop(rid, None)
        self._unplan(rid)
        for p in [p for p in self.pending if p.rid == rid and not p.emitted]:
            self.pending.remove(p)
            if p.tail is not None:
                self._drop(p.tail)

    # ------------------------------------------------------------------ lookups
    def lookup(self, rid: str, num_tokens: int, base: int) -> FineHit:
        """The deepest ready tail in the column of the block-level hit ``base``.

        A hit leaves at least one prompt token to compute (vLLM needs logits), so it ends
        at or before ``num_tokens - 1``.
        """
        digests = self.hashers[rid].digests
        first = base // self.unit
        last = min((base + self.block) // self.unit, (num_tokens - 1) // self.unit, len(digests))
        best: Tail | None = None
        kv_units = first
        for u in range(first, last):
            d = digests[u]
            if d not in self.kv:
                break
            kv_units = u + 1
            tail = self.by_key.get(d)
            if tail is not None and tail.ready and (u + 1) * self.unit % self.block:
                best = tail
        hit = best.boundary if best is not None else base
        if best is not None:  # vLLM adopts it now and allocates next: keep it until then
            self.offered[rid] = best
        return FineHit(best, hit, kv_units * self.unit)

    def pending_deeper(self, rid: str, num_tokens: int, hit: int) -> bool:
        """Whether a tail being made lies deeper on ``rid``'s path than ``hit``.

        Being made: its copies run in this step, or another running request will end a
        chunk at that branch point. Like vLLM's own same-step rule, the request then waits
        (a step, or until the branch point is computed) rather than recomputing it.
        """
        made = {p.tail.units[-1] for p in self.pending if p.tail is not None}
        made.update(d for d, maker in self.planned.items() if maker != rid)
        if not made:
            return False
        digests = self.hashers[rid].digests
        last = min((num_tokens - 1) // self.unit, len(digests))
        return any(d in made for d in digests[hit // self.unit : last])

    # ------------------------------------------------------------------ save points
    def plan(self, rid: str, prompt_len: int, hit: FineHit) -> None:
        """Save points of a request at its first allocation: prompt end and branch point."""
        points = set()
        tail_end = (prompt_len - 1) // self.unit * self.unit
        branch = hit.kv_tokens if hit.kv_tokens < tail_end else 0
        self._unplan(rid)
        for b in (tail_end, branch):
            if b > hit.hit_tokens and b % self.block:
                points.add(b)
                if b == branch:
                    self.planned.setdefault(self.hashers[rid].digests[b // self.unit - 1], rid)
        self.saves[rid] = points

    def _unplan(self, rid: str) -> None:
        for d in [d for d, maker in self.planned.items() if maker == rid]:
            del self.planned[d]

    def next_save(self, rid: str, start: int, end: int) -> int | None:
        inside = [b for b in self.saves.get(rid, ()) if start < b < end]
        return min(inside) if inside else None

    def computed(self, rid: str, n: int, prompt_len: int, kv_blocks: Sequence[int],
                 state_blocks: Sequence[int], *, make_tail: bool = True) -> None:
        """The worker has computed ``n`` tokens of ``rid``; make a tail at ``n`` if wanted.

        ``kv_blocks`` / ``state_blocks``: the request's blocks of the column holding ``n``;
        ``make_tail=False``: no block holds the whole state at ``n`` (a speculative step's,
        see :meth:`.spec_decode.SpecDecodeKVCacheManager._tell_tails`), only pass saves.
        In decode every unit boundary inside a block is taken, replacing the request's
        previous decode tail (the newest is the turn end the next turn resumes from).
        """
        if make_tail and n % self.unit == 0 and n % self.block:
            wanted = n in self.saves.get(rid, ()) or n > prompt_len
            if wanted and self.by_key.get(self.hashers[rid].digests[n // self.unit - 1]) is None:
                tail = self._make(rid, n, kv_blocks, state_blocks)
                if tail is not None and n > prompt_len:
                    old = self.rolling.pop(rid, None)
                    if old is not None and id(old) not in self._busy():
                        self._drop(old)
                    self.rolling[rid] = tail
        saves = self.saves.get(rid, set())
        for b in [b for b in saves if b <= n]:  # made, or passed: nobody waits on it
            saves.discard(b)
            digest = self.hashers[rid].digests[b // self.unit - 1]
            if self.planned.get(digest) == rid:
                del self.planned[digest]

    def _make(self, rid: str, n: int, kv_blocks: Sequence[int],
              state_blocks: Sequence[int]) -> Tail | None:
        while self.blocks_held() + len(kv_blocks) + len(state_blocks) > self.max_blocks:
            if not self.evict_one():
                return None
        pages: list[int] = []
        for _ in kv_blocks:
            p = core_access.take_page(self.manager)
            if p is None:
                break
            pages.append(p)
        slot = core_access.take_slot(self.manager) if len(pages) == len(kv_blocks) else None
        if slot is None:
            for p in pages:
                core_access.give_back_page(self.manager, p)
            return None
        col = n // self.block * self.block
        units = tuple(self.hashers[rid].digests[col // self.unit : n // self.unit])
        tail = Tail(n, tuple(pages), slot, units)
        copies = list(zip(kv_blocks, pages)) + list(zip(state_blocks, self.state_blocks(slot)))
        self.pending.append(_Pending(rid, copies, tail))
        self.by_key[units[-1]] = tail
        for d in units:
            self.kv[d] = tail
        self.lru[tail] = None
        self.made += 1
        return tail

    def restore(self, rid: str, tail: Tail, kv_blocks: Sequence[int],
                state_blocks: Sequence[int]) -> None:
        """Copy ``tail`` into a hitting request's private column blocks (copy-on-extend)."""
        copies = list(zip(tail.pages, kv_blocks))
        copies += list(zip(self.state_blocks(tail.slot), state_blocks))
        self.pending.append(_Pending(rid, copies, source=tail))
        self.offered.pop(rid, None)
        self.lru.move_to_end(tail)
        self.restored += 1

    # ------------------------------------------------------------------ steps
    def take_copies(self) -> list[tuple[int, int]]:
        """This step's copies, in order (a tail made now is read from the next step on)."""
        out = []
        for p in self.pending:
            if not p.emitted:
                p.emitted = True
                out += p.copies
        return out

    def new_step(self) -> None:
        """The previous step's copies have run: their tails are ready, their sources free.

        Copies queued after the previous step's output was built (a commit while vLLM
        processes the worker's output) are kept for this step's output.
        """
        for p in self.pending:
            if p.emitted and p.tail is not None:
                p.tail.ready = True
        self.pending = [p for p in self.pending if not p.emitted]
        self.offered = {}  # a request still waiting looks its tail up again

    def _busy(self) -> set[int]:
        """Tails this step's copies write or read (their blocks must stay theirs)."""
        busy = {id(t) for p in self.pending for t in (p.tail, p.source) if t is not None}
        return busy | {id(t) for t in self.offered.values()}

    def make_room(self, arena_blocks: int) -> None:
        """Evict tails until ``arena_blocks`` are free: tails yield to the manager's own
        allocations, so they only ever hold memory nothing else wants."""
        while core_access.free_blocks(self.manager) < arena_blocks and self.evict_one():
            pass

    def evict_one(self) -> bool:
        """Drop the least recently used tail no copy of this step reads; ``False`` if none."""
        busy = self._busy()
        for tail in self.lru:
            if id(tail) not in busy:
                self._drop(tail)
                self.evicted += 1
                return True
        return False

    def _drop(self, tail: Tail) -> None:
        self.lru.pop(tail, None)
        if self.by_key.get(tail.units[-1]) is tail:
            del self.by_key[tail.units[-1]]
        for d in tail.units:
            if self.kv.get(d) is tail:
                del self.kv[d]
        for rid, t in list(self.rolling.items()):
            if t is tail:
                del self.rolling[rid]
        for p in tail.pages:
            core_access.give_back_page(self.manager, p)
        core_access.give_back_slot(self.manager, tail.slot)

    def clear(self) -> None:
        for tail in list(self.lru):
            self._drop(tail)
        self.pending = []

    def blocks_held(self) -> int:
        return sum(len(t.pages) + len(self.state_blocks(t.slot)) for t in self.lru)

    def stats(self) -> dict[str, int]:
        return {"tails": len(self.lru), "tails_made": self.made, "tail_hits": self.restored,
                "tails_evicted": self.evicted, "tail_blocks": self.blocks_held()}


class SubBlockHits:
    """Mixin of :class:`~.manager.HybridKVCacheManager`: its lookups of sub-block tails."""

    tails: TailCache | None
    _fine: dict[str, FineHit]
    _wait: set[str]
    attn_ids: list[int]
    mamba_ids: list[int]
    num_groups: int
    block_size: int



    def _fine_lookup(self, request: Request, hit: int) -> FineHit | None:
        """The sub-block tail extending ``hit`` (and the request's tail save points)."""
        if self.tails is None:
            return None
        rid = request.request_id
        fine = self.tails.lookup(rid, request.num_tokens, hit)
        if self.tails.pending_deeper(rid, request.num_tokens, fine.hit_tokens):
            self._wait.add(rid)
        self.tails.plan(rid, request.num_prompt_tokens, fine)
        self._fine[rid] = fine
        return fine

    def _tail_blocks(self, rid: str, hit: int, fine: FineHit) -> KVCacheBlocks:
        """The block-level hit's blocks plus the tail's column (its cached copies: only
        their count matters to the scheduler, the request computes in private blocks)."""
        assert fine.tail is not None
        base = self._hit_blocks(rid, hit).get_block_ids() if hit else None
        tables: list[list[int]] = [[] for _ in range(self.num_groups)]
        for k, gid in enumerate(self.attn_ids):
            tables[gid] = (list(base[gid]) if base else []) + [fine.tail.pages[k]]
        units = fine.hit_tokens // self.block_size
        for gid in self.mamba_ids:
            tables[gid] = [0] * units + [self._state_blocks(fine.tail.slot, 0)]
        return self._kv_blocks(tables)

