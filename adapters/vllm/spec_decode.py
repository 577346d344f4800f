"""Speculative decoding with prefix caching: hybridcache's manager behind vLLM's ``align`` mode.

How vLLM 0.32's V1 worker lays out recurrent states when it verifies draft tokens
(``mamba_utils.preprocess_mamba`` / ``postprocess_mamba_fused_kernel`` and the GDN/KDA
metadata builders), for a step that starts with ``c`` computed tokens and schedules
``q = 1 + d`` tokens (``d`` drafts) of block size ``B``:

* the step's state columns are ``cur .. cur + num_spec`` with ``cur = (c + q - 1) // B``;
  the state after the step's ``t + 1``-th input is written into column ``cur + t``;
* the initial state is read from column ``prev + a - 1`` (``prev``: the last step's
  ``cur``, ``a``: its accepted count), copied into ``cur`` first when ``cur != prev``;
* after sampling, if the accepted tokens pass a block boundary ``b``, the state at ``b``
  is copied into column ``b // B - 1``.

So every column needs a block of its own (a draft's state must not overwrite the
accepted one), and once a request's accepted tokens pass ``(X + 1) * B``, column ``X``
holds the state at that boundary and is never written again. A rejected draft's state
only ever lands in a column past the accepted tokens.

:class:`SpecDecodeKVCacheManager` maps this onto the core manager:

* each step is ``allocate(q + lookahead, num_draft=d + lookahead)`` (the core's draft
  slots account for the draft states; lookahead tokens are an EAGLE / MTP drafter's
  KV positions), and the next step starts with ``accept(a)``: save points past the
  accepted tokens are dropped by the core, so **a save point of a rejected token is never
  registered** (pages past them stay with the request: the worker's tables are
  append-only, see :meth:`SpecDecodeKVCacheManager._accept_keeping_pages`);
* state columns get slots of their own from the core's index (evicting if needed); a
  column the request has left for good is given back;
* a save point at boundary ``b`` that survives ``accept`` is served by relabelling: the
  slot of column ``b // B - 1``, which the worker has just filled with the state at
  ``b``, becomes the snapshot's slot (or the rolling turn-end slot), and the save
  point's fresh slot is freed. No copy is issued.
* sub-block tails (:mod:`.fine`) after a step with drafts copy the column holding the
  state at their boundary. The recurrent state after the step's ``t + 1``-th input is in
  column ``cur + t``, but vLLM keeps the step's conv history in column ``cur`` only (the
  window after input ``t + 1`` at offset ``t``), so a whole-block copy of column
  ``cur + t`` paired the right recurrent state with a stale conv window: the root cause
  of the one mismatch measured with tails and drafts (tiny Qwen3-Next, a tail hit at 752
  moved the second output token). The plug-in's CPU forwards write every column's own
  window (:func:`.cpu_kernels.spread_conv_windows`) and any accepted boundary is a tail
  there (``columns_whole``); elsewhere only the state after a step's first input
  (column ``cur``, offset 0) is;
* a step's new state columns are counted together with its allocation before anything
  is taken (:meth:`EnginePort.can_allocate`): when they do not all fit, ``allocate_slots``
  returns ``None`` with no entry evicted and vLLM preempts. Sub-block tails hold engine
  memory the count does not see: they are evicted one by one (recounting after each) only
  when the step does not fit without them, so a step refused even then has dropped them.

Written for every drafter vLLM 0.32 runs with Mamba-style layers in ``align`` mode:
n-gram (run on CPU here), EAGLE / MTP / DSpark-style draft models on GPU (their
lookahead KV positions are allocated as drafts; not run here, no GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.request import Request

from hybridcache.manager import Allocation

from .manager import NULL_SLOT, HybridKVCacheManager, _Tracked

logger = init_logger(__name__)


@dataclass
class _SpecState:
    """Per request: column slots the adapter owns, the step in flight, pending saves."""

    owned: dict[int, int] = field(default_factory=dict)  # column -> slot
    step: tuple[int, int, int] | None = None  # (c, q, d) of the step in flight
    landed: tuple[int, int, int] | None = None  # (c, end, cur) of the last step with drafts
    saves: list[tuple[int, int]] = field(default_factory=list)  # (boundary, core slot)


class SpecDecodeKVCacheManager(HybridKVCacheManager):
    """:class:`~.manager.HybridKVCacheManager` for engines with speculative decoding.

    Args:
        num_speculative_tokens: vLLM's ``num_speculative_tokens`` (state columns past the
            current one that the worker writes draft states into).
        columns_whole: whether the worker leaves a whole state (conv window included) in
            every column of a step with drafts (:func:`.cpu_kernels.speculative_columns_whole`);
            it decides where sub-block tails are made after such a step (:meth:`_tell_tails`).
        Other arguments: :class:`~.manager.HybridKVCacheManager`'s.
    """

    #: Save points are served after the step (``_accept_step``), from slots recorded at
    #: allocation: one taken back meanwhile would be served from a slot someone else holds.
    withdraws_saves = False

    def __init__(self, *args: Any, num_speculative_tokens: int, columns_whole: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_spec = num_speculative_tokens
        self.columns_whole = columns_whole
        self._reserved: list[int] = []  # column slots taken for the allocation being made
        self._need = 0  # column slots that allocation adds
        self._spec: dict[str, _SpecState] = {}
        self._draft = 0  # num_draft of the allocation being made (drafts + lookahead)
        self._lookahead = 0  # lookahead positions of that allocation
        self.rejected_saves = 0  # save points dropped because their token was rejected
        self.draft_tokens = 0  # drafts verified (main-model drafts, not lookahead)
        self.accepted_drafts = 0

    # ------------------------------------------------------------------ allocation
    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0, **kwargs: Any) -> KVCacheBlocks | None:
        """As the base class; drafts and lookahead positions are core draft tokens.

        The state columns the step needs are counted together with the allocation before
        anything is taken (:meth:`_allocate`): when they do not all fit (even after
        evicting), nothing is evicted or allocated and ``None`` is returned, so vLLM
        preempts a request (as with its own manager) instead of the engine dying halfway
        through an allocation.
        """
        rid = request.request_id
        st = self._spec.setdefault(rid, _SpecState())
        if st.step is not None:
            raise RuntimeError(f"request {rid}: allocated twice in one step")
        c = request.num_computed_tokens + num_new_computed_tokens
        d = max(0, c + num_new_tokens - request.num_tokens) if num_new_tokens else 0
        self._need = self._columns_needed(rid, num_new_computed_tokens, c + num_new_tokens)
        self._lookahead = num_lookahead_tokens if num_new_tokens else 0
        self._draft = d + self._lookahead if num_new_tokens else 0
        try:
            out = super().allocate_slots(
                request, num_new_tokens + self._lookahead,
                num_new_computed_tokens, new_computed_blocks, **kwargs,
            )
        finally:
            self._draft = self._lookahead = self._need = 0
            while self._reserved:  # a miscounted allocation (or none needed after all)
                self._give_back_slot(self._reserved.pop())
        if out is not None and num_new_tokens:
            st.step = (c, num_new_tokens, d)
        elif out is None and rid not in self._tracked:
            del self._spec[rid]  # refused before the request held anything
        return out

    def _columns_needed(self, rid: str, num_new_computed: int, end: int) -> int:
        """State columns an allocation up to ``end`` main-model tokens adds (as
        :meth:`_extend_tables` will add them): up to column ``(end - 1) // B + num_spec``."""
        if not self.mamba_ids:
            return 0
        tr = self._tracked.get(rid)
        if tr is not None:
            have = len(tr.cols)
        else:  # the first allocation: the hit's columns (a sub-block tail extends the last)
            have = (num_new_computed - self._sub_block_part(rid, num_new_computed)) // self.block_size
        return max(0, (end - 1) // self.block_size + self.num_spec + 1 - have)

    def _sub_block_part(self, rid: str, num_new_computed: int) -> int:
        """Tokens of a first allocation's hit that a sub-block tail serves (as the base
        class's ``allocate_slots`` splits it)."""
        fine = self._fine.get(rid)
        if fine is not None and fine.tail is not None and fine.hit_tokens == num_new_computed:
            return fine.hit_tokens % self.block_size
        return 0

    def _allocate(self, rid: str, num_tokens: int) -> Allocation | None:
        """As the base class (sub-block tails yield first), with the step's draft slots
        and its new state columns: counted first, then taken (``None``: nothing taken).

        :meth:`EnginePort.can_allocate` counts the core allocation and the columns
        together, as the core counts its own slots and pages, before anything is evicted;
        a refused step evicts no cached entry. The columns are then taken first (slots
        before pages, the order counted); before a first allocation the port holds the
        hit meanwhile, so they never evict the snapshot or pages that hit needs.
        """
        from hybridcache.errors import OutOfSpaceError

        port, need = self.port, self._need
        while not port.can_allocate(rid, num_tokens, num_draft=self._draft, extra_slots=need):
            # Sub-block tails hold engine memory the count does not see: they yield.
            if self.tails is None or not self.tails.evict_one():
                self.stats_counters.allocation_failures += 1
                return None
        if self.tails is not None:  # more room than counted: the step still fits
            self.tails.make_room(self._arena_blocks_needed(num_tokens) + 1 + self.num_spec)
        columns = port.take_slots(rid, need) if need else []
        try:
            if columns is None:
                raise OutOfSpaceError("no slot for a state column")
            self._reserved.extend(columns)
            return port.allocate(rid, num_tokens, num_draft=self._draft)
        except OutOfSpaceError:  # pragma: no cover - the count above rules it out
            logger.warning("hybridcache: request %s: a counted allocation did not fit", rid)
            self.stats_counters.allocation_failures += 1
            return None  # allocate_slots gives the columns back

    def _column_slot(self) -> int | None:
        """A slot for a state column: from the port (evicting entries), else a tail's;
        ``None`` when none is left."""
        slot = self.port.take_slot(evict=True)
        while slot is None and self.tails is not None and self.tails.evict_one():
            slot = self.port.take_slot(evict=True)
        return slot

    def _give_back_slot(self, slot: int) -> None:
        """Return a column slot taken by :meth:`_column_slot` and not used."""
        self.port.release_slot(slot)

    def _extend_tables(self, tr: _Tracked, alloc: Allocation) -> None:
        """Pages as the base class; a slot of its own for every state column."""
        self._extend_pages(tr, alloc)
        if not self.mamba_ids:
            return
        rid = tr.request.request_id
        st = self._spec[rid]
        end = alloc.start + alloc.num_tokens - self._lookahead  # the main model's tokens
        last = (end - 1) // self.block_size + self.num_spec
        while len(tr.cols) <= last:
            slot = self._reserved.pop() if self._reserved else self._column_slot()
            if slot is None:  # allocate_slots counted them: only a miscount gets here
                raise RuntimeError("hybridcache: no state slot for a speculative column")
            st.owned[len(tr.cols)] = slot
            tr.cols.append(slot)
        digests = tr.view.digests
        for sp in alloc.save_points:
            st.saves.append((sp.boundary, sp.slot))
            unit = sp.boundary // self.block_size - 1
            if sp.boundary % self.block_size == 0 and 0 <= unit < len(digests):
                self._pending_snaps.add(digests[unit])  # (drafts: not hashed)
        for j, gid in enumerate(self.mamba_ids):
            tr.tables[gid] = [self._state_blocks(s, j) for s in tr.cols]

    # ------------------------------------------------------------------ accept
    def new_step_starts(self) -> None:
        """Accept the last step's tokens, serve its surviving saves, then commit."""
        for tr in list(self._tracked.values()):
            self._accept_step(tr)
        super().new_step_starts()

    def _accept_step(self, tr: _Tracked) -> None:
        rid = tr.request.request_id
        st = self._spec.get(rid)
        if st is None or st.step is None:
            return
        c, q, d = st.step
        st.step = None
        st.landed = None
        mreq = tr.view
        n_step = mreq.num_allocated - mreq.step_start
        a = min(max(tr.request.num_computed_tokens - mreq.step_start, 1), n_step)
        end = mreq.step_start + a
        if d:
            st.landed = (c, end, (c + q - 1) // self.block_size)
            self.draft_tokens += d
            self.accepted_drafts += min(a - 1, d)
        if mreq.num_draft_slots or a < n_step:
            self._accept_keeping_pages(mreq, a, end)
        for boundary, core_slot in st.saves:
            self._serve_save(st, mreq, boundary, core_slot, end)
        st.saves = []
        self._free_dead_columns(st, min(end // self.block_size, (c + q - 1) // self.block_size))

    def _tell_tails(self, tr: _Tracked, n: int) -> None:
        """Sub-block tails after a step with drafts: the state after its ``t + 1``-th input
        is in column ``cur + t``, not in the column holding ``n``.

        Every accepted position's state was written, so the tail is made at the deepest
        unit boundary the step's accepted tokens reach (inside a block), not only when
        ``n`` itself lands on one; ``n`` is then told with no tail to make.

        A tail copies its column's blocks whole, so the column must hold the *whole* state
        there: the recurrent state, and the conv window, which vLLM keeps in column
        ``cur`` only (read at the accepted-count offset). With :attr:`columns_whole` the
        worker also writes every column's own window (the plug-in's CPU forwards), and any
        accepted boundary may be a tail; otherwise (vLLM's kernels) only the state after
        the step's first input, in column ``cur`` at offset 0, is whole.
        """
        assert self.tails is not None
        st = self._spec.get(tr.request.request_id)
        if st is None or st.landed is None or st.landed[1] != n:
            return super()._tell_tails(tr, n)
        c, _, cur = st.landed
        unit, bs = self.tails.unit, self.block_size
        # A request stopped inside the step keeps computed positions past its last token
        # (vLLM trims the output, not num_computed_tokens): a tail covers known tokens only.
        known = min(n, tr.request.num_tokens)
        u = known // unit * unit
        while u > c and u % bs == 0:
            u -= unit
        if not self.columns_whole and u != c + 1:
            u = 0  # the state at u is split over two columns: no tail
        rid, prompt = tr.request.request_id, tr.request.num_prompt_tokens
        # A step that ends on a block boundary has the worker copy that state into column
        # ``cur`` after sampling: the state after the first input is gone from there.
        lowest = c + 2 if n % bs == 0 and n // bs - 1 == cur else c + 1
        made = u >= lowest
        if made:
            kv_col, state_col = (u - 1) // bs, cur + (u - c - 1)
            self.tails.computed(rid, u, prompt, [tr.tables[g][kv_col] for g in self.attn_ids],
                                [tr.tables[g][state_col] for g in self.mamba_ids])
        if not made or u != known:  # passes saves up to ``known``, makes no tail there
            self.tails.computed(rid, known, prompt, [], [], make_tail=False)

    def _accept_keeping_pages(self, mreq: Any, a: int, end: int) -> None:
        """``accept(a)``, but the pages past the accepted tokens stay with the request.

        The worker's block tables are append-only: a page it was given for a draft
        position stays in its table and receives that position's KV again at the next
        step. The core would free it at ``accept``; it is taken out of the request's
        table for the call and put back after, so it stays the request's until freed
        (as vLLM's own manager keeps over-allocated blocks). Its units are registered
        only once computed with known tokens, like any page.
        """
        self.port.accept(mreq.id, a, keep_pages=True)

    def _serve_save(self, st: _SpecState, mreq: Any, boundary: int, core_slot: int,
                    end: int) -> None:
        """Make column ``boundary // B - 1``'s slot the save point's slot (see module doc)."""
        col = boundary // self.block_size - 1
        rolling = boundary == mreq.rolling_boundary and mreq.rolling_slot == core_slot
        kept = rolling or mreq.save_slots.get(boundary) == core_slot
        if not kept:  # accept() dropped it: the boundary's token was rejected
            self.rejected_saves += 1
            return
        if boundary > end or boundary % self.block_size or col not in st.owned:
            self.port.cancel_save(mreq.id, boundary)
            self.stats_counters.saves_dropped += 1
            return
        self.port.move_save_to(mreq.id, boundary, st.owned.pop(col), turn_end=rolling)
        self.stats_counters.saves_in_place += 1

    def _free_dead_columns(self, st: _SpecState, below: int) -> None:
        """Give back owned columns the worker will neither read nor write again."""
        for col in [x for x in st.owned if x < below]:
            self.port.release_slot(st.owned.pop(col))

    # ------------------------------------------------------------------ free
    def free(self, request: Request) -> None:
        rid = request.request_id
        tr = self._tracked.get(rid)
        if tr is not None and rid in self.port:
            self._accept_step(tr)
        super().free(request)
        st = self._spec.pop(rid, None)
        if st is not None:
            self._free_dead_columns(st, 1 << 62)

    def _held_blocks(self) -> int:
        owned = sum(len(st.owned) for st in self._spec.values())
        return super()._held_blocks() + owned * self.slot_blocks

    def stats(self) -> dict[str, object]:
        out = super().stats()
        out.update(draft_tokens=self.draft_tokens, accepted_drafts=self.accepted_drafts,
                   rejected_saves=self.rejected_saves,
                   column_slots=self.num_owned_column_slots)
        return out

    @property
    def num_owned_column_slots(self) -> int:
        """Column slots held for running requests (0 when none runs: the leak check)."""
        return sum(len(st.owned) for st in self._spec.values())


def sub_block_unit(vllm_config: Any, unit: int | None) -> int | None:
    """The sub-block tail unit for this engine: ``unit`` (an INFO line says, under
    speculative decoding, where tails are made after a step with drafts).

    Tails with speculative decoding are correct once a tail copies a column that holds a
    whole state (:meth:`SpecDecodeKVCacheManager._tell_tails`): vLLM keeps a speculative
    step's conv window in column ``cur`` only, so a block copy of column ``cur + t``
    paired the right recurrent state with a stale conv window (measured: a tiny
    Qwen3-Next request hitting such a tail at 752 diverged from caching off at its
    second output token). The plug-in's CPU forwards now write every column's window
    (:func:`.cpu_kernels.spread_conv_windows`); elsewhere only the state after a step's
    first input is taken.
    """
    if unit is None or getattr(vllm_config, "speculative_config", None) is None:
        return unit
    from .cpu_kernels import speculative_columns_whole

    where = ("at every accepted unit boundary (this engine's speculative forwards write "
             "every state column's conv window)" if speculative_columns_whole() else
             "only where a step's first state lands (vLLM's kernels keep the conv window "
             "in the current column only)")
    logger.info("hybridcache: sub-block tails (prefix_match_unit %d) with speculative "
                "decoding: after a step with drafts, tails are made %s", unit, where)
    return unit


def manager_for(vllm_config: Any, manager_cls: type) -> tuple[type, dict[str, Any]]:
    """The manager class and extra arguments for this engine (the scheduler's one hook).

    Raises:
        ValueError: speculative decoding together with a KV connector (not supported).
    """
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return manager_cls, {}
    if manager_cls is not HybridKVCacheManager:
        raise ValueError(
            "HybridCacheScheduler does not support speculative decoding with a KV connector"
        )
    from .cpu_kernels import speculative_columns_whole

    return SpecDecodeKVCacheManager, {"num_speculative_tokens": int(spec.num_speculative_tokens),
                                      "columns_whole": speculative_columns_whole()}


__all__ = ["NULL_SLOT", "SpecDecodeKVCacheManager", "manager_for", "sub_block_unit"]
