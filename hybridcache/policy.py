"""The eviction-queue interface that eviction policies implement, and policy-name checks.

Eviction policies (``lru``, ``value``, ``marconi``) are one file each under
:mod:`hybridcache.policies`, registered by name; this module keeps the queue interface
they implement (:class:`EvictionQueue`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class EvictionQueue:
    """Evictable entries of one kind ranked by a policy. Items are manager nodes.

    The manager calls :meth:`add` when an entry becomes evictable (no request holds it),
    :meth:`discard` when it is held again or dropped, :meth:`peek` (or :meth:`first`) to
    choose a victim and :meth:`evicted` once it is gone. ``priority`` values of the two
    kinds are comparable: lower goes first.

    KV units are held and released per run (:mod:`hybridcache.runs`): the index reports
    ranges of a run through :meth:`hold_range`, :meth:`release_range`, :meth:`on_release` and
    :meth:`run_changed`, which a per-unit queue turns into calls per unit and a per-run
    queue (:class:`~hybridcache.runs.RunValueQueue`) handles as a whole.
    """

    def add(self, item: object, tick: int, flops: float, nbytes: int, hits: int) -> None:
        raise NotImplementedError

    #: The index's handle maker ``(run, pos) -> UnitHandle``: a per-unit queue keys its entries by
    #: the units' handles (set by the index).
    unit: Callable[[Any, int], Any]

    def hold_range(self, run: Any, lo: int, hi: int) -> None:
        """Units ``[lo, hi)`` of ``run`` became held."""
        for pos in range(lo, hi):
            self.hold(self.unit(run, pos))

    def release_range(self, run: Any, lo: int, hi: int, tick: int, nbytes: int) -> None:
        """Units ``[lo, hi)`` of ``run`` became evictable; deepest first, so that under LRU
        the tail of a prefix goes before its head."""
        flops = run.flops
        for pos in range(hi - 1, lo - 1, -1):
            self.add(self.unit(run, pos), tick, flops, nbytes, 0)

    def on_release(self, run: Any, end: int, tick: int = 0) -> None:
        """A hold of units ``[0, end)`` of ``run`` was released (some may stay held) at the
        manager's ``tick``."""

    def run_changed(self, run: Any) -> None:
        """``run`` lost units to eviction (its tail moved, or it was split off)."""

    def discard(self, item: object) -> None:
        raise NotImplementedError

    def hold(self, item: object) -> None:
        """``item`` is held by a request and must not be chosen until :meth:`add` again."""
        self.discard(item)

    def peek(self) -> tuple[float, object] | None:
        raise NotImplementedError

    def peek_priority(self) -> float | None:
        """The priority :meth:`peek` would report (a queue may answer without the item)."""
        top = self.peek()
        return None if top is None else top[0]

    def first(self, pred: Callable[[Any], bool], aside: list) -> tuple[float, object] | None:
        """The lowest-ranked entry whose pages satisfy ``pred`` (left in the queue), or ``None``.

        Lower-ranked entries that fail ``pred`` are moved into ``aside`` so that a caller
        evicting many victims under the same ``pred`` scans each of them once; the caller
        must hand ``aside`` back to :meth:`put_back` when done.
        """
        raise NotImplementedError

    def put_back(self, aside: list) -> None:
        """Return the entries :meth:`first` set aside, in their original ranks."""
        raise NotImplementedError

    def floor(self) -> float | None:
        """A priority at or below every queued entry's (``None`` when empty); no side effects."""
        raise NotImplementedError

    def demote(self, item: object, floor: float) -> None:
        """Rank a queued ``item`` first in this queue, with priority at most ``floor`` (the
        lowest priority of any queue, so that it also goes before the other kind's entries);
        no-op if ``item`` is not queued."""
        raise NotImplementedError

    def evicted(self, item: object) -> None:
        """``item`` was chosen as a victim and is being dropped (the index discards it)."""

    def __len__(self) -> int:
        raise NotImplementedError


def check_eviction_name(name: str) -> str:
    """``name`` if an eviction policy is registered under it (:mod:`hybridcache.policies`)."""
    from hybridcache.policies import check_policy_name

    return check_policy_name(name)


_MOVED = {
    "AdmissionPolicy": "hybridcache.admission",
    "ADMISSION_RULES": "hybridcache.admission",
    "LRUQueue": "hybridcache.policies.lru",
    "Clock": "hybridcache.policies.value",
    "ValueQueue": "hybridcache.policies.value",
    "MarconiQueue": "hybridcache.policies.marconi",
    "marconi_ranking": "hybridcache.policies.marconi",
}


def __getattr__(name: str) -> Any:
    """Names that moved to :mod:`hybridcache.policies` (old imports keep working)."""
    if name == "EVICTION_POLICIES":
        from hybridcache.policies import policy_names

        return policy_names()
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(name)
