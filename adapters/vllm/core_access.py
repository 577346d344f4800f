"""The adapter's reads and writes of the core manager's internals, in one place.

The core manager (:class:`hybridcache.manager.HybridCacheManager`) does not yet offer
public methods for what the sub-block tails (:mod:`.fine`) need: taking arena pages and
state slots outside a request (a tail's copies live in vLLM blocks the manager must not
hand out) and giving them back. Until the engine-port interface provides them, these
functions use today's ``manager.arena``: tails live in free memory only (taking a block
never evicts the manager's entries, and the adapter evicts tails before the manager's
allocations would evict its own entries, see :func:`free_blocks`); switching to the public API changes this module
only.
"""

from __future__ import annotations

from hybridcache.manager import HybridCacheManager


def take_page(manager: HybridCacheManager) -> int | None:
    """A free arena page (= one vLLM block), or ``None`` (nothing is evicted for it)."""
    return manager.arena.alloc_page()


def give_back_page(manager: HybridCacheManager, page: int) -> None:
    manager.arena.free_page(page)


def take_slot(manager: HybridCacheManager) -> int | None:
    """A free state slot (= one vLLM block per Mamba group), or ``None``."""
    return manager.arena.alloc_slot()


def give_back_slot(manager: HybridCacheManager, slot: int) -> None:
    manager.arena.free_slot(slot)


def free_blocks(manager: HybridCacheManager) -> int:
    """Arena blocks (each ``pages_per_block`` pages or one slot) nobody uses."""
    return manager.arena.free_block_count


def pages_per_block(manager: HybridCacheManager) -> int:
    return max(manager.layout.pages_per_block, 1)
