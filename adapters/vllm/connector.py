"""``HybridCacheConnector``: a vLLM v1 KV connector that offloads KV + recurrent state.

Load it without registering anything::

    --kv-transfer-config '{"kv_connector": "HybridCacheConnector",
        "kv_connector_module_path": "hybridcache.adapters.vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"tier": "redis", "url": "redis://cache:6379",
                                      "secret": "...32 random bytes..."}}'

(The ``vllm.general_plugins`` entry point also registers the name, so
``kv_connector_module_path`` may be left out.) Requires ``--enable-prefix-caching
--mamba-cache-mode align`` on a hybrid model; see ``docs/vllm.md``.

How it follows vLLM 0.32:

* **Save.** In ``align`` mode vLLM hands the scheduler's connector every recurrent-state
  block it commits, with its exact block id and token boundary
  (``SchedulerOutput.kv_connector_block_state.boundary_state_offloads``), in the step whose
  forward pass writes it. :meth:`build_connector_meta` turns each boundary into save jobs:
  KV-only entries for the request's blocks not yet in the tier, and one hybrid entry (KV of
  the last block + the state) at the boundary. The worker copies those blocks out in
  :meth:`wait_for_save` of the same step, right after the forward pass, and puts the
  entries (RedisTier writes them in the background). Nothing is left pending when a request
  finishes, so :meth:`request_finished_all_groups` never delays a free.
* **Load.** :meth:`get_num_new_matched_tokens` probes the tier for the request's block
  keys (one ``contains_many`` round trip) and offers the longest prefix that ends on a
  hybrid entry, whole blocks only, never the prompt's last token, and only beyond the local
  hit. The load is *asynchronous* in vLLM's sense: the request waits one step
  (``WAITING_FOR_REMOTE_KVS``) while the worker writes the KV blocks and the state into the
  block that vLLM's ``align`` mode reads the resumed state from (the Mamba column
  ``hit / block_size - 1``); the worker's own ``preprocess_mamba`` copy then starts the
  request from it. A synchronous load would be too late: the worker copies the state
  column before the connector's ``start_load_kv`` runs.
* **Failure.** A missing, corrupt or unreachable entry at load time is reported through
  ``failed_recving``, the only failure path vLLM 0.32 accepts for models with several KV
  cache groups: the request is recomputed from scratch and never offered an external hit
  again. The connector requires ``kv_load_failure_policy='recompute'`` and sets it (a
  cache miss must not fail a request).
"""

from __future__ import annotations

import atexit
import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .connector_config import (
    ConnectorConfig,
    classify_groups,
    layout_fingerprint,
    open_tier,
    parse_config,
)
from .connector_plan import (
    KIND_HYBRID,
    KIND_KV,
    ConnectorMetadata,
    JobKey,
    LoadJob,
    RequestTrack,
    SaveJob,
    best_hit,
    eligible,
    group_offers,
    load_kinds,
    new_track,
)
from .connector_worker import BlockIO, WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("hybridcache.adapters.vllm.connector")


