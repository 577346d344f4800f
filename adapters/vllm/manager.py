"""Our manager behind the interface vLLM's ``Scheduler`` uses for its ``KVCacheManager``.

How our engine's decisions reach vLLM's worker without touching the worker:

- **KV pages.** One hash unit is one vLLM block (``block_size`` tokens); our page ``p`` is
  vLLM block ``p`` of every attention group (see :func:`.spec.pool_spec`). The block table
  of an attention group is the manager's page table, unchanged.
- **State.** In ``align`` mode vLLM's worker keeps a request's running recurrent state in
  the block of column ``(seq_len - 1) // block_size`` of the Mamba block table and, when a
  step moves to a new column, copies the previous column's block into the new one before
  the forward pass (``preprocess_mamba``). A column's block therefore ends up holding the
  state at the column's end boundary once the request leaves it. The adapter fills the
  columns so that this machinery runs our plan:

  * the column of the hit boundary holds the snapshot's blocks: the worker's own
    copy-on-extend *is* our copy plan ``snapshot -> running slot`` (a cached snapshot is
    read, never written);
  * every column the request enters gets the blocks of the manager's current running slot;
  * when a step ends exactly on a save point, the running slot and the save slot swap
    roles in the manager's request record: the block that has just received the state at
    the boundary becomes the snapshot, and the save slot becomes the running slot that
    the next column (and the worker's next copy) uses. No extra copy is issued.

  The scheduler (:class:`.scheduler.HybridCacheScheduler`) never lets a prefill chunk run
  past a block boundary, so every save point lands on a step end.
- **Commit.** vLLM caches blocks optimistically at allocation; our manager registers
  entries only once computed. The adapter commits a request's tokens at the start of the
  next scheduler step (or when it is freed), after the worker has run the previous step.

The adapter talks to the core only through :class:`hybridcache.port.EnginePort`
(``self.port``): request views, save points, pins, engine-owned slots. ``self.manager``
is the core object the port wraps, kept for construction and white-box tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, KVCacheBlockCopy
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request

from hybridcache.errors import OutOfSpaceError
from hybridcache.hashing import MultiModalItem
from hybridcache.manager import Allocation, CacheConfig, HybridCacheManager, SavePoint
from hybridcache.port import EnginePort, RequestView, SnapshotPin
from hybridcache.spec import FlopModel

from .fine import FineHit, SubBlockHits, TailCache
from .manager_lookups import PrefixLookups
from .manager_queries import BlockQueries
from .spec import flop_model_from_hf, group_roles, pool_block_size, pool_spec
from .views import AdapterStats, BlockPoolView, CoordinatorView, GroupView

logger = init_logger(__name__)

NULL_SLOT = -1


@dataclass
class _Tracked:
    """What the worker was told about one allocated request."""

    request: Request
    view: RequestView  # the core's record of it (live, read-only)
    cols: list[int] = field(default_factory=list)  # state slot per Mamba column (-1: null)
    tables: list[list[int]] = field(default_factory=list)  # block ids per vLLM group
    sent: list[int] = field(default_factory=list)  # block ids per group already returned
    pinned: list[SnapshotPin] = field(default_factory=list)  # snapshots still computed in
    held: list[tuple[int, int]] = field(default_factory=list)  # (boundary, slot) kept alive
    fine_seen: int = 0  # computed tokens the sub-block tails were last told about


class HybridKVCacheManager(PrefixLookups, BlockQueries, SubBlockHits):
    """vLLM ``KVCacheManager`` interface implemented with :class:`HybridCacheManager`.

    Args:
        kv_cache_config: vLLM's cache layout (one block pool; groups of one block size).
        max_model_len: vLLM's maximum sequence length.
        config: our policy (admission, eviction, hashing); ``hash_unit`` and ``alignment``
            are overridden (one unit = one vLLM block).
        hf_config: the model's HF config, for the FLOP model of value-based eviction.
        enable_caching: vLLM's ``enable_prefix_caching``.
        log_stats: collect :class:`PrefixCacheStats` for vLLM's metrics.
        prefix_match_unit: a hash unit below the block (vLLM's ``--prefix-match-unit``):
            hits and states also land inside a block, through sub-block tails (:mod:`.fine`).
    """

    #: vLLM's scheduler allocates the whole batch before the worker runs it, and every
    #: save point here is served in place at a step end (:meth:`_run_save`): a later
    #: request of the step may take an earlier one's back, or a running request's settled
    #: turn-end slot, rather than evict or be refused (:meth:`_drop_withdrawn`).
    #: Subclasses whose saves outlive the allocation (the speculative path's columns, a
    #: connector load's end save) keep it off.
    withdraws_saves = True
    #: vLLM's admission gate (``full_sequence_must_fit``) also counts the pages running
    #: requests' prefills still owe (:meth:`_owed_prefill_blocks`): admitting into that
    #: room only preempts one of them a few steps later. ``False``: vLLM's own gate.
    reserves_prefills = True

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        *,
        max_model_len: int,
        config: CacheConfig | None = None,
        hf_config: Any = None,
        enable_caching: bool = True,
        log_stats: bool = False,
        prefix_match_unit: int | None = None,
    ) -> None:
        self.kv_cache_config = kv_cache_config
        self.block_size = pool_block_size(kv_cache_config)
        self.attn_ids, self.mamba_ids = group_roles(kv_cache_config)
        self.num_groups = len(kv_cache_config.kv_cache_groups)
        self.num_blocks = kv_cache_config.num_blocks
        groups = kv_cache_config.kv_cache_groups
        n_attn = sum(len(groups[i].layer_names) for i in self.attn_ids)
        n_state = sum(len(groups[i].layer_names) for i in self.mamba_ids)
        flops = (
            flop_model_from_hf(hf_config, n_attn, n_state)
            if hf_config is not None
            else FlopModel(1024, n_attn, n_state)
        )
        self.spec = pool_spec(kv_cache_config, flops=flops, max_model_len=max_model_len)
        cfg = dataclasses.replace(config or CacheConfig(), hash_unit=self.block_size, alignment=1)
        self.manager = HybridCacheManager(self.spec, self.num_blocks * self.block_size, cfg)
        self.port = EnginePort(self.manager, record_events=False)
        if self.withdraws_saves:
            self.port.allow_save_withdrawal()
        self.attn_groups = self.port.attention_groups  # our group names, in attn_ids order
        self._pages_per_block = max(self.port.layout.pages_per_block, 1)
        self._quotas = bool(self.port.config.tenant_quotas)
        self.slot_blocks = len(self.mamba_ids)  # vLLM blocks per state slot
        # vLLM reserves block 0 as the null block (padding in block tables); keep our
        # page 0 allocated forever so that the arena never hands it out.
        if self.port.reserve_page() != 0:
            raise RuntimeError("hybridcache arena did not start at page 0")
        self.blocks = [KVCacheBlock(i) for i in range(self.num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.block_pool = BlockPoolView(self)
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in range(self.num_groups)))
        self.stats_counters = AdapterStats()
        self._tracked: dict[str, _Tracked] = {}
        self._new_block_ids: list[int] = []
        # Digests of units whose snapshot a request scheduled in this step will write, and
        # requests told to wait one step for them (see get_computed_blocks).
        self._pending_snaps: set[bytes] = set()
        self._wait: set[str] = set()
        self.tails: TailCache | None = None
        if prefix_match_unit and prefix_match_unit < self.block_size and self.mamba_ids:
            self.tails = TailCache(self.port, prefix_match_unit, self.block_size,
                                   lambda s: [self._state_blocks(s, j) for j in range(self.slot_blocks)],
                                   max_blocks=self.num_blocks // 2)
        self._fine: dict[str, FineHit] = {}  # a waiting request's sub-block hit
        self.kv_events: Any = None  # .kv_events.VllmKVEvents when vLLM's KV events are on
        # Attributes the scheduler reads from vLLM's manager at construction time.
        self.mamba_shared_prefix_checkpoint = False
        self.coordinator = CoordinatorView(
            tuple(
                GroupView(i, g.kv_cache_spec, g.kv_cache_spec.block_size)
                for i, g in enumerate(kv_cache_config.kv_cache_groups)
            )
        )

    # ------------------------------------------------------------------ mapping
    def _state_blocks(self, slot: int, j: int) -> int:
        return 0 if slot == NULL_SLOT else slot * self.slot_blocks + j

    def _blocks(self, ids: Sequence[int]) -> list[KVCacheBlock]:
        """vLLM's blocks for page ids; ``-1`` (a sliding-window page outside the window, which
        the core does not keep) is vLLM's null block, as its ``SlidingWindowManager`` does."""
        blocks, null = self.blocks, self.null_block
        return [blocks[i] if i >= 0 else null for i in ids]

    def _kv_blocks(self, tables: Sequence[Sequence[int]]) -> KVCacheBlocks:
        if not any(tables):
            return self.empty_kv_cache_blocks
        return KVCacheBlocks(tuple(self._blocks(t) for t in tables))

    # ------------------------------------------------------------------ requests
    def _add(self, request: Request) -> None:
        """Register ``request`` with the manager (hashing its tokens) if it is not yet."""
        rid = request.request_id
        known = self.port.request(rid)
        tokens = list(request.all_token_ids)
        if known is not None:
            if known.allocated or known.num_tokens == len(tokens):
                return
            self.port.free(rid, finished=False)
            if self.tails is not None:
                self.tails.forget(rid)
        tenant = request.cache_salt
        if self.is_private(request):
            tenant = f"\x00private:{rid}"  # its own chain: it can neither hit nor be hit
        lora = request.lora_request.lora_name if request.lora_request else None
        mm = tuple(
            MultiModalItem(f.identifier, f.mm_position.offset, f.mm_position.length)
            for f in (request.mm_features or ())
        )
        self.port.add_request(rid, tokens, tenant=tenant, lora=lora, mm_items=mm)
        if self.tails is not None:
            self.tails.add_request(rid, tokens, tenant, lora, mm)

    def is_private(self, request: Request) -> bool:
        """Whether ``request`` neither hits nor can be hit (prefix caching off for it)."""
        return not self.enable_caching or request.skip_reading_prefix_cache

    def _sync(self, tr: _Tracked) -> None:
        """Append tokens the manager has not seen and commit what the worker computed."""
        request, view = tr.request, tr.view
        rid = request.request_id
        if request.num_tokens > view.num_tokens:
            new = list(request.all_token_ids[view.num_tokens :])
            self.port.append_tokens(rid, new)
            if self.tails is not None:
                self.tails.append(rid, new)
        n = min(request.num_computed_tokens, view.num_allocated)
        if self.tails is not None and n > tr.fine_seen:
            tr.fine_seen = n
            self._tell_tails(tr, n)
            if self.kv_events is not None:
                self.kv_events.collect(request)  # (tails it made)
        self._unpin(tr, keep_from=n)
        if n > view.num_computed:
            self._hold_dropped_live_save(tr, n)
            self.port.commit(rid, n)
            if self.kv_events is not None:
                self.kv_events.collect(request)
            self.stats_counters.commits += 1
            self._pin_live_snapshot(tr, n)

    def _tell_tails(self, tr: _Tracked, n: int) -> None:
        """The worker has computed ``n`` tokens: the state is in the column holding ``n``."""
        assert self.tails is not None
        col = (n - 1) // self.block_size
        self.tails.computed(tr.request.request_id, n, tr.request.num_prompt_tokens,
                            [tr.tables[g][col] for g in self.attn_ids],
                            [tr.tables[g][col] for g in self.mamba_ids])

    def _hold_dropped_live_save(self, tr: _Tracked, n: int) -> None:
        """Keep the live column's save slot out of a commit that would free it.

        The manager frees a save slot it cannot register (another request registered a
        snapshot there first, or a tenant quota refuses it). If that slot is the block
        the request still computes in (a save at ``n``), freeing it now would hand the
        request's running state to the next allocation; the adapter keeps the slot until
        the request has moved past ``n``.
        """
        if not self.mamba_ids or n % self.block_size or n not in tr.view.save_slots:
            return
        rid = tr.request.request_id
        if self._quotas or self.port.snapshot_slot(rid, n) >= 0:
            tr.held.append((n, self.port.take_save_slot(rid, n)))
            self.stats_counters.live_saves_held += 1

    def _pin_live_snapshot(self, tr: _Tracked, n: int) -> None:
        """Keep the snapshot just registered at ``n`` while the request still computes in it.

        After a step that ends on a save point, the block registered as the snapshot is
        the request's current column: the worker copies it into the next column only at
        the request's next step. Until then, evicting it and reusing the block (zeroed
        as a fresh KV page, or written as another request's state) would lose the
        request's running state, so it stays pinned until the request moves past ``n``.
        """
        if not self.mamba_ids or n % self.block_size or n // self.block_size > len(tr.cols):
            return
        # (n past the known units: a speculative step stopped the request inside it; the
        # port then finds no snapshot)
        rid = tr.request.request_id
        slot = self.port.snapshot_slot(rid, n)
        if slot >= 0 and slot == tr.cols[n // self.block_size - 1]:
            pin = self.port.pin_snapshot(rid, n)
            assert pin is not None
            tr.pinned.append(pin)

    def _unpin(self, tr: _Tracked, keep_from: int | None = None) -> None:
        """Release pins and held slots of boundaries the request has computed past.

        ``keep_from=None`` releases everything (the request is being freed).
        """
        def live(b: int) -> bool:
            return keep_from is not None and b >= keep_from

        for pin in tr.pinned:
            if not live(pin.boundary):
                self.port.unpin_snapshot(pin)
        for b, slot in tr.held:
            if not live(b):
                self.port.release_slot(slot)
        tr.pinned = [pin for pin in tr.pinned if live(pin.boundary)]
        tr.held = [(b, slot) for b, slot in tr.held if live(b)]

    # ------------------------------------------------------------------ allocation
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        """Pages and state columns for ``num_new_tokens`` more tokens, or ``None`` if full.

        ``full_sequence_must_fit`` (vLLM's admission gate for waiting requests) is honoured
        by :meth:`_fits`; ``reserved_blocks`` and the watermark serve vLLM's connectors and
        are not modelled (a fuller admission can only cause preemptions, not wrong output).
        """
        if num_lookahead_tokens or num_external_computed_tokens or delay_cache_blocks:
            raise NotImplementedError(
                "hybridcache's scheduler supports neither speculative lookahead slots nor "
                "external (connector) KV loads"
            )
        if num_encoder_tokens:
            raise NotImplementedError("hybridcache does not manage cross-attention caches")
        rid = request.request_id
        tr = self._tracked.get(rid)
        if self._deferred(rid):
            return None
        if tr is None:
            if request.num_computed_tokens:
                raise RuntimeError(f"request {rid}: computed tokens without an allocation")
            self._add(request)
        else:
            self._sync(tr)
        if num_new_tokens == 0:
            return self.empty_kv_cache_blocks
        fine = self._fine.pop(rid, None) if tr is None else None
        below = 0  # tokens of a sub-block hit past the manager's own hit
        if fine is not None and fine.tail is not None and fine.hit_tokens == num_new_computed_tokens:
            below = fine.hit_tokens % self.block_size
        elif fine is not None:
            fine = None
        base_hit = num_new_computed_tokens - below
        if tr is None and full_sequence_must_fit and not self._fits(request, base_hit):
            self.stats_counters.allocation_failures += 1
            return None
        alloc = self._allocate(rid, num_new_tokens + below)
        self._drop_withdrawn()
        if alloc is None:
            return None
        self.stats_counters.allocations += 1
        if tr is None:
            tr = self._track_first(request, alloc, base_hit)
            tr.fine_seen = num_new_computed_tokens
            self.stats_counters.served_prompt_tokens += request.num_prompt_tokens
            self.stats_counters.served_hit_tokens += num_new_computed_tokens
        self._extend_tables(tr, alloc)
        if fine is not None and fine.tail is not None and self.tails is not None:
            col = fine.hit_tokens // self.block_size
            self.tails.restore(rid, fine.tail, [tr.tables[g][col] for g in self.attn_ids],
                               [tr.tables[g][col] for g in self.mamba_ids])
        return self._take_new_blocks(tr)

    def _drop_withdrawn(self) -> None:
        """Forget what a later allocation of this step took back
        (:mod:`hybridcache.pending_saves`). A save point was served in place at a step end
        (:meth:`_run_save`), so the core gave its request the old running slot back, the
        slot the request's column already holds: nothing of the step's blocks changes, and
        requests waiting for its snapshot (:meth:`_pending_deeper`) would wait for nothing,
        so its digest leaves the pending set. A settled turn-end slot was written at least
        two steps ago: its column's copy has run, no table of this step reads it.
        """
        for w in self.port.take_withdrawn_saves():
            self.stats_counters.saves_withdrawn += 1
            tr = self._tracked.get(w.request_id)
            unit = w.boundary // self.block_size - 1
            if tr is not None and not w.turn_end and 0 <= unit < len(tr.view.digests):
                self._pending_snaps.discard(tr.view.digests[unit])

    def _deferred(self, rid: str) -> bool:
        """Whether ``rid`` was told to wait one step (see :meth:`_pending_deeper`)."""
        if rid not in self._wait:
            return False
        self._wait.discard(rid)
        self.stats_counters.deferred += 1
        return True

    def _allocate(self, rid: str, num_tokens: int) -> Allocation | None:
        """The manager's allocation of ``num_tokens`` more tokens, or ``None`` if full."""
        if self.tails is not None:
            self.tails.make_room(self._arena_blocks_needed(num_tokens))
        while True:
            try:
                return self.port.allocate(rid, num_tokens)
            except OutOfSpaceError:
                # Sub-block tails are cached entries too: give their blocks back first.
                if self.tails is not None and self.tails.evict_one():
                    continue
                self.stats_counters.allocation_failures += 1
                return None

    def _arena_blocks_needed(self, num_tokens: int) -> int:
        """Arena blocks an allocation of ``num_tokens`` may take (pages and two slots)."""
        pages = (-(-num_tokens // self.block_size) + 1) * len(self.attn_ids)
        return -(-pages // self._pages_per_block) + 2

    def _track_first(self, request: Request, alloc: Allocation, num_hit: int) -> _Tracked:
        """Track a request after its first allocation, which must hit the adopted tokens."""
        rid = request.request_id
        if alloc.hit_tokens != num_hit:
            self.port.free(rid, finished=False)
            raise RuntimeError(
                f"request {rid}: scheduler adopted {num_hit} cached tokens "
                f"but the manager matched {alloc.hit_tokens}"
            )
        tr = self._tracked[rid] = self._first_tables(request, alloc)
        return tr

    def _take_new_blocks(self, tr: _Tracked) -> KVCacheBlocks:
        """The blocks of ``tr`` not yet returned to the scheduler (and mark them returned)."""
        new = [t[s:] for t, s in zip(tr.tables, tr.sent)]
        tr.sent = [len(t) for t in tr.tables]
        return self._kv_blocks(new)

    def _first_tables(self, request: Request, alloc: Allocation) -> _Tracked:
        b = self.block_size
        hit_units = alloc.start // b
        view = self.port.request(request.request_id)
        assert view is not None
        tr = _Tracked(request, view, tables=[[] for _ in range(self.num_groups)],
                      sent=[0] * self.num_groups)
        if hit_units and self.mamba_ids:
            (snap,) = alloc.state_copies.src
            tr.cols = [NULL_SLOT] * (hit_units - 1) + [snap]
        for k, gid in enumerate(self.attn_ids):
            tr.tables[gid] = list(alloc.block_table[self.attn_groups[k]][:hit_units])
        return tr

    def _extend_pages(self, tr: _Tracked, alloc: Allocation) -> None:
        """Append the allocation's new attention pages to the worker's block tables (the
        pages the worker already holds never change)."""
        for k, gid in enumerate(self.attn_ids):
            table = alloc.block_table[self.attn_groups[k]]
            old = tr.tables[gid]
            if table[: len(old)] != old:
                raise RuntimeError("hybridcache changed pages the worker already holds")
            self._new_block_ids.extend(table[len(old) :])
            tr.tables[gid] = list(table)

    def _extend_tables(self, tr: _Tracked, alloc: Allocation) -> None:
        """Append new pages and state columns; run save points in place (module docstring)."""
        self._extend_pages(tr, alloc)
        if not self.mamba_ids:
            return
        view = tr.view
        end = alloc.start + alloc.num_tokens
        last_col = (end - 1) // self.block_size
        while len(tr.cols) <= last_col:
            tr.cols.append(view.running_slot)
        for sp in alloc.save_points:
            if self._run_save(view, sp, end):
                self._pending_snaps.add(view.digests[end // self.block_size - 1])
        for j, gid in enumerate(self.mamba_ids):
            tr.tables[gid] = [self._state_blocks(s, j) for s in tr.cols]

    def _run_save(self, view: RequestView, sp: SavePoint, end: int) -> bool:
        """Make the block that holds the state at ``sp.boundary`` the snapshot.

        The current column's block is the running slot and holds the state at ``end``
        after this step; if ``end`` is the save boundary, swapping the two slot ids in the
        request record registers that block at commit and keeps computing in the other.
        A save point inside the step (never produced by our scheduler) cannot be honoured:
        it is dropped so that no snapshot of the wrong state is ever registered.

        Returns:
            True when a snapshot will be registered at the next commit (not for the
            rolling turn-end save, which is registered when the request finishes).
        """
        rolling = sp.slot == view.rolling_slot and sp.boundary == view.rolling_boundary
        if sp.boundary == end and end % self.block_size == 0:
            self.port.save_in_running_slot(view.id, sp.boundary)
            self.stats_counters.saves_in_place += 1
            return not rolling
        self.stats_counters.saves_dropped += 1
        self.port.cancel_save(view.id, sp.boundary)
        return False

    # ------------------------------------------------------------------ steps
    def new_step_starts(self) -> None:
        """Commit what the previous step computed, so this step's lookups can hit it."""
        if self.tails is not None:
            self.tails.new_step()  # before the commits below queue this step's copies
        for tr in self._tracked.values():
            self._sync(tr)
        self._pending_snaps.clear()
        self._wait.clear()

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        tr = self._tracked.get(request.request_id)
        if tr is not None:
            self._sync(tr)

    def take_new_block_ids(self) -> list[int]:
        """New private KV pages, for the worker's zeroing of fresh attention blocks."""
        ids, self._new_block_ids = self._new_block_ids, []
        return ids

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        tr = self._tracked.get(request_id)
        if tr is not None:
            first = start_token // self.block_size
            for gid in self.attn_ids:
                self._new_block_ids.extend(tr.tables[gid][first:])

    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
        """Sub-block tails' copies (made and restored); block-level snapshot restores ride
        on the worker's own column copy. No block is retained: tails own theirs."""
        if self.tails is None:
            return [], []
        return [KVCacheBlockCopy(s, d) for s, d in self.tails.take_copies()], []

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return {}

    def take_events(self) -> list[Any]:
        """vLLM's KV cache events (:mod:`.kv_events`) when enabled, else none."""
        return [] if self.kv_events is None else self.kv_events.take()

    # ------------------------------------------------------------------ free
    def free(self, request: Request) -> None:
        """Commit what was computed, then release; a finished request keeps its turn-end snapshot."""
        rid = request.request_id
        tr = self._tracked.pop(rid, None)
        if rid not in self.port:
            return
        if tr is not None:
            self._sync(tr)
            self._unpin(tr)
        self._fine.pop(rid, None)
        if self.tails is not None:
            self.tails.forget(rid)
        self.port.free(rid, finished=request.is_finished())
        if self.kv_events is not None:
            self.kv_events.collect(request)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """Deferred frees are refused at scheduler construction; free now."""
        self.free(request)
        return []

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Nothing to drop early: pages stay with the request until it is freed."""

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        return []

    def reset_prefix_cache(self) -> bool:
        """Evict every cached entry; refused (False) while requests hold allocations."""
        if self._tracked:
            return False
        if self.tails is not None:
            self.tails.clear()
        self.port.clear()
        if self.log_stats:
            assert self.prefix_cache_stats is not None
            self.prefix_cache_stats.reset = True
        return True

    def evict_blocks(self, block_ids: set[int]) -> None:
        raise NotImplementedError("hybridcache cannot evict single vLLM blocks (connector path)")
