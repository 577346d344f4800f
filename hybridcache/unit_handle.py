"""A handle on one hash unit of a cached prefix: its snapshot, and the run holding its KV.

Made on demand by :meth:`PrefixIndex.handle <hybridcache.index.PrefixIndex.handle>`, never
per registered unit (see :mod:`hybridcache.index`): every snapshot has one, and so does a KV
unit someone asked for. Kept apart from the index so that the read-only views, the policies
and the port can name the type without importing the index's algorithm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.runs import Run
    from hybridcache.superseded import Cohort

Digest = bytes


class UnitHandle:
    """A handle on one hash unit of one cached prefix, made on demand (module docstring).

    It carries the unit's snapshot, if any (the state after the unit's last token), and
    names the run that holds the unit's KV (``None``: no KV); the index keeps ``run``
    current when runs split, shrink or gain units.
    """

    __slots__ = (
        "digest", "depth", "tenant", "snap", "snap_ref", "snap_hits", "snap_flops", "run",
        "snap_tick", "snap_demoted", "snap_queued_hits", "snap_base", "snap_cohort", "snap_superseded",
        "__weakref__",
    )

    def __init__(self, digest: Digest, depth: int, tenant: str | None, run: Run | None) -> None:
        self.digest = digest
        self.depth = depth  # unit index: the node covers tokens [depth*U, (depth+1)*U)
        self.tenant = tenant
        self.snap = -1
        self.snap_ref = 0
        self.snap_hits = 0
        self.snap_flops = 0.0
        self.run = run
        #: The manager tick at which the snapshot last became evictable, whether it was
        #: demoted since (ranked first) and its hits then (a hit is counted after its
        #: restore is released): policy-neutral, so that a switch of eviction policy
        #: (hybridcache.policy_switch) ranks it as the new policy would have.
        self.snap_tick = 0
        self.snap_demoted = False
        self.snap_queued_hits = 0
        #: For a spare checkpoint's snapshot (the ``spare-interval`` rule), the boundary it
        #: was valued from: the deepest non-spare snapshot below it on its request's path
        #: (a request that restores it values its own snapshots from there, not from the
        #: spare, which goes first under pressure); -1 for any other snapshot.
        self.snap_base = -1
        #: The snapshots registered together with this one by one request
        #: (:class:`hybridcache.superseded.Cohort`), or None: set when the snapshot is
        #: registered; ranks it first to evict once a session goes past it.
        self.snap_cohort: Cohort | None = None
        #: Whether a session went past the snapshot since it was queued (ranked first under
        #: value eviction; policy-neutral, as ``snap_demoted``, for a policy switch).
        self.snap_superseded = False

    @property
    def pos(self) -> int:
        """Position in :attr:`run` (the unit must have KV)."""
        return self.depth - self.run.first  # type: ignore[union-attr]

    @property
    def pages(self) -> tuple[int, ...] | None:
        """The unit's KV pages, one per attention group (``None``: no KV)."""
        run = self.run
        return None if run is None else run.unit_pages(self.depth - run.first)

    @property
    def kv_ref(self) -> int:
        """Running requests whose block tables use this unit's pages."""
        run = self.run
        return 0 if run is None else run.ref(self.depth - run.first)

    @property
    def kv_flops(self) -> float:
        """Prefill FLOPs this unit's KV saves (its run's value per unit)."""
        run = self.run
        return 0.0 if run is None else run.flops

    @property
    def kv_hits(self) -> int:
        """Requests that reused this unit's KV (counted when their hit is served)."""
        run = self.run
        return 0 if run is None else run.hit_count(self.depth - run.first)

    def __repr__(self) -> str:
        return f"UnitHandle(depth={self.depth}, pages={self.pages}, snap={self.snap}, kv_ref={self.kv_ref})"


#: The former name of :class:`UnitHandle` (there is no tree of nodes), kept for code written
#: against it.
Node = UnitHandle
