"""Prefix index: unit digest -> cached KV pages and state snapshot, with eviction.

A :class:`Node` stands for one hash unit of one prefix (its digest names the whole prefix up
to the unit's end). It may hold the unit's KV pages (one per attention group) and, at most,
one state snapshot: the recurrent state after the unit's last token. The two are held and
evicted separately (SGLang's separate KV/state locks and LRU lists):

- ``kv_ref`` counts running requests whose block tables use the node's pages; only nodes
  with ``kv_ref == 0`` can lose their KV.
- ``snap_ref`` counts pending restores (a copy plan that reads the snapshot and has not run
  yet); only snapshots with ``snap_ref == 0`` can be evicted.

Nodes live in a flat dict keyed by digest, not a tree: because digests are chained, a node
stays valid when an ancestor's KV is evicted (it becomes reachable again as soon as the
ancestor is recomputed), exactly like vLLM's hash-keyed blocks. ``match`` walks digests from
the first unit and stops at the first unit without KV.

KV bookkeeping is per *run* (units registered together, :mod:`hybridcache.runs`); choosing
victims and allocating under pressure is :mod:`hybridcache.eviction`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from hybridcache.arena import Arena
from hybridcache.eviction import EvictingAllocator, SlotBatch
from hybridcache.policy import Clock, EvictionQueue, LRUQueue, MarconiQueue, ValueQueue
from hybridcache.runs import (
    Hold,
    Run,
    RunValueQueue,
    path_holds,
    pop_tail,
    shift_blocks,
    split,
    truncate_holds,
)

__all__ = ["Digest", "Hold", "Node", "PrefixIndex", "deepest_snapshot", "path_holds", "truncate_holds"]

Digest = bytes


class Node:
    """One hash unit of one cached prefix (see module docstring)."""

    __slots__ = (
        "digest", "depth", "tenant", "pages", "snap", "snap_ref", "snap_hits", "snap_flops",
        "run", "pos", "__weakref__",
    )

    def __init__(
        self,
        digest: Digest,
        depth: int,
        tenant: str | None,
        pages: tuple[int, ...] | None = None,
        run: Run | None = None,
        pos: int = 0,
    ) -> None:
        self.digest = digest
        self.depth = depth  # unit index: the node covers tokens [depth*U, (depth+1)*U)
        self.tenant = tenant
        self.pages = pages
        self.snap = -1
        self.snap_ref = 0
        self.snap_hits = 0
        self.snap_flops = 0.0
        self.run = run  # the run holding this unit's KV (None: no KV)
        self.pos = pos  # position in ``run``

    @property
    def kv_ref(self) -> int:
        """Running requests whose block tables use this unit's pages."""
        return self.run.ref(self.pos) if self.run is not None else 0

    @property
    def kv_flops(self) -> float:
        """Prefill FLOPs this unit's KV saves (its run's value per unit)."""
        return self.run.flops if self.run is not None else 0.0

    @property
    def kv_hits(self) -> int:
        """Requests that reused this unit's KV (counted when their hit is served)."""
        return self.run.hit_count(self.pos) if self.run is not None else 0

    def __repr__(self) -> str:
        return f"Node(depth={self.depth}, pages={self.pages}, snap={self.snap}, kv_ref={self.kv_ref})"


def _snap_evictable(node: Node) -> bool:  # type: ignore[misc]
    return node.snap_ref == 0 and node.snap >= 0


