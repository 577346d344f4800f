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

Eviction frees entries until the arena can allocate what is asked. KV pages are evicted in
whole nodes. A *state slot* needs an empty block, so while one is needed the KV victims are
taken, in rank order, only from slabs that no running request pins (every page in them is
evictable): evicting a page of a pinned slab would destroy a cached entry without bringing a
free block closer. Victims are still single entries of the lowest rank, never whole slabs:
slab mates can be the most valuable entries in the cache (measured: evicting the victim's
whole slab cost up to half the hit rate at small budgets).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

from hybridcache.arena import Arena
from hybridcache.policy import (
    Clock,
    EvictionQueue,
    LRUQueue,
    MarconiQueue,
    ValueQueue,
    marconi_ranking,
)

Digest = bytes


class Node:
    """One hash unit of one cached prefix (see module docstring)."""

    __slots__ = (
        "digest", "depth", "tenant", "pages", "snap", "kv_ref", "snap_ref",
        "kv_hits", "snap_hits", "snap_flops", "kv_flops", "__weakref__",
    )

    def __init__(self, digest: Digest, depth: int, tenant: str | None) -> None:
        self.digest = digest
        self.depth = depth  # unit index: the node covers tokens [depth*U, (depth+1)*U)
        self.tenant = tenant
        self.pages: tuple[int, ...] | None = None
        self.snap = -1
        self.kv_ref = 0
        self.snap_ref = 0
        self.kv_hits = 0
        self.snap_hits = 0
        self.snap_flops = 0.0
        self.kv_flops = 0.0

    def __repr__(self) -> str:
        return f"Node(depth={self.depth}, pages={self.pages}, snap={self.snap}, kv_ref={self.kv_ref})"


def _kv_evictable(node: Node) -> bool:  # type: ignore[misc]
    return node.kv_ref == 0 and node.pages is not None


def _snap_evictable(node: Node) -> bool:  # type: ignore[misc]
    return node.snap_ref == 0 and node.snap >= 0