class HybridCacheConnector(KVConnectorBase_V1, SupportsHMA):
    """Prefix KV pages + recurrent states of hybrid models in a HostTier or RedisTier."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        self.config: ConnectorConfig = parse_config(ktc.kv_connector_extra_config, ktc.kv_role)
        self.kv_groups, self.state_groups = classify_groups(kv_cache_config)
        if vllm_config.parallel_config.world_size > 1:
            raise ValueError(
                "HybridCacheConnector: tensor/pipeline parallelism is not supported (entries "
                "hold one worker's KV shard; per-rank keys are not implemented)"
            )
        if not vllm_config.cache_config.enable_prefix_caching:
            raise ValueError("HybridCacheConnector needs --enable-prefix-caching")
        self.block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        align = kv_cache_config.cache_hit_alignment_tokens or self.block_size
        self.align_blocks = max(1, align // self.block_size)
        self.fingerprint = layout_fingerprint(vllm_config, kv_cache_config, self.config.model_id)
        backend = vllm_config.parallel_config.distributed_executor_backend
        self.tier = open_tier(self.config, backend if isinstance(backend, str) else None)
        self._cache_hit_source = (
            CacheHitSource.HOST if self.config.tier == "host" else CacheHitSource.EXTERNAL_UNSPECIFIED
        )
        # Scheduler side.
        self._tracks: dict[str, RequestTrack] = {}
        self._loads: list[LoadJob] = []
        self.lookups = 0
        self.hit_tokens = 0
        self.save_jobs = 0
        # Worker side.
        self._worker: WorkerSide | None = None
        self._recving: set[str] = set()
        self._failed: set[str] = set()
        if role == KVConnectorRole.SCHEDULER and ktc.kv_load_failure_policy != "recompute":
            logger.info("HybridCacheConnector: kv_load_failure_policy set to 'recompute'")
            ktc.kv_load_failure_policy = "recompute"
        logger.info(
            "HybridCacheConnector (%s): tier %s, fingerprint %s, block %d, load=%s save=%s",
            role.name, self.config.tier, self.fingerprint, self.block_size,
            self.config.load, self.config.save,
        )

    @property
    def requires_kv_delivery(self) -> bool:
        """A dropped save is a future miss, never lost output."""
        return False

    # ================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        groups = self._kv_cache_config.kv_cache_groups
        io = BlockIO(
            {g: groups[g].layer_names for g in self.kv_groups + self.state_groups},
            self._kv_cache_config.num_blocks,
        )
        io.register(kv_caches)
        self._worker = WorkerSide(
            self.tier, self.fingerprint, io, self.kv_groups, self.state_groups, self.config.ttl_s
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Run this step's loads (their requests are not in this step's batch)."""
        meta = self._connector_metadata
        if not isinstance(meta, ConnectorMetadata) or not meta.loads:
            return
        for job in meta.loads:
            ok = self._worker is not None and self._worker.load(job)
            (self._recving if ok else self._failed).add(job.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete in :meth:`start_load_kv`; nothing to wait for per layer."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Saves read whole blocks after the forward pass (:meth:`wait_for_save`)."""

    def wait_for_save(self) -> None:
        """Copy this step's boundary blocks to the tier (after the forward pass wrote them)."""
        meta = self._connector_metadata
        if isinstance(meta, ConnectorMetadata) and meta.saves and self._worker is not None:
            self._worker.save(meta.saves)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Loads done this step; failed ones are also reported as finished (vLLM's contract)."""
        done, failed = self._recving | self._failed, set(self._failed)
        self._recving.clear()
        self._failed.clear()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return None, res.finished_recving or None

    def shutdown(self) -> None:
        """Flush queued saves; close this connector's RedisTier (a HostTier is shared)."""
        if self.config.tier == "redis":
            self.tier.close()
            atexit.unregister(self.tier.close)
        else:
            self.tier.flush(timeout_s=10.0)

    def worker_stats(self) -> dict[str, Any]:
        """The worker side's counters (empty on the scheduler side)."""
        return dict(vars(self._worker.stats)) if self._worker is not None else {}

    # ================================================================== scheduler side
    def _track(self, request: Request) -> RequestTrack | None:
        track = self._tracks.get(request.request_id)
        if track is None and eligible(request):
            track = new_track(
                request, self.config.default_tenant, self.config.hash_algo, self.block_size
            )
            self._tracks[request.request_id] = track
        return track

    def _keys(self, track: RequestTrack, kind: str, digests: list[bytes]) -> list[JobKey]:
        return [JobKey(track.tenant, kind, d) for d in digests]

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond the local hit whose KV and state the tier holds (loaded async)."""
        track = self._track(request)
        if track is None:
            return 0, False
        track.pending = None
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_blocks <= 0:
            return 0, False
        try:
            digests = track.digests_upto(max_blocks)
            keys = self._keys(track, KIND_KV, digests) + self._keys(track, KIND_HYBRID, digests)
            found = self.tier.contains_many([k.entry_key(self.fingerprint) for k in keys])
        except Exception as exc:  # noqa: BLE001 - a lookup failure is a miss
            logger.warning("HybridCacheConnector: lookup failed: %r", exc)
            return 0, False
        kv, hybrid = found[:max_blocks], found[max_blocks:]
        track.stored, hit = best_hit(kv, hybrid, self.align_blocks)
        track.hybrid = {i for i, h in enumerate(hybrid) if h}
        self.lookups += 1
        if not self.config.load or track.no_external or hit * self.block_size <= num_computed_tokens:
            return 0, False
        track.pending = (hit, load_kinds(kv, hit))
        return hit * self.block_size - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Plan the load into the blocks vLLM just allocated for the external tokens."""
        track = self._tracks.get(request.request_id)
        if num_external_tokens == 0 or track is None:
            return
        pending, track.pending = track.pending, None
        table = blocks.get_block_ids()
        hit = pending[0] if pending else 0
        total = hit * self.block_size
        first = (total - num_external_tokens) // self.block_size
        if pending is None or (total - num_external_tokens) % self.block_size or first < 0:
            # Not the hit we offered: load nothing; failing the request's load makes vLLM
            # recompute it from scratch rather than trust unwritten blocks.
            self._loads.append(LoadJob(request.request_id, 0, [], {}, {}))
            return
        kinds = pending[1]
        self._loads.append(
            LoadJob(
                req_id=request.request_id,
                first_block=first,
                keys=[JobKey(track.tenant, kinds[i], track.digests[i]) for i in range(first, hit)],
                kv_blocks={g: list(table[g][first:hit]) for g in self.kv_groups},
                state_blocks={g: table[g][hit - 1] for g in self.state_groups},
            )
        )
        self.hit_tokens += num_external_tokens
        track.stored = max(track.stored, hit)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads, and saves for every boundary state vLLM commits this step."""
        meta = ConnectorMetadata(loads=self._loads)
        self._loads = []
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        if self.config.save and block_state is not None:
            for req_id, offers in block_state.boundary_state_offloads.items():
                track = self._tracks.get(req_id)
                if track is None:
                    continue
                try:
                    meta.saves += self._plan_saves(track, offers, block_state)
                except Exception as exc:  # noqa: BLE001 - a planning failure skips the save
                    logger.warning("HybridCacheConnector: save planning failed: %r", exc)
        self.save_jobs += len(meta.saves)
        return meta

    def _plan_saves(self, track: RequestTrack, offers: Any, block_state: Any) -> list[SaveJob]:
        jobs: list[SaveJob] = []
        table = None
        for boundary, state_blocks in group_offers(offers, self.state_groups, self.block_size):
            n = boundary // self.block_size
            if n - 1 in track.hybrid and track.stored >= n:
                continue  # already in the tier (e.g. the block this request loaded)
            table = table or block_state.get_block_ids(track.request.request_id)
            if table is None:
                return jobs
            digests = track.digests_upto(n)
            for i in range(min(track.stored, n - 1), n):
                kv_blocks = {g: table[g][i] for g in self.kv_groups}
                if any(b <= 0 for b in kv_blocks.values()):
                    return jobs  # a gap: later entries would be unreachable
                hybrid = i == n - 1
                kind = KIND_HYBRID if hybrid else KIND_KV
                jobs.append(
                    SaveJob(track.request.request_id, i, JobKey(track.tenant, kind, digests[i]),
                            kv_blocks, state_blocks if hybrid else None)
                )
            track.stored = max(track.stored, n)
            track.hybrid.add(n - 1)
        return jobs

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """A failed load: vLLM recomputes the request; do not offer it a hit again."""
        for rid in connector_output.failed_recving or ():
            track = self._tracks.get(rid)
            if track is not None:
                track.no_external = True

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._tracks.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Saves ran in the steps that wrote the blocks: the blocks may be freed now."""
        self._tracks.pop(request.request_id, None)
        return False, None

    def scheduler_stats(self) -> dict[str, int]:
        """Lookups, external hit tokens and save jobs planned by the scheduler side."""
        return {"lookups": self.lookups, "hit_tokens": self.hit_tokens,
                "save_jobs": self.save_jobs}
