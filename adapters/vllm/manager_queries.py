"""Read-only answers of :class:`~.manager.HybridKVCacheManager` to vLLM's scheduler.

Block tables, free-block counts and statistics, split from the manager module so that each
module stays small; they read the core through the adapter's port (request views, arena
usage) and change nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.request import Request

from hybridcache.port import EnginePort


class BlockQueries:
    """Mixin of :class:`~.manager.HybridKVCacheManager` (its attributes are the manager's)."""

    _tracked: dict[str, Any]
    port: EnginePort
    attn_ids: list[int]
    num_groups: int
    num_blocks: int
    block_size: int
    slot_blocks: int
    stats_counters: Any
    tails: Any
    empty_kv_cache_blocks: KVCacheBlocks
    reserves_prefills: bool

    def _fits(self, request: Request, hit: int) -> bool:
        """Whether the whole sequence could be held next to what live requests hold and
        the pages their prefills still owe (vLLM's ``full_sequence_must_fit`` gate).

        Cached entries nobody holds are evictable, so only live requests' pages and slots
        count against the pool; the new request needs pages for its unmatched units and a
        running slot plus one save slot. With :attr:`reserves_prefills`, the pages that
        running requests' prefills have not been given yet count too
        (:meth:`_owed_prefill_blocks`).
        """
        units = -(-min(request.num_tokens, self.port.spec.max_model_len) // self.block_size)
        need = len(self.attn_ids) * (units - hit // self.block_size) + 2 * self.slot_blocks
        held = self._held_blocks()
        if self.reserves_prefills:
            held += self._owed_prefill_blocks()
        return held + need <= self.num_blocks - 1

    def _owed_prefill_blocks(self) -> int:
        """Pages that running requests' prefills will still take, beyond this step's chunk.

        Why: vLLM's gate admits a waiting request if its whole sequence fits in what is
        free now, yet a running request whose prefill is cut into chunks (here at every
        save point: a checkpoint interval cuts a long prompt into many) takes its next
        chunk's pages in a later step. A request admitted into that room makes the next
        chunk's allocation fail, and vLLM then preempts a running request, whose computed
        tokens are lost. vLLM reserves these blocks itself, but only for an async
        connector load (``Scheduler._inflight_prefill_reserved_blocks``); this reserves
        them for every admission. Decode growth is not reserved (its length is unknown),
        as in vLLM. Measured in ``benchmarks/bench_vllm_withdrawal.py``.
        """
        max_len = self.port.spec.max_model_len
        # Every token the request has (a resumed request replays its outputs); a decoding
        # request scheduled this step already has its page.
        return sum(self._pages_owed(tr, min(tr.request.num_tokens, max_len))
                   for tr in self._tracked.values())

    def _pages_owed(self, tr: Any, num_tokens: int) -> int:
        """Pages (over all attention groups) a request (``tr``, ``None``: not allocated
        yet) has not been given for its first ``num_tokens`` tokens."""
        if not self.attn_ids:
            return 0
        have = len(tr.tables[self.attn_ids[0]]) if tr is not None else 0
        return len(self.attn_ids) * max(-(-num_tokens // self.block_size) - have, 0)

    def _held_blocks(self) -> int:
        ids: set[int] = set()
        slots = dups = 0
        for tr in self._tracked.values():
            for gid in self.attn_ids:
                ids.update(tr.tables[gid])
            view = tr.view
            slots += 1 + len(view.save_slots) + (view.rolling_slot >= 0)
            # A unit this request recomputed although another request had registered it
            # meanwhile: the request keeps its page and holds the cached one too.
            dups += view.duplicate_units * len(self.attn_ids)
        return len(ids) + dups + slots * self.slot_blocks

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        tr = self._tracked.get(request_id)
        return self.empty_kv_cache_blocks if tr is None else self._kv_blocks(tr.tables)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        ids = self.get_block_ids(request_id)
        n = -(-num_computed_tokens // self.block_size)
        return tuple(t[:n] if g in self.attn_ids else t for g, t in enumerate(ids))

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * self.num_groups

    def estimate_cached_tokens(self, request: Request) -> int:
        view = self.port.request(request.request_id)
        if view is None:
            return 0
        return min(view.registered_units * self.block_size, request.num_prompt_tokens)

    def num_free_blocks(self) -> int:
        pages, slots = self.port.usage()
        used = pages + slots * max(self.slot_blocks, 1)
        return max(self.num_blocks - used, 0)

    @property
    def usage(self) -> float:
        """Fraction of vLLM blocks holding a page or a slot (cached entries included)."""
        return 1.0 - self.num_free_blocks() / self.num_blocks

    def stats(self) -> dict[str, object]:
        """The engine's metrics plus the adapter's counters, JSON-friendly."""
        out = dict(self.port.stats())
        out.update(dataclasses.asdict(self.stats_counters))
        c = self.stats_counters
        out["served_token_hit_rate"] = (
            c.served_hit_tokens / c.served_prompt_tokens if c.served_prompt_tokens else 0.0
        )
        if self.tails is not None:
            out.update(self.tails.stats())
        out["block_size"] = self.block_size
        out["num_blocks"] = self.num_blocks
        return out

    @property
    def num_tracked(self) -> int:
        return len(self._tracked)