class PrefixIndex(EvictingAllocator):
    """Digest -> :class:`Node`, the two eviction queues and the arena they draw from."""

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
        self.nodes: dict[Digest, Node] = {}
        # Bumped whenever an entry is registered or evicted: a walk with an equal version
        # would see exactly the same nodes, so callers may reuse it.
        self.version = 0
        self.eviction = eviction
        self._evictable_pages = [0] * arena.layout.num_blocks
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

    # ------------------------------------------------------------------ holding
    def hold_path(self, nodes: Sequence[Node]) -> list[Hold]:
        """Hold every node of a matched path (units from the first, in order; gaps allowed
        where a unit has no KV): their pages cannot be evicted. Returns the holds, which
        :meth:`release_runs` takes back (or :meth:`release_path` with the same nodes)."""
        holds = path_holds(nodes)
        self.hold_runs(holds)
        return holds

    def hold_runs(self, holds: Sequence[Hold]) -> None:
        """Take the holds ``(run, end)``: units ``[0, end)`` of each run are pinned."""
        ev, q = self._evictable_pages, self.kv_q
        for run, end in holds:
            h = run.holds
            h[end] = h.get(end, 0) + 1
            old = run.held
            if end > old:
                run.held = end
                shift_blocks(ev, run, old, end, -1)
                q.hold_range(run, old, end)

    def release_path(self, nodes: Sequence[Node], tick: int) -> None:
        """Release what :meth:`hold_path` (or registration) took for ``nodes``."""
        self.release_runs(path_holds(nodes), tick)

    def release_runs(self, holds: Sequence[Hold], tick: int) -> None:
        """Release holds; units no longer held become evictable. Deepest first: under LRU
        the tail of a prefix goes before its head."""
        ev, q = self._evictable_pages, self.kv_q
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
            shift_blocks(ev, run, new, end, 1)
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
    ) -> list[Node]:
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
            The registered nodes, in unit order, all in one run that the caller now holds
            once up to the last of them: ``(nodes[0].run, nodes[-1].pos + 1)``.
        """
        nodes = self.nodes
        get = nodes.get
        one = tables[0] if len(tables) == 1 else None
        run = self._extendable(after, digests, first, flops)
        fresh = run is None
        if fresh:
            run = Run(flops, len(tables))
        out: list[Node] = []
        if isinstance(digests, list) and isinstance(one, list) and not any(map(get, digests[first:end])):
            # Every unit is new (the common case): build the nodes in one comprehension.
            ds = digests[first:end]
            at = len(run.nodes)
            out = [
                Node(d, i, tenant, (p,), run, k)
                for d, i, p, k in zip(ds, range(first, end), one[first:end], range(at, at + len(ds)))
            ]
            nodes.update(zip(ds, out))
            placed = True
        else:
            out, placed = self._claim_units(digests, first, end, tenant, tables), False
            ds = [n.digest for n in out]
        if not out:
            return out
        self.version += 1
        self.tenant_bytes[tenant] = self.tenant_bytes.get(tenant, 0) + self.node_kv_bytes * len(out)
        stop = first + len(out)
        per_group = [
            t[first:stop] if isinstance(t, list) else [t[i] for i in range(first, stop)]  # type: ignore[misc]
            for t in tables
        ]
        run.extend(out, ds, per_group, self._ppb, placed)
        h = run.holds
        if not fresh:  # the caller's hold moves from the old end to the new one
            old = after[1]  # type: ignore[index]
            c = h[old] - 1
            if c:
                h[old] = c
            else:
                del h[old]
        run.held = len(run.nodes)
        h[run.held] = h.get(run.held, 0) + 1
        return out

    def _claim_units(
        self,
        digests: Sequence[Digest] | Mapping[int, Digest],
        first: int,
        end: int,
        tenant: str | None,
        tables: Sequence[Sequence[int] | Mapping[int, int]],
    ) -> list[Node]:
        """Nodes for units ``first..`` until one already has KV: new ones, or snapshot-only
        ones that get their KV back (the general path of :meth:`register_kv_run`)."""
        nodes, out = self.nodes, []
        one = tables[0] if len(tables) == 1 else None
        for i in range(first, end):
            d = digests[i]
            node = nodes.get(d)
            pages = (one[i],) if one is not None else tuple(t[i] for t in tables)  # type: ignore[index]
            if node is None:
                node = nodes[d] = Node(d, i, tenant, pages)
            elif node.pages is not None:
                break
            else:
                node.pages = pages  # a snapshot-only node gets its KV back
            out.append(node)
        return out

    @staticmethod
    def _extendable(
        after: Hold | None, digests: Sequence[Digest] | Mapping[int, Digest], first: int, flops: float
    ) -> Run | None:
        """The run of ``after`` if new units from ``first`` may extend it: the hold covers
        the whole run and its last unit is unit ``first - 1`` of this chain."""
        if after is None:
            return None
        run, end = after
        if end != len(run.nodes) or not end or run.flops != flops:
            return None
        tail = run.nodes[-1]
        if tail.depth != first - 1 or run.digests[-1] != digests[first - 1]:
            return None
        return run

    def register_snapshot(self, node: Node, slot: int, flops: float, tick: int) -> None:
        """Make ``slot`` the cached snapshot at the end of ``node``'s unit (evictable now)."""
        self.version += 1
        assert node.snap < 0, "register_snapshot on a node that has a snapshot"
        node.snap = slot
        node.snap_flops = flops
        self.tenant_bytes[node.tenant] = self.tenant_bytes.get(node.tenant, 0) + self.snap_bytes
        if node.snap_ref == 0:
            self.snap_q.add(node, tick, flops, self.snap_bytes, node.snap_hits)

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
        assert run is not None and node.pos >= run.held and node.pages is not None
        self.kv_q.discard(node)
        ev, ppb, free_page = self._evictable_pages, self._ppb, self.arena.free_page
        for p in node.pages:
            ev[p // ppb] -= 1
            free_page(p)
        self._account("kv", node, self.node_kv_bytes)  # the hook still sees node.pages
        node.pages = None
        if node.pos == len(run.nodes) - 1:
            pop_tail(run)
            tail = None
        else:
            tail = split(run, node.pos, self._ppb)
        self.kv_q.run_changed(run)
        if tail is not None:
            self.kv_q.run_changed(tail)
        if node.snap < 0:
            del self.nodes[node.digest]

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
        if node.pages is None:
            del self.nodes[node.digest]
        return slot if keep_slot else -1

    def _account(self, kind: str, node: Node, nbytes: int) -> None:
        """Count an eviction and call ``on_evict(kind, node, nbytes)``.

        The hook runs after the arena freed the entry and before the node forgets it:
        ``node.pages`` / ``node.snap`` still name the freed pages / slot, whose bytes stay
        intact until the hook returns (an offload tier copies them out here). The hook must
        not call back into the index.
        """
        self.evictions[kind] += 1
        self.evicted_bytes[kind] += nbytes
        self.tenant_bytes[node.tenant] -= nbytes
        if self.on_evict is not None:
            self.on_evict(kind, node, nbytes)

    def kv_path(self, digests: list[Digest], max_units: int) -> tuple[list[Node], list[Hold]]:
        """:meth:`kv_run` and the holds that cover it, one per run it crosses.

        One dictionary look-up per run, not per unit. Digests are chained, so two paths
        that agree at one unit agree at every unit before it: from a run's first matching
        unit, the end of the stretch is found by comparing single digests (the stretch's
        last one, else a binary search), never the units in between.
        """
        get = self.nodes.get
        n = min(len(digests), max_units)
        path: list[Node] = []
        holds: list[Hold] = []
        i = 0
        while i < n:
            node = get(digests[i])
            if node is None or node.run is None:
                break
            run, p = node.run, node.pos
            m = min(len(run.nodes) - p, n - i)
            rd = run.digests
            if m > 1 and rd[p + m - 1] != digests[i + m - 1]:
                ok, bad = 1, m  # units [0, ok) agree, unit bad - 1 does not
                while bad - ok > 1:
                    mid = (ok + bad) // 2
                    if rd[p + mid - 1] == digests[i + mid - 1]:
                        ok = mid
                    else:
                        bad = mid
                m = ok
            path += run.nodes[p : p + m]
            holds.append((run, p + m))
            i += m
        return path, holds

    def walk(self, digests: list[Digest], max_units: int) -> tuple[int, int, Node | None]:
        """Longest KV run and deepest snapshot on it.

        Returns:
            ``(kv_units, snap_units, snap_node)``: units from the start that have KV (capped
            at ``max_units``), the end of the deepest of them that has a snapshot, and that
            node (``None`` if there is none).
        """
        path = self.kv_path(digests, max_units)[0]
        return (len(path), *deepest_snapshot(path))


def deepest_snapshot(run: list[Node]) -> tuple[int, Node | None]:
    """``(units, node)``: the end of the deepest node of ``run`` with a snapshot."""
    for i in range(len(run) - 1, -1, -1):
        if run[i].snap >= 0:
            return i + 1, run[i]
    return 0, None