class PrefixIndex:
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
        self.page_owner: dict[int, Node] = {}
        self._evictable_pages = [0] * arena.layout.num_blocks
        self._ppb = max(arena.layout.pages_per_block, 1)
        self._marconi_ranked: list[tuple[str, Node]] = []
        self.marconi_alpha = marconi_alpha
        self.marconi_window = marconi_window
        self.on_evict = on_evict
        self._aside: list | None = None  # set while a slot_batch is open
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
            self.kv_q = ValueQueue(clock, flops_per_byte_scale, _kv_evictable)
            self.snap_q = ValueQueue(clock, flops_per_byte_scale, _snap_evictable)
        else:
            self.kv_q = MarconiQueue()
            self.snap_q = MarconiQueue()
        # The value queue checks held entries lazily: hold_path skips its no-op hold().
        self._kv_hold = None if isinstance(self.kv_q, ValueQueue) else self.kv_q.hold

    # ------------------------------------------------------------------ holding
    def hold_kv(self, node: Node) -> None:
        """A request now uses ``node``'s pages: they cannot be evicted."""
        self.hold_path([node])

    def hold_path(self, nodes: list[Node]) -> None:
        """Hold every node of a matched path: their pages cannot be evicted."""
        ev, ppb, hold = self._evictable_pages, self._ppb, self._kv_hold
        for node in nodes:
            ref = node.kv_ref
            if ref == 0:
                pages = node.pages
                if pages is not None:
                    if hold is not None:
                        hold(node)
                    for p in pages:
                        ev[p // ppb] -= 1
            node.kv_ref = ref + 1

    def release_path(self, nodes: list[Node], tick: int) -> None:
        """A request stopped using these nodes' pages; at zero references they become
        evictable. Deepest first: under LRU the tail of a prefix goes before its head."""
        ev, ppb = self._evictable_pages, self._ppb
        freed: list[tuple[Node, float, int]] = []
        add = freed.append
        for node in reversed(nodes):
            ref = node.kv_ref - 1
            node.kv_ref = ref
            if ref == 0:
                pages = node.pages
                if pages is not None:
                    for p in pages:
                        ev[p // ppb] += 1
                    add((node, node.kv_flops, node.kv_hits))
            elif ref < 0:
                raise AssertionError(f"negative kv_ref on {node}")
        self.kv_q.add_many(freed, tick, self.node_kv_bytes)

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
    def register_kv(
        self, digest: Digest, depth: int, tenant: str | None, pages: tuple[int, ...], flops: float
    ) -> Node:
        """Make ``pages`` the cached KV of unit ``digest``; the caller holds one reference."""
        run = self.register_kv_run({depth: digest}, depth, depth + 1, tenant, [{depth: p} for p in pages], flops)
        assert run, "register_kv on a node that has KV"
        return run[0]

    def register_kv_run(
        self,
        digests: Sequence[Digest] | Mapping[int, Digest],
        first: int,
        end: int,
        tenant: str | None,
        tables: Sequence[Sequence[int] | Mapping[int, int]],
        flops: float,
    ) -> list[Node]:
        """:meth:`register_kv` for units ``first, first+1, ...`` before ``end``, stopping at
        the first unit that already has KV (a duplicate, which the caller handles).

        Args:
            digests: the request's unit digests (indexed by unit; a mapping will do).
            first, end: unit range to register.
            tenant: owner of the new entries (for quotas).
            tables: the request's block table per attention group (page of unit ``i`` at
                index ``i``).
            flops: value of each unit's KV (depth-independent, see the manager).

        Returns:
            The registered nodes, each held once by the caller, in unit order.
        """
        nodes, owner, out = self.nodes, self.page_owner, []
        get, append = nodes.get, out.append
        one = tables[0] if len(tables) == 1 else None
        for i in range(first, end):
            d = digests[i]
            node = get(d)
            if node is None:
                node = Node(d, i, tenant)
                nodes[d] = node
            elif node.pages is not None:
                break
            pages = (one[i],) if one is not None else tuple(t[i] for t in tables)
            node.pages = pages
            node.kv_flops = flops
            node.kv_ref += 1
            for p in pages:
                owner[p] = node
            append(node)
        if out:
            self.version += 1
            self.tenant_bytes[tenant] = self.tenant_bytes.get(tenant, 0) + self.node_kv_bytes * len(out)
        return out

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
        assert node.kv_ref == 0 and node.pages is not None
        self.kv_q.discard(node)
        ev, ppb, owner, free_page = self._evictable_pages, self._ppb, self.page_owner, self.arena.free_page
        for p in node.pages:
            ev[p // ppb] -= 1
            del owner[p]
            free_page(p)
        self._account("kv", node, self.node_kv_bytes)  # the hook still sees node.pages
        node.pages = None
        if node.snap < 0:
            del self.nodes[node.digest]

    def evict_snapshot(self, node: Node) -> None:
        """Drop ``node``'s snapshot (it must be unpinned)."""
        self.version += 1
        assert node.snap_ref == 0 and node.snap >= 0
        self.snap_q.discard(node)
        self.arena.free_slot(node.snap)
        self._account("state", node, self.snap_bytes)  # the hook still sees node.snap
        node.snap = -1
        if node.pages is None:
            del self.nodes[node.digest]

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

    def _marconi_next(self, pred: Callable[[Node], bool] | None) -> tuple[str, Node] | None:
        """Next entry of the cached Marconi ranking that is still evictable (and, for KV,
        satisfies ``pred``), re-ranking once when the ranking is used up. Entries skipped
        for ``pred`` keep their place at the low end of the ranking."""
        for attempt in range(2):
            ranking, skipped, found = self._marconi_ranked, [], None
            while ranking:
                kind, node = ranking.pop()
                q = self.kv_q if kind == "kv" else self.snap_q
                if node not in q.eff:  # type: ignore[attr-defined]
                    continue
                if pred is not None and kind == "kv" and not pred(node):
                    skipped.append((kind, node))
                    continue
                found = (kind, node)
                break
            ranking.extend(reversed(skipped))
            if found is not None or attempt:
                return found
            ranked = marconi_ranking(
                {"kv": self.kv_q, "state": self.snap_q},  # type: ignore[dict-item]
                self.marconi_alpha,
                self.marconi_window,
            )
            self._marconi_ranked = ranked[::-1]  # pop() from the end = lowest utility
        return None

    def _choose(self, pred: Callable[[Node], bool] | None, aside: list) -> tuple[str, Node] | None:
        """The lowest-ranked evictable entry; KV entries must satisfy ``pred`` if given
        (see :meth:`EvictionQueue.first` for ``aside``)."""
        if self.eviction == "marconi":
            # Marconi ranks a bounded window of candidates: if none of its KV candidates
            # is in an unpinned slab, take its best entry rather than stall.
            got = self._marconi_next(pred)
            return got if got is not None or pred is None else self._marconi_next(None)
        a = self.kv_q.first(pred, aside) if pred is not None else self.kv_q.peek()
        b = self.snap_q.peek()
        if a is None and b is None:
            return None
        if b is None or (a is not None and a[0] <= b[0]):
            return "kv", a[1]  # type: ignore[index,return-value]
        return "state", b[1]  # type: ignore[return-value]

    def _in_unpinned_slab(self, node: Node) -> bool:
        """Evicting ``node`` brings a free block closer: one of its slabs holds only
        evictable pages (no running request's page, cached or private)."""
        ev, used, ppb = self._evictable_pages, self.arena.used_per_block, self._ppb
        for p in node.pages:  # type: ignore[union-attr]
            b = p // ppb
            if ev[b] == used[b]:
                return True
        return False

    def evict_one(self, for_slot: bool, aside: list | None = None) -> bool:
        """Evict the lowest-ranked entry; returns False when nothing is evictable.

        Args:
            for_slot: the caller needs a state slot (an empty block when snapshots are
                larger than pages): KV victims come only from slabs no request pins.
            aside: KV entries of pinned slabs skipped so far in this allocation; the
                caller puts them back in the queue (``kv_q.put_back``) when it is done.
        """
        pred = None
        if for_slot and self.arena.layout.pages_per_block > 1:
            pred = self._in_unpinned_slab
        if aside is None:
            own: list = []
            choice = self._choose(pred, own)
            if own:
                self.kv_q.put_back(own)
        else:
            choice = self._choose(pred, aside)
        if choice is None:
            return False
        kind, node = choice
        if kind == "state":
            self.snap_q.evicted(node)  # a GreedyDual victim ages the clock
            self.evict_snapshot(node)
        else:
            self.kv_q.evicted(node)
            self.evict_kv(node)
        return True

    def alloc_page(self) -> int | None:
        """A page, evicting as needed; ``None`` when nothing more can be evicted."""
        while True:
            p = self.arena.alloc_page()
            if p is not None:
                return p
            if not self.evict_one(for_slot=False):
                return None

    def alloc_pages(self, n: int) -> list[int]:
        """``n`` pages, evicting as needed; fewer when nothing more can be evicted."""
        out = self.arena.alloc_pages(n)
        while len(out) < n:
            if not self.evict_one(for_slot=False):
                break
            out += self.arena.alloc_pages(n - len(out))
        return out

    def alloc_slot(self) -> int | None:
        """A state slot, evicting as needed; ``None`` when nothing more can be evicted
        (or only KV in slabs that running requests pin, which would free no block)."""
        s = self.arena.alloc_slot()
        if s is not None:
            return s
        # Pinned-slab KV entries are set aside once for the whole loop (or the whole
        # slot_batch), not rescanned for every victim.
        batch = self._aside is not None
        aside: list = self._aside if batch else []  # type: ignore[assignment]
        try:
            arena = self.arena
            while s is None:
                if not self.evict_one(for_slot=True, aside=aside):
                    return None
                if arena.may_have_slot():
                    s = arena.alloc_slot()
            return s
        finally:
            if aside and not batch:
                self.kv_q.put_back(aside)

    @contextmanager
    def slot_batch(self) -> Iterator[None]:
        """Slot allocations inside share one set-aside list: nothing pins or unpins a slab
        in between (no page is allocated or held), so a pinned entry stays pinned."""
        if self._aside is not None:
            yield
            return
        self._aside = []
        try:
            yield
        finally:
            aside, self._aside = self._aside, None
            if aside:
                self.kv_q.put_back(aside)

    def clear(self) -> int:
        """Evict every evictable entry; returns how many were evicted."""
        n = 0
        while self.evict_one(for_slot=False):
            n += 1
        return n

    def kv_run(self, digests: list[Digest], max_units: int) -> list[Node]:
        """Nodes of the longest run of units, from the first, that have KV (at most
        ``max_units``): the pages a request can reuse, in unit order."""
        get = self.nodes.get
        run: list[Node] = []
        append = run.append
        for d in digests[:max_units]:
            node = get(d)
            if node is None or node.pages is None:
                break
            append(node)
        return run

    def walk(self, digests: list[Digest], max_units: int) -> tuple[int, int, Node | None]:
        """Longest KV run and deepest snapshot on it.

        Returns:
            ``(kv_units, snap_units, snap_node)``: units from the start that have KV (capped
            at ``max_units``), the end of the deepest of them that has a snapshot, and that
            node (``None`` if there is none).
        """
        run = self.kv_run(digests, max_units)
        return (len(run), *deepest_snapshot(run))


def deepest_snapshot(run: list[Node]) -> tuple[int, Node | None]:
    """``(units, node)``: the end of the deepest node of ``run`` with a snapshot."""
    for i in range(len(run) - 1, -1, -1):
        if run[i].snap >= 0:
            return i + 1, run[i]
    return 0, None
