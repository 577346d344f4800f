"""Small stand-ins for the vLLM objects the scheduler reads from its KV cache manager.

vLLM's ``Scheduler`` and engine core touch a few members of ``KVCacheManager`` directly
(``block_pool``, ``coordinator``); :class:`~.manager.HybridKVCacheManager` exposes these
views so that they keep working without vLLM's block pool behind them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from vllm.v1.core.kv_cache_utils import KVCacheBlock


class _Owner(Protocol):
    null_block: KVCacheBlock
    num_blocks: int

    @property
    def usage(self) -> float: ...

    def num_free_blocks(self) -> int: ...


@dataclass
class AdapterStats:
    """Counters of the adapter itself (the engine's metrics are in ``manager.metrics``)."""

    lookups: int = 0
    lookup_hit_tokens: int = 0
    # What vLLM was told at each request's first allocation (after (re)admission): prompt
    # tokens and hit tokens, sub-block tails included. The core's own ``token_hit_rate``
    # counts only its block-level hits, so with tails the served rate is the one that
    # equals vLLM's ``num_cached_tokens`` over its prompt tokens.
    served_prompt_tokens: int = 0
    served_hit_tokens: int = 0
    allocations: int = 0
    allocation_failures: int = 0
    saves_in_place: int = 0
    saves_dropped: int = 0
    # Save points a later request of the same step took back (hybridcache.pending_saves).
    saves_withdrawn: int = 0
    commits: int = 0
    deferred: int = 0
    live_saves_held: int = 0
    # Connector path (adapters/vllm/manager_external.py).
    external_loads: int = 0
    external_tokens: int = 0
    external_loads_completed: int = 0
    external_loads_dropped: int = 0
    external_saves_skipped: int = 0
    boundary_offers: int = 0


class BlockPoolView:
    """The few ``BlockPool`` members the scheduler touches directly."""

    def __init__(self, owner: _Owner) -> None:
        self._owner = owner
        self.null_block = owner.null_block
        self.num_gpu_blocks = owner.num_blocks

    def get_usage(self) -> float:
        return self._owner.usage

    def get_num_free_blocks(self) -> int:
        return self._owner.num_free_blocks()

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Only reached for copy-on-write retentions, which this manager never creates."""
        leftover = [b.block_id for b in blocks]
        if leftover:
            raise RuntimeError(f"hybridcache holds no vLLM-side block references: {leftover}")


@dataclass(frozen=True)
class GroupView:
    """Read-only stand-in for one of vLLM's per-group managers (introspection only)."""

    kv_cache_group_id: int
    kv_cache_spec: Any
    block_size: int


@dataclass(frozen=True)
class CoordinatorView:
    """What vLLM's engine core reads from ``kv_cache_manager.coordinator`` (block sizes).

    ``remaining_blocks(request_id, num_tokens)`` answers the one sizing question vLLM's
    scheduler asks the coordinator directly: the blocks a request still needs to hold
    ``num_tokens`` tokens, which it sums into the reservation of an asynchronous
    connector load (``Scheduler._inflight_prefill_reserved_blocks``).
    """

    single_type_managers: tuple[GroupView, ...]
    enable_partial_hash_hits: bool = False
    eagle_group_ids: tuple[int, ...] = ()
    remaining_blocks: Callable[[str, int], int] | None = None

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, **_: Any) -> int:
        """Blocks ``request_id`` still needs for ``num_tokens`` tokens (an estimate)."""
        if self.remaining_blocks is None:
            raise NotImplementedError("hybridcache: block estimates need the connector manager")
        return self.remaining_blocks(request_id, num_tokens)
