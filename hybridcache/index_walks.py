"""Walks along a chain's digests through the prefix index: the longest prefix with KV (one
look-up per run), the deepest snapshot on it, the holds that pin a stretch.

Kept apart from :mod:`hybridcache.index`, which registers, holds and evicts; these only read
it. :class:`ChainWalks` is the index's base class, so they are called as index methods.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.runs import Hold, Run
    from hybridcache.unit_handle import UnitHandle

Digest = bytes


class ChainWalks:
    """Read-only walks of :class:`~hybridcache.index.PrefixIndex` (its base class): ``heads``
    maps every run's first unit to the run, ``handles`` the units that have a handle."""

    heads: dict[Digest, Run]
    handles: dict[Digest, UnitHandle]
    handle: Callable[[Run, int], UnitHandle]  # the index's handle maker

    def unit(self, digests: Sequence[Digest], u: int) -> UnitHandle | None:
        """The handle of unit ``u`` of a chain (``None`` if it has neither KV nor a snapshot)."""
        node = self.handles.get(digests[u])
        if node is not None:
            return node
        for run, end in self.chain_holds(digests, 0, u + 1):
            if run.first <= u < run.first + end:
                return self.handle(run, u - run.first)
        return None

    def has_kv_at(self, digests: Sequence[Digest], i: int, before: Run | None) -> bool:
        """Unit ``i`` of a chain has KV, given ``before``, the run holding unit ``i - 1``
        (``None`` if it has no KV or ``i == 0``): the unit starts a run, or ``before``
        continues with it (no other run can hold it)."""
        d = digests[i]
        if d in self.heads:
            return True
        if before is None:
            return False
        p = i - before.first
        return p < len(before.digests) and before.digests[p] == d

    def chain_holds(self, digests: Sequence[Digest], lo: int, hi: int) -> list[Hold]:
        """The holds that pin units ``[lo, hi)`` of a chain that have KV (others skipped):
        one per run, from its first unit up to the deepest of them in it.

        Unit ``lo`` must not be inside a run that started before it (true for ``lo == 0``
        and right after a unit the caller holds): the walk finds runs by their first unit,
        and a unit without KV is always followed by a run's first unit or another gap.
        """
        holds: list[Hold] = []
        i = lo
        while i < hi:
            i, got = self.kv_path(digests, hi, i)
            holds += got
            i += 1  # a unit without KV (or hi)
        return holds

    def kv_path(self, digests: list[Digest], max_units: int, start: int = 0) -> tuple[int, list[Hold]]:
        """The longest prefix of a chain with KV (capped at ``max_units``) and the holds
        that cover it, one per run it crosses; from unit ``start`` if given (which must
        not be inside a run that started before it, see :meth:`chain_holds`).

        One dictionary look-up per run, not per unit. Digests are chained, so two paths
        that agree at one unit agree at every unit before it: from a run's first matching
        unit, the end of the stretch is found by comparing single digests (the stretch's
        last one, else a binary search), never the units in between. For the same reason
        the path enters every run at its first unit (the unit before it is in the run
        before), so each hold ``(run, end)`` covers exactly the path's units in ``run``.

        Returns:
            ``(end, holds)``: units ``[start, end)`` have KV, unit ``end`` has none (or is
            ``max_units``).
        """
        get = self.heads.get
        n = min(len(digests), max_units)
        holds: list[Hold] = []
        i = start
        while i < n:
            run = get(digests[i])
            if run is None:
                break
            if run.first != i:
                raise AssertionError(f"unit {i} found inside {run}: the digest map is corrupt")
            m = min(len(run.digests), n - i)
            rd = run.digests
            if m > 1 and rd[m - 1] != digests[i + m - 1]:
                # Where the last walk left this run is where the next one usually leaves it
                # too (a shared system prompt, then each conversation's own turns).
                h = run.fork
                if 0 < h < m and rd[h - 1] == digests[i + h - 1] and rd[h] != digests[i + h]:
                    m = h
                else:
                    ok, bad = 1, m  # units [0, ok) agree, unit bad - 1 does not
                    while bad - ok > 1:
                        mid = (ok + bad) // 2
                        if rd[mid - 1] == digests[i + mid - 1]:
                            ok = mid
                        else:
                            bad = mid
                    m = run.fork = ok
            holds.append((run, m))
            i += m
        return i, holds

    def deepest_snapshot(self, digests: Sequence[Digest], units: int) -> tuple[int, UnitHandle | None]:
        """``(end, node)``: the deepest of the chain's first ``units`` units with a snapshot
        (``(0, None)`` if none has one)."""
        get = self.handles.get
        for u in range(units - 1, -1, -1):
            node = get(digests[u])
            if node is not None and node.snap >= 0:
                return u + 1, node
        return 0, None

    def walk(self, digests: list[Digest], max_units: int) -> tuple[int, int, UnitHandle | None]:
        """Longest KV run and deepest snapshot on it.

        Returns:
            ``(kv_units, snap_units, snap_node)``: units from the start that have KV (capped
            at ``max_units``), the end of the deepest of them that has a snapshot, and that
            node (``None`` if there is none).
        """
        units = self.kv_path(digests, max_units)[0]
        return (units, *self.deepest_snapshot(digests, units))
