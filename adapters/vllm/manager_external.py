"""Our KV cache manager with a KV connector: external tokens in, boundary states out.

:class:`ConnectorKVCacheManager` is :class:`~.manager.HybridKVCacheManager` plus the two
things vLLM 0.32's scheduler exchanges with a KV connector through its cache manager
(``HybridCacheScheduler`` uses it when ``--kv-transfer-config`` names
:class:`~.connector.HybridCacheConnector`):

- **Loads (external computed tokens).** For a new request the scheduler asks the manager
  for its local hit ``L``, then the connector for ``E`` more tokens it can load, and calls
  ``allocate_slots(num_new_tokens=0, num_external_computed_tokens=E,
  delay_cache_blocks=True)``. The manager then allocates the request as if it computed
  ``[L, L + E)`` in this step: fresh KV pages for those units and the running state slot
  in the Mamba column ``(L + E) / block_size - 1``, which is where the connector's worker
  writes the loaded state and where vLLM's ``preprocess_mamba`` resumes the request from
  (it copies that column into the next one). A snapshot save point exactly at ``L + E``
  is served in place, as for a computed step (the block that receives the loaded state
  becomes the snapshot); save points strictly inside the loaded range are cancelled,
  since no state exists there. Nothing is committed while the load is in flight
  (``delay_cache_blocks``): the request's pages and slots are private, so no other
  request can read unwritten blocks. When vLLM reports the load complete it calls
  ``cache_blocks(request, L + E)``; the manager then commits, and the loaded prefix
  becomes ordinary cached pages and a snapshot that later requests hit on the device. A
  failed load resets the request to 0 computed tokens and vLLM frees it: everything the
  load allocated is released unregistered.
- **Saves (boundary-state hand-offs).** vLLM's align-mode Mamba manager tells the
  connector which state blocks it keeps, in the step whose forward pass writes them
  (``take_boundary_state_offloads``: ``{request: [(group, block, boundary)]}``). Here every
  snapshot save point served in place (prompt end, branch point, interval, and the
  turn-end state while decoding) is offered the same way, in the step that writes it, with
  the block of the current column in every Mamba group. The connector copies those
  blocks out right after that step's forward pass (``wait_for_save``).

Why a subclass: the path without a connector stays exactly the tested one, and these
hooks (commit deferral, offers) exist only where a connector consumes them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.request import Request

from hybridcache.manager import Allocation, SavePoint
from hybridcache.port import RequestView

from .manager import HybridKVCacheManager, _Tracked


class ConnectorKVCacheManager(HybridKVCacheManager):
    """:class:`HybridKVCacheManager` that accepts connector loads and offers its snapshots."""

    #: A loading request holds its end save across steps until the load lands; taking it
    #: back under the connector is not modelled, so saves are never withdrawn here.
    withdraws_saves = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Requests whose asynchronous load is in flight -> tokens it will have computed.
        self._loading: dict[str, int] = {}
        # This step's boundary-state hand-offs, drained by the scheduler every step.
        self._offers: dict[str, list[tuple[int, int, int]]] = {}
        self.coordinator = dataclasses.replace(
            self.coordinator, remaining_blocks=self._remaining_blocks
        )

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
        """As :meth:`HybridKVCacheManager.allocate_slots`, plus asynchronous external loads.

        Raises:
            NotImplementedError: a synchronous external load (vLLM's worker copies the
                state column before a synchronous load runs, so it cannot restore a state).
            RuntimeError: a request still loading is allocated again.
        """
        rid = request.request_id
        if rid in self._loading:
            raise RuntimeError(f"request {rid}: allocated while its connector load is in flight")
        if not num_external_computed_tokens and not delay_cache_blocks:
            return super().allocate_slots(
                request,
                num_new_tokens,
                num_new_computed_tokens,
                new_computed_blocks,
                num_lookahead_tokens,
                num_encoder_tokens=num_encoder_tokens,
                full_sequence_must_fit=full_sequence_must_fit,
                has_scheduled_reqs=has_scheduled_reqs,
            )
        if not delay_cache_blocks or num_new_tokens or num_lookahead_tokens or num_encoder_tokens:
            raise NotImplementedError(
                "hybridcache: only asynchronous connector loads are supported (the "
                "connector's get_num_new_matched_tokens must return load_kv_async=True)"
            )
        return self._allocate_load(
            request,
            num_new_computed_tokens,
            num_external_computed_tokens,
            full_sequence_must_fit=full_sequence_must_fit,
            reserved_blocks=reserved_blocks,
            skip_zeroing=set(skip_zeroing_group_ids),
        )

    def _allocate_load(
        self,
        request: Request,
        num_local: int,
        num_external: int,
        *,
        full_sequence_must_fit: bool,
        reserved_blocks: int,
        skip_zeroing: set[int],
    ) -> KVCacheBlocks | None:
        """Allocate ``[num_local, num_local + num_external)`` as a step the connector fills.

        The first allocation of the request (local hit held, running slot taken) for the
        external tokens, with nothing committed until :meth:`cache_blocks`.
        """
        rid = request.request_id
        if rid in self._tracked or request.num_computed_tokens:
            raise RuntimeError(f"request {rid}: external tokens for a request already allocated")
        if self._deferred(rid):
            return None
        self._add(request)
        if (full_sequence_must_fit and not self._fits(request, num_local)) or not self._load_fits(
            num_external, reserved_blocks
        ):
            self.stats_counters.allocation_failures += 1
            return None
        alloc = self._allocate(rid, num_external)
        if alloc is None:
            return None
        tr = self._track_first(request, alloc, num_local)
        end = alloc.start + num_external
        alloc = self._only_end_save(rid, alloc, end)
        first_new = len(self._new_block_ids)
        # In flight from here on: nothing is committed, and no state is offered back.
        self._loading[rid] = end
        self._extend_tables(tr, alloc)
        if self.attn_ids and set(self.attn_ids) <= skip_zeroing:
            # The load writes these pages whole; zeroing them could race with it (vLLM's
            # skip_zeroing_group_ids). A failed load frees them, and a page is recorded
            # for zeroing again whenever it is handed out anew.
            del self._new_block_ids[first_new:]
        self.stats_counters.allocations += 1
        self.stats_counters.external_loads += 1
        self.stats_counters.external_tokens += num_external
        return self._take_new_blocks(tr)

    def _only_end_save(self, rid: str, alloc: Allocation, end: int) -> Allocation:
        """Cancel save points inside a loaded range: only the state at its end exists."""
        view = self._tracked[rid].view
        keep: list[SavePoint] = []
        for sp in alloc.save_points:
            if sp.boundary == end:
                keep.append(sp)
            elif sp.boundary in view.save_slots or sp.boundary == view.rolling_boundary:
                self.port.cancel_save(rid, sp.boundary)
                self.stats_counters.external_saves_skipped += 1
        return alloc._replace(save_points=tuple(keep))

    def _load_fits(self, num_external: int, reserved_blocks: int) -> bool:
        """vLLM's gate for async loads: the load's blocks fit next to what live requests
        hold *and* the blocks in-flight prefills still need (``reserved_blocks``, from
        :meth:`_remaining_blocks`). A loaded request waits in vLLM's queue holding its
        blocks and cannot be preempted; two loads admitted into a pool that holds only
        one of them would wait for each other forever."""
        need = len(self.attn_ids) * (num_external // self.block_size) + 2 * self.slot_blocks
        # Snapshots pinned or slots kept while their request still computes in them.
        live = sum(len(tr.pinned) + len(tr.held) for tr in self._tracked.values())
        held = self._held_blocks() + live * self.slot_blocks
        return held + need + reserved_blocks <= self.num_blocks - 1

    def _remaining_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks a request still needs to reach ``num_tokens`` tokens (upper estimate).

        Pages for the units it has no page for, plus two state slots: the save slot of its
        next save point and the snapshot pinned while it computes past it (three, with
        the running slot, for a request not allocated yet).
        """
        tr = self._tracked.get(request_id)
        slots = 2 if tr is not None else 3
        return self._pages_owed(tr, num_tokens) + slots * self.slot_blocks

    # ------------------------------------------------------------------ commits
    def _sync(self, tr: _Tracked) -> None:
        """No commit while a load is in flight: its blocks hold nothing valid yet."""
        if tr.request.request_id not in self._loading:
            super()._sync(tr)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """vLLM's signal that a load completed: commit the loaded prefix as cached entries.

        Raises:
            RuntimeError: a partial load (vLLM 0.32 reports partial loads only through
                ``invalid_block_ids``, which it refuses for models with several groups).
        """
        expected = self._loading.pop(request.request_id, None)
        if expected is not None:
            if num_computed_tokens != expected:
                raise RuntimeError(
                    f"request {request.request_id}: load of {expected} tokens completed "
                    f"with {num_computed_tokens}"
                )
            self.stats_counters.external_loads_completed += 1
        super().cache_blocks(request, num_computed_tokens)

    def free(self, request: Request) -> None:
        """Free; a request freed during its load releases everything the load allocated."""
        rid = request.request_id
        self._offers.pop(rid, None)
        if self._loading.pop(rid, None) is None:
            super().free(request)
            return
        self.stats_counters.external_loads_dropped += 1
        tr = self._tracked.pop(rid, None)
        if tr is not None:
            self._unpin(tr)
        if rid in self.port:
            self.port.free(rid, finished=False)

    # ------------------------------------------------------------------ saves
    def _run_save(self, view: RequestView, sp: SavePoint, end: int) -> bool:
        """Serve the save point as the base class does; offer a state it writes this step.

        The running slot's block (this step's last column) receives the state at ``end``,
        so that block, in every Mamba group, is the hand-off. States loaded by the
        connector are not offered back to it.
        """
        running = view.running_slot
        kept = super()._run_save(view, sp, end)
        in_place = sp.boundary == end and end % self.block_size == 0
        if (
            in_place
            and running >= 0
            and view.id not in self._loading
            and all(b != end for _, _, b in self._offers.get(view.id, ()))
        ):
            self._offers.setdefault(view.id, []).extend(
                (gid, self._state_blocks(running, j), end) for j, gid in enumerate(self.mamba_ids)
            )
            self.stats_counters.boundary_offers += 1
        return kept

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """This step's snapshot blocks, ``{request: [(group, block, boundary)]}``."""
        offers, self._offers = self._offers, {}
        return offers
