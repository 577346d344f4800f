"""Prefix index: unit digest -> cached KV pages and state snapshot, with eviction.

A hash unit of a prefix is named by its digest (which names the whole prefix up to the
unit's end). It may have KV pages (one per attention group) and, at most, one state
snapshot: the recurrent state after the unit's last token. The two are held and evicted
separately (SGLang's separate KV/state locks and LRU lists):

- KV lives in *runs* (units registered together, :mod:`hybridcache.runs`); ``heads`` maps
  the first unit of every run to the run. A walk enters every run at its first unit, so
  no other unit needs an entry (see :meth:`PrefixIndex.kv_path`). A run's holds count the
  running requests whose block tables use its pages; only unheld units can lose their KV.
- A :class:`Node` is a handle on one unit, made on demand: every snapshot has one (its
  ``snap_ref`` counts pending restores, a copy plan that reads the snapshot and has not run
  yet; only snapshots with ``snap_ref == 0`` can be evicted), and so does a KV unit that
  someone asked for. Registering a request's new units makes no per-unit object and no
  per-unit dict entry: at 16 tokens per unit, those were the index's largest cost in time
  (and objects, in the collector's work).

Units live in flat dicts keyed by digest, not a tree: because digests are chained, a unit
stays valid when an ancestor's KV is evicted (it becomes reachable again as soon as the
ancestor is recomputed), exactly like vLLM's hash-keyed blocks. ``match`` walks digests from
the first unit and stops at the first unit without KV.

Choosing victims and allocating under pressure is :mod:`hybridcache.eviction`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

from hybridcache.arena import Arena
from hybridcache.eviction import EvictingAllocator, SlotBatch
from hybridcache.policy import Clock, EvictionQueue, LRUQueue, MarconiQueue, ValueQueue
from hybridcache.runs import (
    Hold,
    Run,
    RunValueQueue,
    pop_tail,
    shift_blocks,
    split,
    truncate_holds,
)

__all__ = ["Digest", "Hold", "Node", "PrefixIndex", "UnitView", "truncate_holds"]

Digest = bytes


class Node:
    """A handle on one hash unit of one cached prefix, made on demand (module docstring).

    It carries the unit's snapshot, if any (the state after the unit's last token), and
    names the run that holds the unit's KV (``None``: no KV); the index keeps ``run``
    current when runs split, shrink or gain units.
    """

    __slots__ = (
        "digest", "depth", "tenant", "snap", "snap_ref", "snap_hits", "snap_flops", "run",
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
        return f"Node(depth={self.depth}, pages={self.pages}, snap={self.snap}, kv_ref={self.kv_ref})"


class UnitView(Mapping[Digest, Node]):
    """Read-only ``digest -> Node`` over every cached unit (with KV, a snapshot or both).

    For inspection and tests: the index maps only runs' first units, so looking up any
    other unit scans the runs, and a KV unit looked up gets its handle (kept, so the same
    unit always gives the same node). Hot paths use :meth:`PrefixIndex.kv_path` and
    :attr:`PrefixIndex.handles`.
    """

    def __init__(self, index: PrefixIndex) -> None:
        self._index = index

    def _find(self, digest: object) -> tuple[Run, int] | None:
        for run in self._index.heads.values():
            if digest in run.digests:
                return run, run.digests.index(digest)  # type: ignore[arg-type]
        return None

    def __getitem__(self, digest: Digest) -> Node:
        index = self._index
        node = index.handles.get(digest)
        if node is not None:
            return node
        found = self._find(digest)
        if found is None:
            raise KeyError(digest)
        return index.handle(*found)

    def __contains__(self, digest: object) -> bool:
        return digest in self._index.handles or self._find(digest) is not None

    def __iter__(self) -> Iterator[Digest]:
        index = self._index
        for run in index.heads.values():
            yield from run.digests
        yield from index.bare

    def __len__(self) -> int:
        index = self._index
        return sum(len(run) for run in index.heads.values()) + len(index.bare)


def _snap_evictable(node: Node) -> bool:  # type: ignore[misc]
    return node.snap_ref == 0 and node.snap >= 0


class PrefixIndex(EvictingAllocator):
    """Digest -> run (KV) and handle (snapshot), the two eviction queues and the arena they
    draw from."""

    def __init__(
        self,
        arena: Arena,
        eviction: str,
        flops_per_byte_scale: float,
        marconi_alpha: float = 1.0,
        marconi_window: int = 64,
        on_evict: Callable[[str, Node, int], None] | None = None,
    ) -> None:
        self.arena = arena
        #: The first unit of every run -> the run. A walk enters every run at its first
        #: unit (see kv_path), so the other units need no entry: registering a request's
        #: units adds at most one.
        self.heads: dict[Digest, Run] = {}
        #: Units that have a handle: every snapshot, and KV units someone asked for (a
        #: victim, a per-unit queue's entry, a lookup). At most one handle per digest. A
        #: handle stays while its unit has KV, also after its snapshot is evicted: it keeps
        #: the unit's snapshot hits, which rank a snapshot registered there again (dropping
        #: them cost 0.008 of hit rate on the demo at 1 GiB).
        self.handles: dict[Digest, Node] = {}
        #: The handles without KV (snapshot only), checked when units are registered.
        self.bare: dict[Digest, Node] = {}
        #: Every unit as a ``digest -> Node`` mapping (see :class:`UnitView`).
        self.nodes = UnitView(self)
        # Bumped whenever an entry is registered or evicted: a walk with an equal version
        # would see exactly the same units, so callers may reuse it.
        self.version = 0
        self.eviction = eviction
        # For slot allocation (eviction.py): registered KV pages per block, and the runs
        # that requests hold (their held prefixes pin blocks). Pinned blocks are worked out
        # only when a slot allocation asks, not on every hold and release.
        self._registered = [0] * arena.layout.num_blocks
        self._held_runs: set[Run] = set()
        self._pinned: set[int] = set()
        self._pinned_stale = True
        self._ppb = max(arena.layout.pages_per_block, 1)
        self._marconi_ranked: list[tuple[str, Node]] = []
        self.marconi_alpha = marconi_alpha
        self.marconi_window = marconi_window
        self.on_evict = on_evict
        self._aside: list | None = None  # set while a slot_batch is open
        self._batch = SlotBatch(self)  # one reusable context object (allocate opens two)
        self.tenant_bytes: dict[str | None, int] = {}
        self.evictions = {"kv": 0, "state": 0}
        self.evicted_bytes = {"kv": 0, "state": 0}
        lay = arena.layout
        self.node_kv_bytes = lay.page_bytes * len(lay.page_payload)
        self.snap_bytes = lay.slot_bytes
        if eviction == "lru":
            self.kv_q: EvictionQueue = LRUQueue()
            self.snap_q: EvictionQueue = LRUQueue()
        elif eviction == "value":
            clock = Clock()
            self.kv_q = RunValueQueue(clock, flops_per_byte_scale, self.node_kv_bytes)  # type: ignore[assignment]
            self.snap_q = ValueQueue(clock, flops_per_byte_scale, _snap_evictable)
        else:
            self.kv_q = MarconiQueue()
            self.snap_q = MarconiQueue()
        self.kv_q.unit = self.handle  # victims, and a per-unit queue's keys, are handles
        if eviction == "value" and self.snap_bytes:
            self.kv_q.stranded = self._stranded_tail  # type: ignore[attr-defined]
        self._init_eviction()

    def _stranded_tail(self, run: Run) -> bool:
        """KV and state valued as one: a run's tail without a snapshot is KV past the last
        snapshot on its path, which no hit can use until a state exists there."""
        node = self.handles.get(run.digests[-1])
        return node is None or node.snap < 0

    # ------------------------------------------------------------------ units
    def handle(self, run: Run, pos: int) -> Node:
        """The handle of the unit at ``pos`` of ``run`` (made and kept on first use)."""
        d = run.digests[pos]
        node = self.handles.get(d)
        if node is None:
            node = self.handles[d] = Node(d, run.first + pos, run.tenant, run)
        return node

    def unit(self, digests: Sequence[Digest], u: int) -> Node | None:
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

    # ------------------------------------------------------------------ holding
    def hold_runs(self, holds: Sequence[Hold]) -> None:
        """Take the holds ``(run, end)``: units ``[0, end)`` of each run are pinned."""
        q = self.kv_q
        for run, end in holds:
            h = run.holds
            h[end] = h.get(end, 0) + 1
            old = run.held
            if end > old:
                run.held = end
                if not old:
                    self._held_runs.add(run)
                self._pinned_stale = True
                q.hold_range(run, old, end)

    def release_runs(self, holds: Sequence[Hold], tick: int) -> None:
        """Release holds; units no longer held become evictable. Deepest first: under LRU
        the tail of a prefix goes before its head."""
        q = self.kv_q
        for run, end in reversed(holds):
            h = run.holds
            c = h.get(end, 0) - 1
            if c < 0:
                raise AssertionError(f"negative kv_ref: release of {end} units of {run}")
            if c:
                h[end] = c
            else:
                del h[end]
            q.on_release(run, end)
            if c or end != run.held:
                continue
            new = max(h) if h else 0
            if new == end:
                continue
            run.held = new
            if not new:
                self._held_runs.discard(run)
            self._pinned_stale = True
            q.release_range(run, new, end, tick, self.node_kv_bytes)

    def count_hits(self, holds: Sequence[Hold]) -> None:
        """A request's hit on these holds was served: every unit in them gains a hit."""
        for run, end in holds:
            run.hits[end] = run.hits.get(end, 0) + 1

    def pin_snapshot(self, node: Node) -> None:
        """A copy plan will read ``node``'s snapshot: keep it until :meth:`unpin_snapshot`."""
        if node.snap_ref == 0:
            self.snap_q.hold(node)
        node.snap_ref += 1

    def unpin_snapshot(self, node: Node, tick: int) -> None:
        node.snap_ref -= 1
        if node.snap_ref < 0:
            raise AssertionError(f"negative snap_ref on {node}")
        if node.snap_ref == 0 and node.snap >= 0:
            self.snap_q.add(node, tick, node.snap_flops, self.snap_bytes, node.snap_hits)

    # ------------------------------------------------------------------ registering
    def register_kv_run(
        self,
        digests: Sequence[Digest] | Mapping[int, Digest],
        first: int,
        end: int,
        tenant: str | None,
        tables: Sequence[Sequence[int] | Mapping[int, int]],
        flops: float,
        after: Hold | None = None,
    ) -> tuple[Hold, int] | None:
        """Make the request's pages the cached KV of units ``first, first+1, ...`` before
        ``end``, stopping at the first unit that already has KV (a duplicate, which the
        caller handles).

        Args:
            digests: the request's unit digests (indexed by unit; a mapping will do).
            first, end: unit range to register.
            tenant: owner of the new entries (for quotas).
            tables: the request's block table per attention group (page of unit ``i`` at
                index ``i``).
            flops: value of each unit's KV (depth-independent, see the manager).
            after: the caller's hold on the run that ends at unit ``first - 1``, if any. If
                it covers that whole run, the new units extend it and the hold moves to the
                new end (a conversation's turns become one run); else they form a new run.

        Returns:
            ``(hold, count)``: the caller's hold on the units' run, which now covers it up
            to the last of them, and how many were registered; ``None`` if none was (unit
            ``first`` has KV already).
        """
        # A unit past ``first`` that has KV is the first unit of a run (its unit before,
        # ours, has none), so only run heads can cut the registration short.
        heads = self.heads
        if isinstance(digests, list):
            ds = digests[first:end]
            if not heads.keys().isdisjoint(ds):
                ds = ds[: next(k for k, d in enumerate(ds) if d in heads)]
        else:
            ds = []
            for i in range(first, end):
                if digests[i] in heads:
                    break
                ds.append(digests[i])
        if not ds:
            return None
        run = self._extendable(after, digests, first, flops)
        fresh = run is None
        if fresh:
            run = Run(flops, len(tables), first, tenant)
        self.version += 1
        n = len(ds)
        self.tenant_bytes[tenant] = self.tenant_bytes.get(tenant, 0) + self.node_kv_bytes * n
        stop = first + n
        per_group = [
            t[first:stop] if isinstance(t, list) else [t[i] for i in range(first, stop)]  # type: ignore[misc]
            for t in tables
        ]
        run.extend(ds, per_group, self._ppb)
        if fresh:
            heads[ds[0]] = run
        bare = self.bare
        if bare and not bare.keys().isdisjoint(ds):  # snapshot-only units get their KV back
            for d in ds:
                node = bare.pop(d, None)
                if node is not None:
                    node.run = run
        h = run.holds
        if not fresh:  # the caller's hold moves from the old end to the new one
            old = after[1]  # type: ignore[index]
            c = h[old] - 1
            if c:
                h[old] = c
            else:
                del h[old]
        shift_blocks(self._registered, run, len(run.digests) - n, len(run.digests), 1)
        run.held = len(run.digests)
        h[run.held] = h.get(run.held, 0) + 1
        self._held_runs.add(run)
        self._pinned_stale = True
        return (run, run.held), n

    @staticmethod
    def _extendable(
        after: Hold | None, digests: Sequence[Digest] | Mapping[int, Digest], first: int, flops: float
    ) -> Run | None:
        """The run of ``after`` if new units from ``first`` may extend it: the hold covers
        the whole run and its last unit is unit ``first - 1`` of this chain."""
        if after is None:
            return None
        run, end = after
        if end != len(run.digests) or not end or run.flops != flops:
            return None
        if run.first + end != first or run.digests[-1] != digests[first - 1]:
            return None
        return run

    def register_snapshot(self, node: Node, slot: int, flops: float, tick: int) -> None:
        """Make ``slot`` the cached snapshot at the end of ``node``'s unit (evictable now).

        ``node`` is the unit's handle (:meth:`handle`, :meth:`unit`)."""
        self.version += 1
        assert node.snap < 0, "register_snapshot on a node that has a snapshot"
        assert self.handles.get(node.digest) is node, "register_snapshot on a foreign handle"
        node.snap = slot
        node.snap_flops = flops
        self.tenant_bytes[node.tenant] = self.tenant_bytes.get(node.tenant, 0) + self.snap_bytes
        if node.snap_ref == 0:
            self.snap_q.add(node, tick, flops, self.snap_bytes, node.snap_hits)
        if node.run is not None:
            self.kv_q.run_changed(node.run)  # a stranded tail may be usable now

    def demote_snapshot(self, node: Node) -> None:
        """Rank ``node``'s queued snapshot before every other evictable entry."""
        floors = [f for f in (self.kv_q.floor(), self.snap_q.floor()) if f is not None]
        if floors:
            self.snap_q.demote(node, min(floors))

    # ------------------------------------------------------------------ eviction
    def evict_kv(self, node: Node) -> None:
        """Drop ``node``'s KV pages (it must be unreferenced)."""
        self.version += 1
        run = node.run
        assert run is not None, "evict_kv of a unit without KV"
        pos = node.depth - run.first
        assert pos >= run.held
        self.kv_q.discard(node)
        reg, ppb, free_page = self._registered, self._ppb, self.arena.free_page
        for pages in run.pages:
            p = pages[pos]
            reg[p // ppb] -= 1
            free_page(p)
        self._account("kv", node, self.node_kv_bytes)  # the hook still sees node.pages
        if pos == 0:
            del self.heads[node.digest]
        tail = None
        if pos == len(run.digests) - 1:
            pop_tail(run)
        else:
            tail = split(run, pos, ppb)
        self.kv_q.run_changed(run)
        if tail is not None:
            self.heads[tail.digests[0]] = tail
            handles = self.handles
            if handles:
                for d in tail.digests:  # rare (a unit inside a run): re-point its handles
                    moved = handles.get(d)
                    if moved is not None:
                        moved.run = tail
            self.kv_q.run_changed(tail)
        node.run = None
        if node.snap < 0:
            del self.handles[node.digest]
        else:
            self.bare[node.digest] = node

    def evict_snapshot(self, node: Node, keep_slot: bool = False) -> int:
        """Drop ``node``'s snapshot (it must be unpinned).

        Args:
            keep_slot: the caller takes the slot over (a slot allocation evicting for
                one): it stays allocated instead of going back to the arena.

        Returns:
            The slot if ``keep_slot``, else -1.
        """
        self.version += 1
        slot = node.snap
        assert node.snap_ref == 0 and slot >= 0
        self.snap_q.discard(node)
        if not keep_slot:
            self.arena.free_slot(slot)
        self._account("state", node, self.snap_bytes)  # the hook still sees node.snap
        node.snap = -1
        if node.run is None:
            del self.handles[node.digest]
            del self.bare[node.digest]
        else:
            self.kv_q.run_changed(node.run)  # its run's tail may be stranded now

        return slot if keep_slot else -1

    def _account(self, kind: str, node: Node, nbytes: int) -> None:
        """Count an eviction and call ``on_evict(kind, node, nbytes)``.

        The hook runs after the arena freed the entry and before the index forgets it:
        ``node.pages`` / ``node.snap`` still name the freed pages / slot, whose bytes stay
        intact until the hook returns (an offload tier copies them out here). The hook must
        not call back into the index.
        """
        self.evictions[kind] += 1
        self.evicted_bytes[kind] += nbytes
        self.tenant_bytes[node.tenant] -= nbytes
        if self.on_evict is not None:
            self.on_evict(kind, node, nbytes)

    # ------------------------------------------------------------------ walks
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

    def deepest_snapshot(self, digests: Sequence[Digest], units: int) -> tuple[int, Node | None]:
        """``(end, node)``: the deepest of the chain's first ``units`` units with a snapshot
        (``(0, None)`` if none has one)."""
        get = self.handles.get
        for u in range(units - 1, -1, -1):
            node = get(digests[u])
            if node is not None and node.snap >= 0:
                return u + 1, node
        return 0, None

    def walk(self, digests: list[Digest], max_units: int) -> tuple[int, int, Node | None]:
        """Longest KV run and deepest snapshot on it.

        Returns:
            ``(kv_units, snap_units, snap_node)``: units from the start that have KV (capped
            at ``max_units``), the end of the deepest of them that has a snapshot, and that
            node (``None`` if there is none).
        """
        units = self.kv_path(digests, max_units)[0]
        return (units, *self.deepest_snapshot(digests, units))
