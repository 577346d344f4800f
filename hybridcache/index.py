"""Prefix index: unit digest -> cached KV pages and state snapshot, with eviction.

A hash unit of a prefix is named by its digest (which names the whole prefix up to the
unit's end). It may have KV pages (one per attention group) and, at most, one state
snapshot: the recurrent state after the unit's last token. The two are held and evicted
separately (SGLang's separate KV/state locks and LRU lists):

- KV lives in *runs* (units registered together, :mod:`hybridcache.runs`); ``heads`` maps
  the first unit of every run to the run. A walk enters every run at its first unit, so
  no other unit needs an entry (see :meth:`PrefixIndex.kv_path`). A run's holds count the
  running requests whose block tables use its pages; only unheld units can lose their KV.
- A :class:`UnitHandle` is a handle on one unit, made on demand: every snapshot has one (its
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

from collections.abc import Mapping, Sequence

from hybridcache.arena import Arena
from hybridcache.events import DEVICE, REMOVED, STORED, CacheEvent, EventLog
from hybridcache.eviction import Evictor
from hybridcache.index_walks import ChainWalks
from hybridcache.pending_saves import PendingSaves
from hybridcache.policies import PolicySettings, build_policy
from hybridcache.policy import EvictionQueue
from hybridcache.runs import (
    Hold,
    Run,
    pop_tail,
    pop_tail_range,
    shift_blocks,
    split,
    truncate_holds,
    uncached_stretch,
)
from hybridcache.seen_prefixes import SeenPrefixes
from hybridcache.sliding import SlidingWindowCache
from hybridcache.unit_handle import Node, UnitHandle
from hybridcache.unit_view import UnitView

__all__ = ["Digest", "Hold", "Node", "PrefixIndex", "UnitHandle", "UnitView", "truncate_holds"]

Digest = bytes


def _snap_evictable(node: UnitHandle) -> bool:  # type: ignore[misc]
    return node.snap_ref == 0 and node.snap >= 0


class PrefixIndex(ChainWalks):
    """Digest -> run (KV) and handle (snapshot); victims are chosen, and pages and slots
    allocated under pressure, by its :class:`~hybridcache.eviction.Evictor`; walks along a
    chain's digests are :class:`~hybridcache.index_walks.ChainWalks`'."""

    def __init__(
        self,
        arena: Arena,
        eviction: str,
        flops_per_byte_scale: float,
        marconi_alpha: float = 1.0,
        marconi_window: int = 64,
        kv_groups: Sequence[str] | None = None,
    ) -> None:
        self.arena = arena
        #: The first unit of every run -> the run. A walk enters every run at its first
        #: unit (see kv_path), so the other units need no entry: registering a request's
        #: units adds at most one.
        self.heads: dict[Digest, Run] = {}
        #: Units that runs branch off: digest of the unit a run's first unit follows -> how
        #: many runs do (and each such run's head -> that digest). A run's tail with a
        #: branch off it is on the path of the branch's snapshots: not stranded.
        self.branches: dict[Digest, int] = {}
        self._branch_of: dict[Digest, Digest] = {}
        #: Units that have a handle: every snapshot, and KV units someone asked for (a
        #: victim, a per-unit queue's entry, a lookup). At most one handle per digest. A
        #: handle stays while its unit has KV, also after its snapshot is evicted: it keeps
        #: the unit's snapshot hits, which rank a snapshot registered there again (dropping
        #: them cost 0.008 of hit rate on the demo at 1 GiB).
        self.handles: dict[Digest, UnitHandle] = {}
        #: The handles without KV (snapshot only), checked when units are registered.
        self.bare: dict[Digest, UnitHandle] = {}
        #: Every unit as a ``digest -> UnitHandle`` mapping (see :class:`UnitView`).
        self.nodes = UnitView(self)
        # Bumped whenever an entry is registered or evicted: a walk with an equal version
        # would see exactly the same units, so callers may reuse it.
        self.version = 0
        self.eviction = eviction
        # For slot allocation (eviction.py): registered KV pages per block (invariant: the
        # pages of every run, counted per block), and the runs that requests hold
        # (invariant: exactly the runs with ``held > 0``; their held prefixes pin blocks).
        self._registered = [0] * arena.layout.num_blocks
        self._held_runs: set[Run] = set()
        self._ppb = max(arena.layout.pages_per_block, 1)
        #: Where events are appended while calls run (hybridcache.events: taken out by
        #: engines, or seen by observers passed to a port); ``None``: not recorded.
        self.events: EventLog | None = None
        #: The seen-branch rule's record (hybridcache.seen_prefixes), fed each unit whose KV
        #: is evicted; set by the manager while the rule is on.
        self.seen: SeenPrefixes | None = None
        #: Save points of the step being allocated that a later allocation may take back
        #: (hybridcache.pending_saves); ``None`` until the engine allows it.
        self.pending_saves: PendingSaves | None = None
        lay = arena.layout
        # The full-attention (and MLA) groups whose pages runs hold; sliding-window groups
        # are cached apart (hybridcache.sliding), in ``sliding``.
        self._kv_groups = tuple(lay.page_payload) if kv_groups is None else tuple(kv_groups)
        self.kv_groups = len(self._kv_groups)  # pages per KV unit
        #: The sliding-window caches (hybridcache.sliding; none without sliding windows): a
        #: unit whose full KV is evicted loses its sliding pages too.
        self.sliding: list[SlidingWindowCache] = []
        self._state_groups = tuple(dict.fromkeys(p.group for p in lay.placements))
        #: Bytes of cached entries per tenant (invariant: the recount of runs and snapshots).
        self.tenant_bytes: dict[str | None, int] = {}
        #: Counts that size an allocation before it takes anything (hybridcache.room):
        #: registered KV units (invariant: ``sum(len(run))``; the held ones are summed
        #: over ``_held_runs`` when needed), registered snapshots and those of them with
        #: ``snap_ref > 0``.
        self.kv_units = 0
        self.snapshots = 0
        self.pinned_snapshots = 0
        self.evictions = {"kv": 0, "state": 0}
        #: Snapshots evicted while ranked first (spares, demoted, superseded): of
        #: ``evictions["state"]``, those that were no rule's valued entry (shadow_backlog).
        self.floor_evictions = 0
        self.evicted_bytes = {"kv": 0, "state": 0}
        lay = arena.layout
        self.node_kv_bytes = lay.page_bytes * self.kv_groups
        self.snap_bytes = lay.slot_bytes
        self._policy_args = (flops_per_byte_scale, marconi_alpha, marconi_window)
        self.install_policy(eviction)

    def install_policy(self, eviction: str, marconi_alpha: float | None = None) -> None:
        """Build the eviction policy called ``eviction`` and bind its evictor here.

        Called once at construction, and by :func:`hybridcache.policy_switch.switch_eviction`
        to change the policy of a live index (which then ranks the cached entries into the
        new queues). ``marconi_alpha``: a new utility weight (``None`` keeps the index's)."""
        scale, alpha, window = self._policy_args
        if marconi_alpha is not None:
            alpha = marconi_alpha
            self._policy_args = (scale, alpha, window)
        self.eviction = eviction
        settings = PolicySettings(scale, self.node_kv_bytes, _snap_evictable, alpha, window)
        #: Chooses victims and allocates with eviction (the policy's queues, the arena).
        self.evictor = ev = Evictor(self, self.arena, build_policy(eviction, settings))
        self.kv_q: EvictionQueue = ev.kv_q
        self.snap_q: EvictionQueue = ev.snap_q
        self.kv_q.unit = self.handle  # victims, and a per-unit queue's keys, are handles
        # Allocation with eviction is the evictor's; bound here for the index's callers.
        self.alloc_page = ev.alloc_page
        self.alloc_pages = ev.alloc_pages
        self.alloc_slot = ev.alloc_slot
        self.slot_from_demoted = ev.slot_from_demoted
        self.slot_batch = ev.slot_batch
        self.evict_one = ev.evict_one
        self.clear = ev.clear
        self._in_unpinned_slab = ev.in_unpinned_slab
        if self.snap_bytes and hasattr(self.kv_q, "stranded"):
            self.kv_q.stranded = self._stranded_tail  # type: ignore[attr-defined]

    def check_invariants(self) -> None:
        """Recount the invariants written at the fields above (:mod:`hybridcache.invariants`)."""
        from hybridcache.invariants import check_index

        check_index(self)

    def _stranded_tail(self, run: Run, pos: int = -1) -> bool:
        """KV and state valued as one: a run's tail without a snapshot, and with no run
        branching off it, is KV past the last snapshot on every path through it, which no
        hit can use until a state exists there. ``pos``: the unit that would be the tail
        once the units past it are evicted (a range eviction ranks it before it is)."""
        d = run.digests[pos]
        node = self.handles.get(d)
        return (node is None or node.snap < 0) and d not in self.branches

    # ------------------------------------------------------------------ units
    def handle(self, run: Run, pos: int) -> UnitHandle:
        """The handle of the unit at ``pos`` of ``run`` (made and kept on first use)."""
        d = run.digests[pos]
        node = self.handles.get(d)
        if node is None:
            node = self.handles[d] = UnitHandle(d, run.first + pos, run.tenant, run)
        return node

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
                self.evictor.pinned_stale = True
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
            q.on_release(run, end, tick)
            if c or end != run.held:
                continue
            new = max(h) if h else 0
            if new == end:
                continue
            run.held = new
            if not new:
                self._held_runs.discard(run)
            self.evictor.pinned_stale = True
            q.release_range(run, new, end, tick, self.node_kv_bytes)

    def count_hits(self, holds: Sequence[Hold]) -> None:
        """A request's hit on these holds was served: every unit in them gains a hit."""
        for run, end in holds:
            run.hits[end] = run.hits.get(end, 0) + 1

    def pin_snapshot(self, node: UnitHandle) -> None:
        """A copy plan will read ``node``'s snapshot: keep it until :meth:`unpin_snapshot`."""
        if node.snap_ref == 0:
            self.snap_q.hold(node)
            if node.snap >= 0:
                self.pinned_snapshots += 1
        node.snap_ref += 1

    def unpin_snapshot(self, node: UnitHandle, tick: int) -> None:
        node.snap_ref -= 1
        if node.snap_ref < 0:
            raise AssertionError(f"negative snap_ref on {node}")
        if node.snap_ref == 0 and node.snap >= 0:
            self.pinned_snapshots -= 1
            # What a policy switch re-ranks by (hybridcache.policy_switch).
            node.snap_tick, node.snap_demoted, node.snap_queued_hits = tick, False, node.snap_hits
            node.snap_superseded = False  # it served a hit: ranked as any entry again
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
        tokens: bytes | bytearray | None = None,
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
            tokens: the token bytes of units ``[first, end)`` (the same size per unit), kept
                by the run so that a prompt with equal tokens reuses its digests; ``None``:
                unknown (the run then keeps none).

        Returns:
            ``(hold, count)``: the caller's hold on the units' run, which now covers it up
            to the last of them, and how many were registered; ``None`` if none was (unit
            ``first`` has KV already).
        """
        heads = self.heads
        ds = uncached_stretch(heads, digests, first, end)
        if not ds:
            return None
        run = self._extendable(after, digests, first, flops)
        fresh = run is None
        if fresh:
            run = Run(flops, len(tables), first, tenant)
        self.version += 1
        n = len(ds)
        self.kv_units += n
        self.tenant_bytes[tenant] = self.tenant_bytes.get(tenant, 0) + self.node_kv_bytes * n
        stop = first + n
        if len(tables) == 1 and type(tables[0]) is list:  # one group: no comprehension
            per_group = [tables[0][first:stop]]
        else:
            per_group = [
                t[first:stop] if isinstance(t, list) else [t[i] for i in range(first, stop)]  # type: ignore[misc]
                for t in tables
            ]
        if tokens is not None and n < end - first:
            tokens = tokens[: len(tokens) // (end - first) * n]
        run.extend(ds, per_group, self._ppb, tokens)
        if self.events is not None:
            self.events.append(CacheEvent(
                STORED, "kv", DEVICE, tuple(ds), first, self._kv_groups, tenant,
                tuple(zip(*per_group)), flops,
            ))
        if fresh:
            heads[ds[0]] = run
            if first and self.snap_bytes:
                parent = digests[first - 1]
                self.branches[parent] = self.branches.get(parent, 0) + 1
                self._branch_of[ds[0]] = parent
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
        self.evictor.pinned_stale = True
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

    def register_snapshot(self, node: UnitHandle, slot: int, flops: float, tick: int) -> None:
        """Make ``slot`` the cached snapshot at the end of ``node``'s unit (evictable now).

        ``node`` is the unit's handle (:meth:`handle`, :meth:`unit`)."""
        self.version += 1
        assert node.snap < 0, "register_snapshot on a node that has a snapshot"
        assert self.handles.get(node.digest) is node, "register_snapshot on a foreign handle"
        node.snap = slot
        node.snap_flops = flops
        self.snapshots += 1
        self.pinned_snapshots += node.snap_ref > 0
        if self.events is not None:
            self.events.append(CacheEvent(
                STORED, "state", DEVICE, (node.digest,), node.depth, self._state_groups,
                node.tenant, (slot,), flops,
            ))
        self.tenant_bytes[node.tenant] = self.tenant_bytes.get(node.tenant, 0) + self.snap_bytes
        # What a policy switch re-ranks by (hybridcache.policy_switch).
        node.snap_tick, node.snap_demoted, node.snap_queued_hits = tick, False, node.snap_hits
        node.snap_superseded = False
        node.snap_base = -1  # a spare checkpoint's registrar sets it after (CommitRegistrar)
        if node.snap_ref == 0:
            self.snap_q.add(node, tick, flops, self.snap_bytes, node.snap_hits)
        if node.run is not None:
            self.kv_q.run_changed(node.run)  # a stranded tail may be usable now

    def demote_snapshot(self, node: UnitHandle) -> None:
        """Rank ``node``'s queued snapshot at the floor of both queues, before every entry
        ranked above it. KV at the floor (stranded tails) wins the tie, so where all KV is
        stranded a page allocation takes it first (``tests/core/test_demoted_ties.py``)."""
        node.snap_demoted = True  # kept through a policy switch (hybridcache.policy_switch)
        self._rank_first(node)

    def supersede_snapshot(self, node: UnitHandle) -> None:
        """Record that a session went past ``node``'s queued snapshot
        (:mod:`hybridcache.superseded`); under value eviction, rank it first as a demoted
        one. Recorded under any policy, so that a switch into value eviction ranks it as a
        manager that had run it all along (:mod:`hybridcache.policy_switch`)."""
        node.snap_superseded = True
        if self.eviction == "value":
            self._rank_first(node)

    def _rank_first(self, node: UnitHandle) -> None:
        floors = [f for f in (self.kv_q.floor(), self.snap_q.floor()) if f is not None]
        if floors:
            self.snap_q.demote(node, min(floors))

    # ------------------------------------------------------------------ eviction
    def evict_kv(self, node: UnitHandle) -> None:
        """Drop ``node``'s KV pages (it must be unreferenced)."""
        self.version += 1
        run = node.run
        assert run is not None, "evict_kv of a unit without KV"
        pos = node.depth - run.first
        assert pos >= run.held
        self.kv_q.discard(node)
        self.kv_units -= 1
        reg, ppb, free_page = self._registered, self._ppb, self.arena.free_page
        for pages in run.pages:
            p = pages[pos]
            reg[p // ppb] -= 1
            free_page(p)
        self._account("kv", node, self.node_kv_bytes)  # the hook still sees node.pages
        if self.seen is not None:
            self.seen.evicted_one(node.digest)
        if self.sliding:  # no path reaches the unit's sliding pages any more
            for cache in self.sliding:
                cache.drop_unit(node.digest)
        if pos == 0:
            self._forget_head(node.digest)
        tail = None
        if pos == len(run.digests) - 1:
            pop_tail(run)
        else:
            tail = split(run, pos, ppb)
        self.kv_q.run_changed(run)
        if tail is not None:
            self.heads[tail.digests[0]] = tail
            if self.snap_bytes:  # a run that registers this unit again continues into it
                self.branches[node.digest] = self.branches.get(node.digest, 0) + 1
                self._branch_of[tail.digests[0]] = node.digest
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

    def evict_tail_range(self, run: Run, k: int, keep_pages: bool = False) -> list[int]:
        """Drop the KV of ``run``'s last ``k`` units (unpinned): what :meth:`evict_kv` of
        each successive tail does, tail first (the same pages freed in the same order, the
        same ``removed`` events and counts), in one pass: one arena call, one fold of the
        run's ends, one queue update. The evictor's choice of the range
        (:meth:`RunValueQueue.tail_range <hybridcache.policies.value.RunValueQueue.tail_range>`)
        already did the queue's per-victim work; sliding-window caches need the per-unit
        path (their pages go with each unit).

        Returns the units' pages, tail first. ``keep_pages``: they stay allocated, handed
        to the caller (a page allocation that would take each freed page straight back).
        """
        n = len(run.digests)
        lo = n - k
        assert 0 < k <= n and lo >= run.held and not self.sliding
        self.version += k
        self.kv_units -= k
        reg, ppb, digests, pages = self._registered, self._ppb, run.digests, run.pages
        freed: list[int] = []
        for pos in range(n - 1, lo - 1, -1):
            for pl in pages:
                p = pl[pos]
                reg[p // ppb] -= 1
                freed.append(p)
        if not keep_pages:
            if k == 1 and len(freed) == 1:  # one unit (a stranded tail's turn): no batch checks
                self.arena.free_page(freed[0])
            else:
                self.arena.free_pages(freed)
        nbytes = self.node_kv_bytes
        self.evictions["kv"] += k
        self.evicted_bytes["kv"] += k * nbytes
        left = self.tenant_bytes.pop(run.tenant, 0) - k * nbytes
        if left:
            self.tenant_bytes[run.tenant] = left
        if self.events is not None:
            self._removed_range_events(run, lo)
        if self.seen is not None:
            self.seen.evicted(digests[lo:n])
        if lo == 0:
            self._forget_head(digests[0])
        handles, bare = self.handles, self.bare
        if handles:
            for pos in range(n - 1, lo - 1, -1):  # tail first, as single evictions go
                d = digests[pos]
                node = handles.get(d)
                if node is not None:
                    node.run = None
                    if node.snap < 0:
                        del handles[d]
                    else:
                        bare[d] = node
        if k == 1:
            pop_tail(run)  # what pop_tail_range(run, 1) does, without its folds
        else:
            pop_tail_range(run, k)
        self.kv_q.run_changed(run)
        return freed

    def _removed_range_events(self, run: Run, lo: int) -> None:
        """The ``removed`` events of units ``[lo, len)`` of ``run``, tail first, as
        :meth:`_account` writes them (hits: those of the holds past each unit)."""
        append, hits, n = self.events.append, run.hits, len(run.digests)  # type: ignore[union-attr]
        hsum = 0
        for pos in range(n - 1, lo - 1, -1):
            hsum += hits.get(pos + 1, 0)
            append(CacheEvent(
                REMOVED, "kv", DEVICE, (run.digests[pos],), run.first + pos, self._kv_groups,
                run.tenant, (run.unit_pages(pos),), run.flops, hsum,
            ))

    def _forget_head(self, digest: Digest) -> None:
        """A run's first unit lost its KV: the run has no head, nor a branch it counts."""
        del self.heads[digest]
        parent = self._branch_of.pop(digest, None)
        if parent is not None:
            left = self.branches[parent] - 1
            if left:
                self.branches[parent] = left
            else:
                del self.branches[parent]

    def evict_snapshot(self, node: UnitHandle, keep_slot: bool = False) -> int:
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
        self.snapshots -= 1
        if node.snap_demoted or node.snap_superseded:
            self.floor_evictions += 1
        if not keep_slot:
            self.arena.free_slot(slot)
        if self.events is None:  # _account without an event (one call fewer per victim)
            nbytes = self.snap_bytes
            self.evictions["state"] += 1
            self.evicted_bytes["state"] += nbytes
            left = self.tenant_bytes.pop(node.tenant, 0) - nbytes
            if left:
                self.tenant_bytes[node.tenant] = left
        else:
            self._account("state", node, self.snap_bytes)  # the hook still sees node.snap
        node.snap = -1
        for cache in self.sliding:  # the window before it may serve no hit now
            cache.snapshot_evicted(node, self.handles)
        if node.run is None:
            del self.handles[node.digest]
            del self.bare[node.digest]
        else:
            self.kv_q.run_changed(node.run)  # its run's tail may be stranded now

        return slot if keep_slot else -1

    def _account(self, kind: str, node: UnitHandle, nbytes: int) -> None:
        """Count an eviction and append its ``removed`` event.

        The event is appended after the arena freed the entry and before the index forgets
        it: its locations still name the freed pages / slot, whose bytes stay intact until
        the engine next writes the arena (an offload tier's observer copies them out here).
        """
        self.evictions[kind] += 1
        self.evicted_bytes[kind] += nbytes
        left = self.tenant_bytes.pop(node.tenant, 0) - nbytes  # 0-byte KV: models without attention
        if left:  # a tenant with nothing cached is dropped: ids must not pile up
            self.tenant_bytes[node.tenant] = left
        if self.events is not None:
            kv = kind == "kv"
            self.events.append(CacheEvent(
                REMOVED, kind, DEVICE, (node.digest,), node.depth,
                self._kv_groups if kv else self._state_groups, node.tenant,
                (node.pages,) if kv else (node.snap,),
                node.kv_flops if kv else node.snap_flops, node.kv_hits if kv else node.snap_hits,
            ))
