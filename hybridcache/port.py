"""The engine port: everything an engine (vLLM, SGLang, the simulator, an offload tier) does
with the cache, as one documented interface (``docs/api.md``).

An engine holds an :class:`EnginePort` over a :class:`~hybridcache.manager.HybridCacheManager`
and calls nothing else: the manager's index, arena, queues and request records are its
internals and change without notice. The port gives

- the request path: :meth:`add_request`, :meth:`match`, :meth:`allocate` (copy plan, save
  points), :meth:`append_tokens`, :meth:`commit`, :meth:`accept`, :meth:`free`;
- planned saves: :meth:`planned_save_points` (where admission will want snapshots in a
  range, also before the first allocation), :meth:`save_in_running_slot`,
  :meth:`cancel_save`, :meth:`take_save_slot` / :meth:`release_slot`;
  :meth:`allow_save_withdrawal` / :meth:`take_withdrawn_saves` (a batching engine's save
  points taken back within a step, :mod:`hybridcache.pending_saves`);
- read-only views: :meth:`request` (a :class:`RequestView`), :meth:`digests`,
  :meth:`block_tables`, :meth:`cached_prefix`, :meth:`snapshot_slot`, :meth:`device_prefix`;
- :meth:`pin_snapshot` / :meth:`unpin_snapshot`: keep a snapshot a running step still
  reads (its slot is the step's input) from eviction;
- engine-owned memory: :meth:`take_page` / :meth:`release_page`, :meth:`take_slot` /
  :meth:`release_slot`, :meth:`reserve_page` and :attr:`free_blocks` (blocks an engine
  keeps its own copies in, e.g. vLLM's sub-block tails and speculative state columns);
  :meth:`move_save_to` hands an engine slot to a save point;
- :meth:`import_prefix`: register a prefix whose bytes a tier loaded into the arena
  (:class:`~hybridcache.port_import.PrefixImport`);
- :meth:`take_events`: the event stream (:mod:`hybridcache.events`); :meth:`subscribe`
  opens an independent queue of it for a second consumer, and an ``observer`` passed in at
  construction sees each event synchronously (an offload tier copying a removed entry's
  bytes out before the same call hands its pages to another request).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from hybridcache import validation
from hybridcache.admission import admission_points
from hybridcache.arena import ArenaLayout
from hybridcache.config import CacheConfig
from hybridcache.errors import InvalidRequestError
from hybridcache.events import CacheEvent, EventLog, EventQueue, Observer, cleared_event
from hybridcache.hashing import MultiModalItem
from hybridcache.invariants import check_manager
from hybridcache.pending_saves import WithdrawnSave
from hybridcache.plans import Allocation, MatchResult
from hybridcache.port_views import CachedPrefix as CachedPrefix
from hybridcache.port_views import DevicePrefix as DevicePrefix
from hybridcache.port_views import RequestView as RequestView
from hybridcache.port_views import SnapshotPin as SnapshotPin
from hybridcache.room import fits
from hybridcache.runs import hold_tables
from hybridcache.spec import ModelSpec

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.index import UnitHandle
    from hybridcache.manager import HybridCacheManager
    from hybridcache.port_import import PrefixImport


class EnginePort:
    """The interface an engine uses (module docstring)."""

    def __init__(
        self,
        manager: HybridCacheManager,
        *,
        record_events: bool = True,
        observer: Observer | None = None,
    ) -> None:
        """``record_events``: keep the default queue :meth:`take_events` reads (one per
        manager, shared by its ports). ``observer``: called with every event as it happens,
        inside the cache call (see :class:`~hybridcache.events.EventLog` for its contract);
        :meth:`close` detaches it."""
        self._m = manager
        # Pages and slots the engine owns (take_page, reserve_page, take_slot,
        # take_save_slot): only these can be released through the port, and the invariant
        # check counts them as owned.
        self._engine_pages: set[int] = set()
        self._engine_slots: set[int] = set()
        self._observer = observer
        # The pure pass-throughs of the request path are bound to the manager's own
        # methods (unless a subclass overrides them): an engine calls them per request and
        # step, and the port then adds no call frame there. The methods below document them.
        for name in _PASS_THROUGH:
            if getattr(type(self), name) is getattr(EnginePort, name):
                setattr(self, name, getattr(manager, name))
        if record_events:
            self._log().default_queue()
        if observer is not None:
            self._log().observe(observer)

    def _log(self) -> EventLog:
        """The manager's event log, installed on first use (until then the index records
        nothing: its hot path pays one ``is None`` test)."""
        index = self._m.index
        log = index.events
        if not isinstance(log, EventLog):
            log = EventLog()
            index.events = log  # type: ignore[assignment]
        return log

    # ------------------------------------------------------------------ properties
    @property
    def spec(self) -> ModelSpec:
        return self._m.spec

    @property
    def config(self) -> CacheConfig:
        return self._m.config

    @property
    def layout(self) -> ArenaLayout:
        """Byte geometry of the arena (where pages and slots sit in the engine's buffer)."""
        return self._m.layout

    @property
    def unit(self) -> int:
        """Tokens per hash unit (and per KV page)."""
        return self._m.unit

    @property
    def attention_groups(self) -> tuple[str, ...]:
        return tuple(self._m.groups) + tuple(self._m.sliding_groups)  # full, then sliding

    @property
    def has_state(self) -> bool:
        return self._m.has_state

    @property
    def unit_kv_bytes(self) -> int:
        """Bytes of one unit's KV (every attention group)."""
        return self._m.index.node_kv_bytes

    @property
    def snapshot_bytes(self) -> int:
        return self._m.index.snap_bytes

    @property
    def step_count(self) -> int:
        """Advances with every call that can hold, release or register entries (a cheap
        'did anything happen since' for observers)."""
        return self._m.tick

    def tenant_bytes(self, tenant: str | None) -> int:
        """Bytes of cached entries the tenant holds on the device."""
        return self._m.index.tenant_bytes.get(tenant, 0)

    def usage(self) -> tuple[int, int]:
        """``(pages_in_use, slots_in_use)`` of the arena (cached entries included)."""
        a = self._m.arena
        return a.pages_in_use, a.slots_in_use

    def stats(self) -> dict[str, object]:
        return self._m.stats()

    # ------------------------------------------------------------------ request path
    def add_request(
        self,
        request_id: str,
        token_ids: Sequence[int] | np.ndarray,
        *,
        tenant: str | None = None,
        lora: str | int | None = None,
        mm_items: Sequence[MultiModalItem] = (),
        digests: Sequence[bytes] | None = None,
    ) -> MatchResult:
        return self._m.add_request(
            request_id, token_ids, tenant=tenant, lora=lora, mm_items=mm_items, digests=digests
        )

    def match(self, request_id: str) -> MatchResult:
        return self._m.match(request_id)

    def allocate(self, request_id: str, num_new_tokens: int, *, num_draft: int = 0) -> Allocation:
        return self._m.allocate(request_id, num_new_tokens, num_draft=num_draft)

    def append_tokens(self, request_id: str, token_ids: Sequence[int] | np.ndarray) -> None:
        self._m.append_tokens(request_id, token_ids)

    def commit(self, request_id: str, num_computed_tokens: int) -> None:
        self._m.commit(request_id, num_computed_tokens)

    def accept(self, request_id: str, num_accepted: int, *, keep_pages: bool = False) -> None:
        """Keep the first ``num_accepted`` inputs of the last step (speculative decoding).

        ``keep_pages``: the pages past the accepted tokens stay with the request instead of
        being freed (an engine whose block tables are append-only, as vLLM's worker: a page
        given for a draft position stays in its table and receives that position's KV
        again next step). They are registered only once computed, like any page, and freed
        with the request. A refused call changes nothing.
        """
        if not keep_pages:
            self._m.accept(request_id, num_accepted)
            return
        m = self._m
        req = m._get(request_id)
        n = validation.as_count(num_accepted, "num_accepted")
        keep = max(-(-(req.step_start + n) // m.unit), req.units)
        spare = [t[keep:] for t in req.pages]
        allocated = req.units_allocated
        for t in req.pages:
            del t[keep:]
        req.units_allocated = min(allocated, keep)
        try:
            m.accept(request_id, n)
        finally:  # accepted or refused, the pages past ``keep`` are the request's again
            for t, extra in zip(req.pages, spare):
                t.extend(extra)
            req.units_allocated = allocated

    def free(self, request_id: str, *, finished: bool = True) -> None:
        self._m.free(request_id, finished=finished)

    def clear(self) -> int:
        """Evict every unheld entry (``removed`` events, then one ``cleared``)."""
        n = self._m.clear()
        events = self._m.index.events
        if events is not None:
            events.append(cleared_event())
        return n

    # ------------------------------------------------------------------ saves
    def planned_save_points(self, request_id: str, start: int, end: int) -> list[tuple[int, bool]]:
        """Boundaries in ``(start, end]`` where admission wants a snapshot, as
        ``(boundary, rolling)``; for a request not allocated yet, with the prompt length
        and hit its first allocation would see. Read-only."""
        req = self._m._get(request_id)
        view: object = req
        if not req.allocated:
            match = self._m.match(request_id)
            m = self._m
            start_at = (m.suffix_starts.preview(req, match.kv_hit_tokens, match.hit_tokens, m.unit)
                        if m.admission.suffix_start else 0)
            rec = m.index.seen if m.admission.seen_branch else None
            seen = rec.point(req, match.kv_hit_tokens, match.hit_tokens, m.unit) if rec is not None else 0
            view = _Unallocated(req.num_tokens, match.kv_hit_tokens, match.hit_tokens, start_at, seen)
        return admission_points(self._m.admission, view, start, end, self._m.unit)  # type: ignore[arg-type]

    def save_in_running_slot(self, request_id: str, boundary: int) -> int:
        return self._m.save_in_running_slot(request_id, boundary)

    def cancel_save(self, request_id: str, boundary: int) -> None:
        self._m.cancel_save(request_id, boundary)

    def allow_save_withdrawal(self) -> None:
        """Declare that this engine allocates a batch of requests before it runs a step and
        drops the save points :meth:`take_withdrawn_saves` lists: a later request of the
        step then takes back pending spare checkpoints before it evicts, and any pending
        save point before it is refused (:mod:`hybridcache.pending_saves`). For the
        manager, so for every port over it."""
        self._m.allow_save_withdrawal()

    def take_withdrawn_saves(self) -> list[WithdrawnSave]:
        """The save points withdrawn since the last call, oldest first: call it after the
        step's allocations and before the step runs, and write none of them."""
        return self._m.take_withdrawn_saves()

    def take_save_slot(self, request_id: str, boundary: int) -> int:
        """Take a pending save point's slot out of the request: no snapshot is registered
        there, and the engine owns the slot until :meth:`release_slot` (it still computes
        in it)."""
        req = self._m._get(request_id)
        slot = req.saves.pop(boundary, None)
        if slot is None:
            raise InvalidRequestError(f"request {request_id!r}: no save point at {boundary}")
        self._engine_slots.add(slot)
        return slot

    def move_save_to(self, request_id: str, boundary: int, slot: int, *, turn_end: bool = False) -> None:
        """The engine wrote the state at ``boundary`` into ``slot`` (one it owns) instead of
        the save point's own slot: the save point takes ``slot``, and the slot it had is
        freed. ``turn_end``: the request's turn-end save (:attr:`RequestView.rolling_slot`)
        rather than a snapshot save point. Why: vLLM's speculative steps write each
        position's state into a block column of its own, so the state is already there.
        """
        req = self._m._get(request_id)
        if slot not in self._engine_slots:
            raise InvalidRequestError(f"slot {slot} is not the engine's")
        if turn_end and req.rolling_slot >= 0 and boundary == req.rolling_boundary:
            old, req.rolling_slot = req.rolling_slot, slot
        elif not turn_end and boundary in req.saves:
            old, req.saves[boundary] = req.saves[boundary], slot
        else:
            what = "turn-end save" if turn_end else "save point"
            raise InvalidRequestError(f"request {request_id!r}: no {what} at {boundary}")
        self._engine_slots.discard(slot)
        self._m.arena.free_slot(old)

    # ------------------------------------------------------------------ engine-owned memory
    @property
    def free_blocks(self) -> int:
        """Arena blocks nobody uses: each holds ``layout.pages_per_block`` pages or
        ``layout.slots_per_block`` slots (what :meth:`take_page` / :meth:`take_slot` can
        have without eviction, give or take the free entries of open blocks)."""
        return self._m.arena.free_block_count

    def take_page(self) -> int | None:
        """A free page the engine owns until :meth:`release_page`, or ``None``: never
        evicts (an engine's own copies live in memory nothing else wants)."""
        page = self._m.arena.alloc_page()
        if page is not None:
            self._engine_pages.add(page)
        return page

    def release_page(self, page: int) -> None:
        """Give back a page taken with :meth:`take_page`."""
        if page not in self._engine_pages:
            raise InvalidRequestError(f"page {page} is not the engine's")
        self._engine_pages.discard(page)
        self._m.arena.free_page(page)

    def take_slot(self, *, evict: bool = False) -> int | None:
        """A state slot the engine owns until :meth:`release_slot`, or ``None``.

        ``evict=False``: a free slot only. ``evict=True``: cached entries no request holds
        are evicted for it, as an allocation would; counted first (``None`` then means
        that nothing was evicted).
        """
        m = self._m
        slot = m.arena.alloc_slot()
        if slot is None and evict and fits(m.index, 0, 1):
            slot = m.index.alloc_slot()
        if slot is not None:
            self._engine_slots.add(slot)
        return slot

    def can_allocate(self, request_id: str, num_new_tokens: int, *, num_draft: int = 0,
                     extra_slots: int = 0) -> bool:
        """Whether :meth:`allocate` (same arguments) and ``extra_slots`` more state slots
        (:meth:`take_slots`) can all be served, evicting as they would. Changes nothing.

        The count is :meth:`HybridCacheManager.allocate`'s own (hybridcache.room), with the
        extra slots counted among its slots (taken before the pages, the hit held): an
        engine that needs slots of its own beside a step (vLLM's speculative state
        columns) asks once, before anything is taken, so a refused step evicts nothing.

        Raises:
            InvalidRequestError: bad counts or lengths, as :meth:`allocate` would.
        """
        extra_slots = validation.as_count(extra_slots, "extra_slots")
        return self._m._count_step(request_id, num_new_tokens, num_draft, extra_slots).fits

    def take_slots(self, request_id: str, count: int) -> list[int] | None:
        """``count`` state slots the engine owns until :meth:`release_slot`, evicting
        cached entries no request holds, all or none (``None``: nothing changed).

        Before ``request_id``'s first allocation its hit is held while the slots are
        taken, so they never evict the pages or the snapshot that allocation will hold
        (the slots of a :meth:`can_allocate` that said yes are then always there).
        """
        m = self._m
        count = validation.as_count(count, "count")
        req = m._get(request_id)
        hit = m._hit(req) if not req.allocated else None
        holds, restore = (hit[2], hit[3]) if hit is not None else ((), None)
        if not fits(m.index, 0, count, holds, restore):
            return None
        index = m.index
        index.hold_runs(holds)
        if restore is not None:
            index.pin_snapshot(restore)
        taken: list[int] = []
        try:
            with index.slot_batch():
                for _ in range(count):
                    slot = index.alloc_slot()
                    if slot is None:  # pragma: no cover - the count above rules it out
                        break
                    taken.append(slot)
        finally:
            if restore is not None:
                index.unpin_snapshot(restore, m.tick)
            index.release_runs(holds, m.tick)
        if len(taken) < count:  # pragma: no cover
            for slot in taken:
                m.arena.free_slot(slot)
            return None
        self._engine_slots.update(taken)
        return taken

    def release_slot(self, slot: int) -> None:
        """Give back a slot taken with :meth:`take_slot` or :meth:`take_save_slot`."""
        if slot not in self._engine_slots:
            raise InvalidRequestError(f"slot {slot} is not the engine's")
        self._engine_slots.discard(slot)
        self._m.arena.free_slot(slot)

    def reserve_page(self) -> int:
        """Take one free page out of the cache for good (an engine's null block); raises
        if none is free without eviction."""
        got = self.take_page()
        if got is None:
            raise InvalidRequestError("no free page to reserve")
        return got

    # ------------------------------------------------------------------ views
    def request(self, request_id: str) -> RequestView | None:
        req = self._m.requests.get(request_id)
        return None if req is None else RequestView(req)

    def request_ids(self) -> Iterator[str]:
        return iter(list(self._m.requests))

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._m.requests

    def digests(self, request_id: str) -> Sequence[bytes]:
        """The request's unit digests so far (read-only copy)."""
        return tuple(self._m._get(request_id).hasher.digests)

    def block_tables(self, request_id: str) -> dict[str, list[int]]:
        """The request's pages per attention group (cached and private), copies."""
        req = self._m._get(request_id)
        tables = {g: list(t) for g, t in zip(self._m.groups, req.pages)}
        if req.slide:  # sliding-window groups (hybridcache.coordinator): -1 below the window
            tables.update(self._m.coordinator.tables(req))  # type: ignore[union-attr]
        return tables

    def cached_prefix(self, request_id: str, units: int) -> CachedPrefix:
        """Pages (and the end snapshot) of the request's first ``units`` cached units, as a
        hit would read them; read-only. Raises if the device does not hold them."""
        m = self._m
        digests = m._get(request_id).hasher.digests
        found, holds = m.index.kv_path(digests, units)
        if found < units:
            raise InvalidRequestError(
                f"request {request_id!r}: {units} units asked, {found} cached"
            )
        tables = hold_tables(holds, len(m.groups)) if units else [[] for _ in m.groups]
        slot = self.snapshot_slot(request_id, units * m.unit) if units and m.has_state else -1
        out = dict(zip(m.groups, map(list, tables)))
        if m.coordinator is not None:  # sliding groups: the window before the hit's end
            windows = m.coordinator.window_tables(digests, units)
            if windows is None:
                raise InvalidRequestError(
                    f"request {request_id!r}: a sliding window before unit {units} is not cached"
                )
            out.update(windows)
        return CachedPrefix(units, out, slot)

    def snapshot_slot(self, request_id: str, boundary: int) -> int:
        """Slot of the cached snapshot at ``boundary`` (tokens) on the request's chain,
        ``-1`` if none."""
        node = self._snapshot_handle(request_id, boundary)
        return -1 if node is None else node.snap

    def _snapshot_handle(self, request_id: str, boundary: int) -> UnitHandle | None:
        digests = self._m._get(request_id).hasher.digests
        u = boundary // self._m.unit - 1
        if boundary % self._m.unit or not 0 <= u < len(digests):
            return None
        node = self._m.index.handles.get(digests[u])
        return node if node is not None and node.snap >= 0 else None

    def has_snapshot(self, digest: bytes) -> bool:
        """Whether the unit named by ``digest`` has a cached snapshot on the device."""
        node = self._m.index.handles.get(digest)
        return node is not None and node.snap >= 0

    def device_prefix(self, digests: Sequence[bytes], max_units: int) -> DevicePrefix:
        """What the device holds of a chain (read-only; see :class:`DevicePrefix`)."""
        index = self._m.index
        chain = list(digests)
        kv_units, snap_units, _ = index.walk(chain, max_units)
        has_kv = [False] * max_units
        for run, end in index.chain_holds(chain, 0, max_units):
            has_kv[run.first : run.first + end] = [True] * end
        coordinator = self._m.coordinator
        if coordinator is None:
            hit = snap_units if self._m.has_state else kv_units
        else:
            hit = coordinator.longest_hit(chain, kv_units)[0]
        return DevicePrefix(kv_units, snap_units, has_kv, hit)

    # ------------------------------------------------------------------ pins
    def pin_snapshot(self, request_id: str, boundary: int) -> SnapshotPin | None:
        """Keep the cached snapshot at ``boundary`` from eviction while a running step
        still reads its slot; ``None`` if there is none. Undo with :meth:`unpin_snapshot`."""
        node = self._snapshot_handle(request_id, boundary)
        if node is None:
            return None
        self._m.index.pin_snapshot(node)
        return SnapshotPin(boundary, node.snap, node)

    def unpin_snapshot(self, pin: SnapshotPin) -> None:
        self._m.index.unpin_snapshot(pin.handle, self._m.tick)

    # ------------------------------------------------------------------ imports
    def import_prefix(self, request_id: str) -> PrefixImport:
        """Start registering a prefix a tier loads for a waiting request (see
        :class:`~hybridcache.port_import.PrefixImport`)."""
        from hybridcache.port_import import PrefixImport

        return PrefixImport(self._m, self._m._get(request_id))

    # ------------------------------------------------------------------ events
    def take_events(self) -> list[CacheEvent]:
        """Events since the last call, oldest first (:mod:`hybridcache.events`), from the
        default queue (shared by the manager's ports that record events)."""
        log = self._m.index.events
        if not isinstance(log, EventLog) or not log.has_default:
            return []
        return log.default_queue().take()

    def subscribe(self) -> EventQueue:
        """An independent queue of the event stream from now on: its ``take()`` never
        takes another consumer's events (nor :meth:`take_events`'); ``close()`` it when
        done."""
        return self._log().subscribe()

    def close(self) -> None:
        """Detach the ``observer`` passed in at construction (idempotent)."""
        if self._observer is not None:
            self._log().unobserve(self._observer)
            self._observer = None

    def check_invariants(self) -> None:
        """Check the manager's, index's and arena's invariants (raises ``AssertionError``)."""
        check_manager(self._m, len(self._engine_pages), len(self._engine_slots))


#: Port calls that are the manager's call unchanged (bound per instance, see __init__).
_PASS_THROUGH = ("add_request", "match", "allocate", "append_tokens", "commit", "free",
                 "save_in_running_slot", "cancel_save", "take_withdrawn_saves")


class _Unallocated(NamedTuple):
    """What admission reads of a request before its first allocation."""

    prompt_len: int
    kv_hit_tokens: int
    hit_tokens: int
    suffix_start: int
    seen_branch: int = 0
