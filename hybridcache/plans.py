"""What the manager hands an engine: match results, copy plans, save points, allocations.

Immutable records, kept apart from the algorithm so that engines, kernels and tests can
import them without the manager. The ones made on every request (``MatchResult``,
``SavePoint``, ``Allocation``) are named tuples: a frozen dataclass sets each field through
``object.__setattr__``, which made building them about 2 us of a ~100 us request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from hybridcache.config import CacheConfig  # noqa: F401  (re-exported: its old home)


class MatchResult(NamedTuple):
    """Outcome of :meth:`HybridCacheManager.match` (tokens, multiples of the hash unit)."""

    hit_tokens: int
    kv_hit_tokens: int

    @property
    def kv_hit_state_miss_tokens(self) -> int:
        return self.kv_hit_tokens - self.hit_tokens


@dataclass(frozen=True)
class CopyPlan:
    """Copies the engine runs before computing: ``src[i] -> dst[i]`` (slot or page ids)."""

    src: tuple[int, ...] = ()
    dst: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.src)

    def pairs(self) -> list[tuple[int, int]]:
        return list(zip(self.src, self.dst))


class SavePoint(NamedTuple):
    """The engine must write the state after token ``boundary`` into state slot ``slot``."""

    boundary: int
    slot: int


class Allocation(NamedTuple):
    """What :meth:`HybridCacheManager.allocate` hands the engine for one step.

    Attributes:
        start: first token to compute in this step (== hit tokens on the first step).
        num_tokens: tokens to compute in this step.
        block_table: per attention group, the page of every unit of the request so far.
        running_slot: state slot the engine computes in (``-1`` for attention-only models).
        init_state: True when the running state must start from zeros (no snapshot hit).
        state_copies: snapshot -> running slot copies to run first (copy-on-extend).
        save_points: states to write during this step (boundaries inside the step).
        draft_slots: speculative decoding: slot ``i`` receives the state after input
            ``start + i + 1``; the running slot receives the state after the last input.
    """

    start: int
    num_tokens: int
    block_table: dict[str, list[int]]
    running_slot: int
    init_state: bool
    state_copies: CopyPlan
    save_points: tuple[SavePoint, ...]
    draft_slots: tuple[int, ...] = ()
    hit_tokens: int = 0
