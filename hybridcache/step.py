"""What one allocation step carries while it is counted, then taken.

:meth:`HybridCacheManager.allocate <hybridcache.manager.HybridCacheManager.allocate>` counts
a step first (``_Step``, shared with the engine port's ``can_allocate``), then takes pages and
slots, recording them in an ``_Undo`` so that a step failing half-way returns them. Kept out
of the manager so its module holds the algorithm, not its records.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.arena import Arena
    from hybridcache.index import UnitHandle
    from hybridcache.requests import Request
    from hybridcache.runs import Hold


class _Step(NamedTuple):
    """A step validated and counted by :meth:`HybridCacheManager._count_step`."""

    req: Request
    first: bool
    hit: Any
    start: int
    end: int
    page_units: int
    slots: int
    fits: bool
    num_new_tokens: int
    num_draft: int


class _Undo:
    """Pages and slots taken by a step so far: returned if the step fails."""

    __slots__ = ("pages", "slots")

    def __init__(self) -> None:
        self.pages: list[int] = []
        self.slots: list[int] = []

    def give_back(self, arena: Arena) -> None:
        for p in self.pages:
            arena.free_page(p)
        for s in self.slots:
            arena.free_slot(s)


#: A request's match as its first allocation applies it: ``(kv_units, units, holds,
#: restore)``, where ``units`` is the usable hit (KV units with a snapshot at the end, for
#: models with state), ``holds`` cover it and ``restore`` is the snapshot to copy from.
#: A plain tuple: made on every first allocation.
_Hit = tuple[int, int, "list[Hold]", "UnitHandle | None"]
