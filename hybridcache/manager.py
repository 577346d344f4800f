"""HybridCacheManager: prefix caching for models with KV pages and recurrent state.

The path of one request (see ``docs/architecture.md``)::

    add_request(id, tokens)  -> tokens hashed per unit (chained, tenant-salted)
    match(id)                -> longest prefix with KV in every attention group AND a
                                snapshot (no state is usable without one); read-only
    allocate(id, n)          -> KV pages for n more tokens + a private running-state slot;
                                first call: hit pages held, copy plan snapshot -> running
                                slot (a cached snapshot is never written), save points
    ... engine runs the copy plan, computes the tokens, writes states at save points ...
    append_tokens(id, ids)   -> decode tokens hashed as units complete
    commit(id, n)            -> full units' pages and saved snapshots registered
    accept(id, n)            -> speculative decoding: keep n tokens, roll back the rest
    free(id)                 -> references dropped; entries stay cached until evicted

Invariants (checked by the stateful tests): a copy plan never targets a registered
snapshot; reference counts never go negative; a page or slot is never both free and in use;
bytes never exceed the budget; a snapshot of a rejected draft token is never registered.
Every error that bad input can cause is raised before any state changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from hybridcache import validation
from hybridcache.admission import AdmissionPolicy
from hybridcache.arena import Arena, ArenaLayout, plan_layout
from hybridcache.config import CacheConfig
from hybridcache.coordinator import build_coordinator
from hybridcache.errors import InvalidRequestError, OutOfSpaceError
from hybridcache.hashing import MultiModalItem, TokenHasher, as_token_array, hash_function
from hybridcache.index import PrefixIndex, UnitHandle
from hybridcache.invariants import check_manager
from hybridcache.metrics import CacheMetrics, stats_dict
from hybridcache.plans import Allocation, CopyPlan, MatchResult, SavePoint
from hybridcache.policy import check_eviction_name
from hybridcache.registration import CommitRegistrar
from hybridcache.requests import Request
from hybridcache.room import Room
from hybridcache.runs import Hold, hold_tables, truncate_holds
from hybridcache.save_points import SavePointControl
from hybridcache.seen_prefixes import fit_record
from hybridcache.spec import AttentionKind, ModelSpec
from hybridcache.step import _Hit, _Step, _Undo
from hybridcache.suffix_starts import SuffixStarts
from hybridcache.superseded import supersede

_NO_COPIES = CopyPlan()


class HybridCacheManager(SavePointControl):
    """Prefix cache manager for one model over one byte budget (see module docstring)."""

    def __new__(cls, spec: ModelSpec, capacity_bytes: int, config: CacheConfig | None = None):
        # admission="adaptive" selects the self-tuning manager (hybridcache.adaptive).
        if cls is HybridCacheManager and getattr(config, "admission", None) == "adaptive":
            from hybridcache.adaptive import AdaptiveManager

            cls = AdaptiveManager
        return super().__new__(cls)

    def __init__(self, spec: ModelSpec, capacity_bytes: int, config: CacheConfig | None = None):
        validation.check_manager_args(spec, capacity_bytes, config)
        self.spec = spec
        self.config = cfg = config or CacheConfig()
        check_eviction_name(cfg.eviction)
        hash_function(cfg.hash_algo)  # validates the name
        # min_seen lives on the config; the parsed rules must carry it or it is ignored.
        self.admission = replace(
            AdmissionPolicy.parse(cfg.admission, cfg.hash_unit), min_seen=cfg.min_seen
        )
        self.layout: ArenaLayout = plan_layout(spec, int(capacity_bytes), cfg.hash_unit, cfg.alignment)
        self.arena = Arena(self.layout)
        self.unit = cfg.hash_unit
        #: The full-attention / MLA groups (the index's runs hold their pages); sliding-window
        #: groups are the coordinator's (``sliding_groups``).
        self.groups = [g.name for g in spec.attention_groups if g.kind is not AttentionKind.SLIDING]
        self.has_state = spec.has_state
        # Priority units: FLOPs per byte of a full-prompt-sized unit, so values are ~O(1).
        scale = max(spec.flops.prefill_flops(0, cfg.hash_unit) / max(self.layout.page_bytes, 1), 1e-30)
        self.index = PrefixIndex(
            self.arena, cfg.eviction, scale, cfg.marconi_alpha, cfg.marconi_window, self.groups
        )
        #: Hit lengths across groups and the sliding-window pages (``None``: no sliding
        #: window, the index alone serves every hit: the fast path).
        self.coordinator = build_coordinator(spec, self.index, cfg.hash_unit)
        self.sliding_groups = self.coordinator.names if self.coordinator is not None else ()
        # A hit is the walk's second answer (the coordinated or snapshot-limited length),
        # else the whole KV run.
        self._hit_is_limited = self.has_state or self.coordinator is not None
        self.metrics = CacheMetrics()
        self._fits = Room(self.index).fits  # count, then take (hybridcache.room)
        self._unit_flops = spec.flops.prefill_flops(0, cfg.hash_unit)
        # A snapshot saves nothing without the KV pages below it: never worth more per byte
        # than a KV page, so eviction does not keep snapshots whose prefix it drops.
        kv = self.index.node_kv_bytes
        self._snap_flops_cap = self._unit_flops * self.index.snap_bytes / kv if kv else float("inf")
        self._registrar = CommitRegistrar(self)  # what a commit registers
        self.suffix_starts = SuffixStarts()  # the suffix-start rule's estimate (fed while it is on)
        fit_record(self)  # the seen-branch rule's record, fed at each KV eviction
        if self.coordinator is not None and cfg.tenant_quotas:  # sliding entries count too
            self.coordinator.set_quota(self._registrar.quota)  # (quotas never change later)
        self.requests: dict[str, Request] = {}
        self.tick = 0
        self._seen: dict[bytes, int] = {}

    # ------------------------------------------------------------------ requests
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
        """Register a waiting request and hash its prompt; returns its current match.

        Args:
            request_id: unique among live requests.
            token_ids: the whole prompt (history included).
            tenant: cache isolation domain (salts the hash chain).
            lora: LoRA adapter id, part of the hash chain.
            mm_items: multimodal items whose identifiers enter the units they cover.
            digests: precomputed unit digests (the simulator's traces carry block ids
                instead of tokens), salted with tenant and LoRA as token hashes are; then
                ``token_ids`` is only used for its length (or is the token count).
        """
        try:  # tenant and LoRA: checked by the hasher
            if request_id in self.requests:
                raise InvalidRequestError(f"request {request_id!r} already exists")
        except TypeError:
            raise validation.unhashable_request_id(request_id) from None
        cfg = self.config
        if digests is None:
            arr = as_token_array(token_ids, "token ids", request_id)
            n = len(arr)
        else:
            n = validation.check_digests(digests, token_ids, request_id)
        if n == 0:
            raise InvalidRequestError(f"request {request_id!r}: empty prompt")
        if n > self.spec.max_model_len:
            raise InvalidRequestError(
                f"request {request_id!r}: {n} tokens exceed max_model_len {self.spec.max_model_len}"
            )
        hasher = TokenHasher(cfg.hash_unit, cfg.hash_algo, cfg.hash_seed, tenant, lora, mm_items)
        if digests is None:
            hasher.extend_reusing(arr, self.index.heads.get)  # cached prefixes: no hashing
        else:
            if len(digests) != n // cfg.hash_unit:
                raise InvalidRequestError(
                    f"request {request_id!r}: {len(digests)} digests for {n} tokens "
                    f"(expected {n // cfg.hash_unit})"
                )
            hasher.adopt(digests, n)
        req = Request(request_id, hasher, tenant, n)
        self.requests[request_id] = req
        return self.match(request_id)

    def match(self, request_id: str) -> MatchResult:
        """Longest cached prefix usable by the request (read-only).

        The hit is a multiple of the hash unit, covered by KV in every attention group and
        by a snapshot (for models with state), and never the whole prompt: the last token
        is always recomputed so that the engine has logits to sample from.
        """
        req = self._get(request_id)
        if req.allocated:
            return MatchResult(req.hit_tokens, req.kv_hit_tokens)
        kv_units, snap_units, _, _ = self._walk(req)
        hit = snap_units if self._hit_is_limited else kv_units
        return MatchResult(hit * self.unit, kv_units * self.unit)

    def _walk(self, req: Request) -> tuple[int, int, UnitHandle | None, list[Hold]]:
        """The index walk for ``req``, reused while neither the index nor the request changed.

        ``add_request`` matches and the first ``allocate`` applies the match, usually with
        nothing registered or evicted in between: the walk is then done once, not twice.

        Returns:
            ``(kv_units, snap_units, snap_node, holds)``: see :meth:`PrefixIndex.walk`;
            ``holds`` are those of :meth:`PrefixIndex.kv_path`.
        """
        key = (self.index.version, req.num_tokens)
        if req.walk is None or req.walk[0] != key:
            index, digests = self.index, req.hasher.digests
            units, holds = index.kv_path(digests, (req.num_tokens - 1) // self.unit)
            if self.coordinator is None:
                req.walk = (key, (units, *index.deepest_snapshot(digests, units), holds))
            else:
                req.walk = (key, (units, *self.coordinator.longest_hit(digests, units), holds))
        return req.walk[1]

    def append_tokens(self, request_id: str, token_ids: Sequence[int] | np.ndarray) -> None:
        """Append generated (or accepted draft) tokens to the request's known tokens."""
        req = self._get(request_id)
        arr = as_token_array(token_ids, "appended token ids", request_id)
        if req.num_tokens + len(arr) > self.spec.max_model_len:
            raise InvalidRequestError(
                f"request {request_id!r}: {req.num_tokens + len(arr)} tokens exceed "
                f"max_model_len {self.spec.max_model_len}"
            )
        req.hasher.extend_validated(arr)
        req.num_tokens = req.hasher.num_tokens

    # ------------------------------------------------------------------ allocate
    def _count_step(
        self, request_id: str, num_new_tokens: int, num_draft: int, extra_slots: int = 0
    ) -> _Step:
        """Validate a step and count it (hybridcache.room) without taking anything.

        Shared by :meth:`allocate` and :meth:`EnginePort.can_allocate
        <hybridcache.port.EnginePort.can_allocate>` so the question asked before a step and
        the one the step asks itself cannot drift apart. ``extra_slots`` are slots an engine
        takes beside the step (taken before the pages, as the step's own).

        Returns:
            The validated counts, the request, its hit (first step only) and the answer.
        """
        num_new_tokens = validation.as_count(num_new_tokens, "num_new_tokens")
        num_draft = validation.as_count(num_draft, "num_draft")
        req = self._get(request_id)
        req.check_step(num_new_tokens, num_draft)
        first = not req.allocated
        hit = self._hit(req) if first else None
        start = hit[1] * self.unit if hit is not None else req.num_allocated
        end = start + num_new_tokens
        if end > self.spec.max_model_len:
            raise InvalidRequestError(
                f"request {request_id!r}: {end} tokens exceed max_model_len {self.spec.max_model_len}"
            )
        held = hit[1] if hit is not None else req.units_allocated
        page_units = max(-(-end // self.unit) - held, 0)
        slots = ((first + num_draft) if self.has_state else 0) + extra_slots
        if hit is None:
            fits = self._fits(page_units, slots)
        else:
            coord = self.coordinator
            slide_hold = coord.unheld_hit_pages(req.hasher.digests, hit[1]) if coord else ()
            fits = self._fits(page_units, slots, hit[2], hit[3], slide_hold)
        return _Step(req, first, hit, start, end, page_units, slots, fits, num_new_tokens, num_draft)

    def allocate(self, request_id: str, num_new_tokens: int, *, num_draft: int = 0) -> Allocation:
        """Pages (and on the first call the running slot and copy plan) for new tokens.

        Args:
            request_id: a request added with :meth:`add_request`.
            num_new_tokens: tokens the engine computes in this step (including drafts).
            num_draft: speculative decoding: draft tokens among them; that many extra state
                slots are reserved until :meth:`accept`.

        Raises:
            InvalidRequestError: bad counts or lengths (nothing changed).
            OutOfSpaceError: not enough evictable memory (nothing changed).
        """
        step = self._count_step(request_id, num_new_tokens, num_draft)
        if not step.fits:
            raise OutOfSpaceError(
                f"request {request_id!r}: {step.page_units} units of KV pages and {step.slots} state "
                "slots do not fit, even after evicting every cached entry no request holds"
            )
        req = step.req
        copies, drafts, saves, block_table = self._take(step, True)
        # Positional, in field order (start, num_tokens, block_table, running_slot,
        # init_state, state_copies, save_points, draft_slots, hit_tokens): half the time
        # of keywords for a named tuple made on every step.
        init_state = step.first and req.restore is None
        return Allocation(step.start, step.num_new_tokens, block_table, req.slot, init_state, copies, saves, drafts,
                          req.hit_tokens)

    def _take(self, step: _Step, tables: bool) -> tuple[CopyPlan, tuple[int, ...], tuple[SavePoint, ...], dict]:
        """Take what a counted step that fits needs: the hit, slots, the rules' save points
        (before the pages as far as the room holds both: ``_rule_saves_first``), pages, spares.

        Returns ``(copies, drafts, saves, block_table)``; the block table (a copy of the
        request's page tables) only if ``tables``, else empty: a shadow's replay
        (:mod:`hybridcache.shadow`) takes the step and reads none of what it returns.
        """
        req, first, hit, start, end = step.req, step.first, step.hit, step.start, step.end
        num_draft = step.num_draft
        coord = self.coordinator
        if hit is not None:
            self._begin(req, hit)
        undo = _Undo()
        try:
            # Slots before pages, the order the room was counted in.
            copies = self._first_slot(req, undo) if first else _NO_COPIES
            drafts: tuple[int, ...] = ()
            if num_draft and self.has_state:
                with self.index.slot_batch():
                    drafts = tuple(self._need_slot(undo) for _ in range(num_draft))
            req.draft_slots = list(drafts)  # read by the save points (speculative turn end)
            rule_saves, rule_rest = self._rule_saves_first(req, start, end, step.page_units)
            new_pages, slide_new = self._alloc_pages(req, end, undo)
        except OutOfSpaceError:  # pragma: no cover - the count above rules it out
            req.draft_slots = []
            undo.give_back(self.arena)
            if first:
                self._rollback_first(req)
            raise
        for table, pages in zip(req.pages, new_pages):
            table.extend(pages)
        block_table: dict = {}
        if tables:
            groups = self.groups
            if len(groups) == 1:  # the usual model: one full-attention group, no comprehension
                block_table = {groups[0]: req.pages[0][:]}
            else:
                block_table = {g: list(t) for g, t in zip(groups, req.pages)}
        if coord is not None:
            coord.extend(req, slide_new)  # type: ignore[arg-type]
            if tables:
                block_table.update(coord.tables(req))
        req.units_allocated = max(req.units_allocated, -(-end // self.unit))
        req.num_allocated = end
        req.step_start = start
        saves = self._schedule_saves(req, rule_saves, rule_rest, start, end)
        return copies, drafts, saves, block_table

    def _hit(self, req: Request) -> _Hit:
        """What a first allocation would hold: the match, cut to a usable hit (read-only)."""
        kv_units, snap_units, snap_node, holds = self._walk(req)
        if self._hit_is_limited:
            return (kv_units, snap_units, truncate_holds(holds, snap_units), snap_node if snap_units else None)
        return (kv_units, kv_units, truncate_holds(holds, kv_units), None)

    def _begin(self, req: Request, hit: _Hit) -> int:
        """First allocation: apply the match and hold its pages and snapshot."""
        self.tick += 1
        kv_units, hit_units, holds, restore = hit
        self.index.hold_runs(holds)
        req.units = hit_units
        req.hit_holds = holds
        req.holds = list(holds)
        req.pages = hold_tables(holds, len(self.groups))
        req.units_allocated = hit_units
        req.hit_tokens = hit_units * self.unit
        req.kv_hit_tokens = kv_units * self.unit
        if self.admission.seen_branch and self.index.seen is not None:
            req.seen_branch = self.index.seen.point(req, req.kv_hit_tokens, req.hit_tokens, self.unit)
        req.restore = restore
        req.value_base = req.hit_tokens
        if restore is not None:
            if restore.snap_base >= 0:  # a spare checkpoint: value from what it was valued from
                req.value_base = restore.snap_base
            self.index.pin_snapshot(restore)
            if restore.snap_cohort is not None:  # a session's next turn: what it went past goes first
                req.resumed_from = restore.digest if supersede(self.index, restore) is not None else None
        if self.coordinator is not None:
            self.coordinator.begin(req, hit_units)
        req.allocated = True
        req.num_computed = req.hit_tokens
        req.prompt_len = req.num_tokens
        if self.admission.tracks_suffixes:
            req.suffix_start = self.suffix_starts.note_match(req, self.unit, not self.admission.suffix_start)
        return req.hit_tokens

    def _rollback_first(self, req: Request) -> None:
        if self.admission.tracks_suffixes:
            self.suffix_starts.undo_match(req)
        self.index.release_runs(req.holds, self.tick)
        if req.restore is not None:
            self.index.unpin_snapshot(req.restore, self.tick)
        if self.coordinator is not None:
            self.coordinator.rollback(req)
        req.reset()

    def _first_slot(self, req: Request, undo: _Undo) -> CopyPlan:
        if not self.has_state:
            return _NO_COPIES
        req.slot = self._need_slot(undo)
        if req.restore is None:
            return _NO_COPIES
        return CopyPlan((req.restore.snap,), (req.slot,))

    def _need_slot(self, undo: _Undo) -> int:
        s = self.index.alloc_slot()
        if s is None:
            raise OutOfSpaceError("no state slot can be freed: every slot is in use")
        undo.slots.append(s)
        return s

    def _alloc_pages(self, req: Request, end: int, undo: _Undo) -> tuple[list[list[int]], list | None]:
        """Pages, per group, for the units up to token ``end`` that have none yet: the full
        groups', then the sliding-window groups' (``None`` without a coordinator).

        The caller appends them to the request only once the whole step has succeeded.
        """
        n = -(-end // self.unit) - req.units_allocated
        new: list[list[int]] = []
        for _ in self.groups:
            pages = self.index.alloc_pages(n) if n > 0 else []
            undo.pages.extend(pages)
            if len(pages) < n:
                raise OutOfSpaceError("no KV page can be freed: every page is in use")
            new.append(pages)
        if self.coordinator is None:
            return new, None
        slide = self.coordinator.alloc_pages(max(n, 0), undo.pages)
        if slide is None:
            raise OutOfSpaceError("no KV page can be freed: every page is in use")
        return new, slide

    # ------------------------------------------------------------------ commit / accept
    def commit(self, request_id: str, num_computed_tokens: int) -> None:
        """Tokens ``[0, num_computed_tokens)`` are computed: register full units and snapshots.

        KV of a unit is registered once its tokens are computed and known (appended);
        snapshots at save points up to ``num_computed_tokens`` are registered as written.

        Raises:
            InvalidRequestError: more tokens than allocated, or fewer than already committed.
        """
        num_computed_tokens = validation.as_count(num_computed_tokens, "num_computed_tokens")
        req = self._get(request_id)
        n = num_computed_tokens
        if not req.allocated or n > req.num_allocated:
            raise InvalidRequestError(
                f"request {request_id!r}: commit of {n} tokens but only "
                f"{req.num_allocated if req.allocated else 0} allocated"
            )
        if n < req.num_computed:
            raise InvalidRequestError(
                f"request {request_id!r}: commit of {n} tokens after {req.num_computed}"
            )
        if req.draft_slots:
            raise InvalidRequestError(f"request {request_id!r}: accept() the drafts before commit")
        self._commit(req, n)

    def _commit(self, req: Request, n: int) -> None:
        """:meth:`commit` of a checked count (a shadow's replay calls it directly)."""
        self.tick += 1
        if req.restore is not None:
            self.index.unpin_snapshot(req.restore, self.tick)
            req.restore.snap_hits += 1
            self.metrics.snapshot_copies += 1
            req.restore = None
        if not req.counted:
            self._count_request(req)
        req.num_computed = n
        self._registrar.register_units(req, min(n, req.num_tokens) // self.unit)
        if req.saves:
            lim = min(n, req.num_tokens)
            for b in sorted([b for b in req.saves if b <= lim]):
                self._registrar.register_snapshot(req, b, req.saves.pop(b))
        if self.coordinator is not None:
            self.coordinator.advance(req, n)

    def _count_request(self, req: Request) -> None:
        m = self.metrics
        req.counted = True
        m.requests += 1
        m.prompt_tokens += req.prompt_len
        m.hit_tokens += req.hit_tokens
        m.kv_hit_tokens += req.kv_hit_tokens
        m.kv_hit_state_miss_tokens += req.kv_hit_tokens - req.hit_tokens
        m.hit_requests += req.hit_tokens > 0
        f = self.spec.flops.prefill_flops
        m.prefill_flops += f(0, req.prompt_len)
        m.prefill_flops_saved += f(0, req.hit_tokens)
        self.index.count_hits(req.hit_holds)

    def accept(self, request_id: str, num_accepted: int) -> None:
        """Speculative decoding: keep the first ``num_accepted`` computed inputs of the step.

        The running state becomes the state after the last accepted input (a slot swap, no
        copy); pages and save points past it are released, so a snapshot of a rejected
        token is never registered.
        """
        num_accepted = validation.as_count(num_accepted, "num_accepted")
        req = self._get(request_id)
        n_step = req.num_allocated - req.step_start
        if not 1 <= num_accepted <= n_step:
            raise InvalidRequestError(
                f"request {request_id!r}: num_accepted must be in [1, {n_step}], got {num_accepted}"
            )
        drafts = req.draft_slots
        if num_accepted < n_step and not drafts and self.has_state:
            raise InvalidRequestError(
                f"request {request_id!r}: rolling back recurrent state needs draft slots "
                "(allocate with num_draft)"
            )
        if num_accepted < n_step and drafts:
            keep = drafts[num_accepted - 1]
            drafts[num_accepted - 1] = req.slot
            req.slot = keep
        for s in drafts:
            self.arena.free_slot(s)
        req.draft_slots = []
        end = req.step_start + num_accepted
        for b in [b for b in req.saves if b > end]:
            self.arena.free_slot(req.saves.pop(b))
            self.metrics.snapshots_rejected += 1
        if req.pending_rolling is not None:
            b, s = req.pending_rolling
            req.pending_rolling = None
            if b <= end:
                if req.rolling_slot >= 0:
                    self.arena.free_slot(req.rolling_slot)
                req.rolling_slot, req.rolling_boundary = s, b
            else:
                self.arena.free_slot(s)
                self.metrics.snapshots_rejected += 1
        req.num_allocated = end
        keep_units = max(-(-end // self.unit), req.units)
        for t in req.pages:
            for p in t[keep_units:]:
                self.arena.free_page(p)
            del t[keep_units:]
        if self.coordinator is not None:
            self.coordinator.trim(req, keep_units)
        req.units_allocated = min(req.units_allocated, keep_units)

    # ------------------------------------------------------------------ free
    def free(self, request_id: str, *, finished: bool = True) -> None:
        """Release the request. ``finished`` turns its turn-end snapshot into a cached one."""
        try:
            req = self.requests.pop(request_id, None)
        except TypeError:
            raise validation.unhashable_request_id(request_id) from None
        if req is None:
            raise InvalidRequestError(f"free of unknown request {request_id!r}")
        self._release(req, finished)

    def _release(self, req: Request, finished: bool) -> None:
        """:meth:`free` of a request already taken out of ``requests``."""
        self.tick += 1
        if req.allocated and not req.counted and req.num_computed > req.hit_tokens:
            self._count_request(req)
        if finished and req.allocated and self.admission.tracks_suffixes:
            self.suffix_starts.note_end(req, self.unit)
        rec = self.index.seen
        if req.allocated and rec is not None:  # a point at an end extends, not branches
            rec.ended_turn(req, self.unit)
        if req.restore is not None:
            self.index.unpin_snapshot(req.restore, self.tick)
        for s in req.draft_slots:
            self.arena.free_slot(s)
        for s in req.saves.values():
            self.arena.free_slot(s)
        if req.pending_rolling is not None:
            self.arena.free_slot(req.pending_rolling[1])
        rb = req.rolling_boundary
        if req.rolling_slot >= 0:
            if finished and 0 < rb <= min(req.num_computed, req.num_tokens):
                self._registrar.register_turn_end(req, rb, req.rolling_slot)
            else:
                self.arena.free_slot(req.rolling_slot)
        if req.slot >= 0:
            self.arena.free_slot(req.slot)
        for t in req.pages:
            for p in t[req.units : req.units_allocated]:
                self.arena.free_page(p)
        for i in req.dup_pages:
            for t in req.pages:
                self.arena.free_page(t[i])
        if req.slide:
            self.coordinator.free(req)  # type: ignore[union-attr]
        self.index.release_runs(req.holds, self.tick)

    def clear(self) -> int:
        """Evict every cached entry no request holds; returns how many were evicted."""
        return self.index.clear()

    # ------------------------------------------------------------------ queries
    def _get(self, request_id: str) -> Request:
        try:
            return self.requests[request_id]
        except (KeyError, TypeError):  # TypeError: an unhashable id
            raise InvalidRequestError(f"unknown request {request_id!r}") from None

    def stats(self) -> dict[str, object]:
        """Metrics plus arena occupancy, JSON-friendly."""
        sliding = self.coordinator.metrics() if self.coordinator is not None else None
        return stats_dict(self.sync_metrics(), self.arena.stats(), len(self.index.nodes), sliding)

    def sync_metrics(self) -> CacheMetrics:
        """:attr:`metrics` with the index's eviction counters copied in."""
        m = self.metrics
        m.evictions_kv = self.index.evictions["kv"]
        m.evictions_state = self.index.evictions["state"]
        m.evicted_bytes_kv = self.index.evicted_bytes["kv"]
        m.evicted_bytes_state = self.index.evicted_bytes["state"]
        return m

    def check_invariants(self) -> None:
        """Recount the manager's, index's and arena's invariants (:mod:`hybridcache.invariants`)."""
        check_manager(self)

    def cached_snapshot_slots(self) -> set[int]:
        return {n.snap for n in self.index.handles.values() if n.snap >= 0}
