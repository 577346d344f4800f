"""vLLM's prefix-cache lookups answered by :class:`~.manager.HybridKVCacheManager`.

``get_computed_blocks`` (the longest usable hit, as vLLM blocks), the same-step wait rule
and ``next_save_boundary`` (where the scheduler ends a prefill chunk), split from the
manager module so that each module stays small. They read the core only through the
adapter's :class:`~hybridcache.port.EnginePort`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request

from hybridcache.port import EnginePort


class PrefixLookups:
    """Mixin of :class:`~.manager.HybridKVCacheManager` (its attributes are the manager's)."""

    port: EnginePort
    enable_caching: bool
    block_size: int
    num_groups: int
    attn_ids: list[int]
    mamba_ids: list[int]
    attn_groups: tuple[str, ...]
    log_stats: bool
    prefix_cache_stats: Any
    stats_counters: Any
    tails: Any
    kv_events: Any
    empty_kv_cache_blocks: KVCacheBlocks
    _pending_snaps: set[bytes]
    _wait: set[str]
    _add: Callable[[Request], None]
    _kv_blocks: Callable[[Sequence[Sequence[int]]], KVCacheBlocks]
    _state_blocks: Callable[[int, int], int]
    _fine_lookup: Callable[..., Any]
    _tail_blocks: Callable[..., KVCacheBlocks]

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int, int]:
        """Longest usable hit (KV in every attention group and a snapshot), as vLLM blocks.

        The shared-prefix boundary (third value) is 0: vLLM uses it to stop a chunk at a
        junction so that its Mamba manager keeps that state; here the branch-point
        admission rule saves there and the scheduler ends a chunk at every save point.
        """
        self._add(request)
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        rid = request.request_id
        hit = self.port.match(rid).hit_tokens
        if self._pending_deeper(rid, hit):
            self._wait.add(rid)
        fine = self._fine_lookup(request, hit)
        self.stats_counters.lookups += 1
        self.stats_counters.lookup_hit_tokens += fine.hit_tokens if fine else hit
        if fine is not None and fine.tail is not None:
            blocks, tail, hit = self._tail_blocks(rid, hit, fine), fine.tail, fine.hit_tokens
        elif hit == 0:
            return self.empty_kv_cache_blocks, 0, 0
        else:
            blocks, tail = self._hit_blocks(rid, hit), None
        if self.kv_events is not None:  # kv_cache_report_mode="full" reports the reuse
            self.kv_events.reused(request, blocks.get_block_ids(), tail)
        return blocks, hit, 0

    def _pending_deeper(self, rid: str, hit: int) -> bool:
        """Whether a request in this step is writing a snapshot deeper on this prompt's path.

        Like vLLM's own Mamba manager, a request that would hit a state being computed in
        the current step is held back one step (its allocation fails) instead of being
        computed from an older snapshot: two sessions arriving together then share the
        system prompt's state from the second step on.
        """
        if not self._pending_snaps:
            return False
        digests = self.port.digests(rid)
        max_units = (self.port.request(rid).num_tokens - 1) // self.block_size
        return any(d in self._pending_snaps for d in digests[hit // self.block_size : max_units])

    def next_save_boundary(self, request: Request, start: int, end: int) -> int | None:
        """First boundary in ``(start, end)`` where admission wants a snapshot, if any.

        The scheduler ends the chunk there: the worker writes a state only at a step's
        end, so a save point inside a chunk could not be honoured. The answer uses the
        same admission function as the manager (for a request not yet allocated, with the
        prompt length and hits its first allocation will see).
        """
        rid = request.request_id
        if rid not in self.port:
            self._add(request)
        stop = end
        if self.tails is not None:
            stop = self.tails.next_save(rid, start, end) or end
        while True:  # a shorter chunk may move a rule's point (chunk-end): to a fixpoint
            points = self.port.planned_save_points(rid, start, stop)
            inside = [b for b, rolling in points if start < b < stop and not rolling]
            if not inside:
                return stop if stop < end else None
            stop = min(inside)

    def _hit_blocks(self, rid: str, hit: int) -> KVCacheBlocks:
        """The cached pages and end snapshot of a hit of ``hit`` tokens, as vLLM blocks."""
        units = hit // self.block_size
        prefix = self.port.cached_prefix(rid, units)
        tables: list[list[int]] = [[] for _ in range(self.num_groups)]
        for gid, group in zip(self.attn_ids, self.attn_groups):
            tables[gid] = prefix.block_tables[group]
        if self.mamba_ids:
            for j, gid in enumerate(self.mamba_ids):
                tables[gid] = [0] * (units - 1) + [self._state_blocks(prefix.snapshot_slot, j)]
        return self._kv_blocks(tables)

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        assert self.prefix_cache_stats is not None
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hits,
            preempted=request.num_preemptions > 0,
        )

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats
