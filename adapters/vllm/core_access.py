"""Engine-owned arena blocks of the sub-block tails (:mod:`.fine`), through the port.

A tail's copies live in vLLM blocks the core must not hand out: pages and state slots the
engine takes out of free memory and gives back (:meth:`hybridcache.port.EnginePort.take_page`
and friends). Taking never evicts the core's entries, and the adapter evicts tails before
the core's allocations would evict its own entries (see :func:`free_blocks`), so tails only
ever hold memory nothing else wants. Kept as functions over the port so that :mod:`.fine`
names one small surface.
"""

from __future__ import annotations

from hybridcache.port import EnginePort


def take_page(port: EnginePort) -> int | None:
    """A free arena page (= one vLLM block), or ``None`` (nothing is evicted for it)."""
    return port.take_page()


def give_back_page(port: EnginePort, page: int) -> None:
    port.release_page(page)


def take_slot(port: EnginePort) -> int | None:
    """A free state slot (= one vLLM block per Mamba group), or ``None``."""
    return port.take_slot()


def give_back_slot(port: EnginePort, slot: int) -> None:
    port.release_slot(slot)


def free_blocks(port: EnginePort) -> int:
    """Arena blocks (each ``pages_per_block`` pages or one slot) nobody uses."""
    return port.free_blocks


def pages_per_block(port: EnginePort) -> int:
    return max(port.layout.pages_per_block, 1)
