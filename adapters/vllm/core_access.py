"""The adapter's reads and writes of the core manager's internals, in one place.

The core manager (:class:`hybridcache.manager.HybridCacheManager`) does not yet offer
public methods for what the sub-block tails (:mod:`.fine`) need: taking arena pages and
state slots outside a request (a tail's copies live in vLLM blocks the manager must not
hand out) and giving them back. Until the engine-port interface provides them, these
functions use today's ``manager.index`` (its evicting allocator: taking a block under
pressure evicts the manager's own victim, as its allocations do) and ``manager.arena``
(giving one back); switching to the public API changes this module
only.
"""

from __future__ import annotations

from hybridcache.manager import HybridCacheManager


def take_page(manager: HybridCacheManager) -> int | None:
    """An arena page (= one vLLM block), evicting a cached entry if needed; ``None`` if
    everything is pinned."""
    return manager.index.alloc_page()


def give_back_page(manager: HybridCacheManager, page: int) -> None:
    manager.arena.free_page(page)


def take_slot(manager: HybridCacheManager) -> int | None:
    """A state slot (= one vLLM block per Mamba group), evicting if needed, or ``None``."""
    return manager.index.alloc_slot()


def give_back_slot(manager: HybridCacheManager, slot: int) -> None:
    manager.arena.free_slot(slot)
