"""``HybridCacheScheduler``: vLLM's scheduler with hybridcache as its KV cache manager.

Use it without forking vLLM::

    vllm serve MODEL --enable-prefix-caching --mamba-cache-mode align \\
        --no-async-scheduling \\
        --scheduler-cls hybridcache.adapters.vllm.HybridCacheScheduler \\
        --additional-config '{"hybridcache": {"eviction": "value"}}'

Everything vLLM's ``Scheduler`` does is kept (batching, chunked prefill, preemption,
outputs, metrics); only ``self.kv_cache_manager`` is replaced by
:class:`~.manager.HybridKVCacheManager` and the ``align``-mode chunk split is changed: a
prefill chunk never runs past a block boundary, so every block boundary's state is left in
a block the manager can keep as a snapshot (vLLM's own split keeps only some of them), and
it ends at every save point of the sub-block tails (:mod:`.fine`: hits and states on
16-token boundaries inside vLLM's inflated block, ``--prefix-match-unit`` to change the
unit), whose copies go to the worker through ``kv_cache_block_copies``.

With ``--kv-transfer-config`` naming :class:`~.connector.HybridCacheConnector`, the manager
is :class:`~.manager_external.ConnectorKVCacheManager`: it accepts the connector's
asynchronous loads of external tokens and hands it every snapshot it keeps, in the step
that writes it, so the device cache and the host / Redis tier work together.

With speculative decoding (``--speculative-config``), the manager is
:class:`~.spec_decode.SpecDecodeKVCacheManager` (:mod:`.spec_decode`): draft-state columns
map to the core's draft slots, so a rejected token's state is never registered.

Configurations the adapter does not support are refused here, at engine start, with the
reason (speculative decoding together with a KV connector, asynchronous scheduling /
pipeline parallelism, KV connectors other than ``HybridCacheConnector``, encoder-decoder
models, models whose groups use different block sizes).
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from hybridcache.manager import CacheConfig

from . import spec_decode
from .kv_events import VllmKVEvents
from .manager import HybridKVCacheManager
from .manager_external import ConnectorKVCacheManager

logger = init_logger(__name__)

#: Keys of ``--additional-config '{"hybridcache": {...}}'`` passed to :class:`CacheConfig`.
CONFIG_KEYS = (
    "admission",
    "eviction",
    "hash_algo",
    "hash_seed",
    "marconi_alpha",
    "marconi_window",
    "min_seen",
    "tenant_quotas",
)
#: Keys of the same section read by the scheduler itself (not core settings).
SCHEDULER_KEYS = ("prefix_match_unit",)
#: Our hash unit inside vLLM's block when neither ``--prefix-match-unit`` nor
#: ``{"hybridcache": {"prefix_match_unit": N}}`` sets one (0 there: block boundaries only).
DEFAULT_PREFIX_MATCH_UNIT = 16


def cache_config_from(additional_config: Any) -> CacheConfig:
    """Our policy settings from vLLM's ``additional_config["hybridcache"]`` (may be absent).

    Raises:
        ValueError: an unknown key (listing the known ones).
    """
    section = {}
    if isinstance(additional_config, dict):
        section = dict(additional_config.get("hybridcache") or {})
    unknown = sorted(set(section) - set(CONFIG_KEYS) - set(SCHEDULER_KEYS))
    if unknown:
        raise ValueError(
            f"hybridcache: unknown additional_config keys {unknown}; known: "
            f"{', '.join(CONFIG_KEYS + SCHEDULER_KEYS)}"
        )
    return CacheConfig(**{k: v for k, v in section.items() if k in CONFIG_KEYS})


def _is_hybridcache_connector(connector: Any) -> bool:
    from .connector import HybridCacheConnector

    return isinstance(connector, HybridCacheConnector)


class HybridCacheScheduler(Scheduler):
    """vLLM ``Scheduler`` whose KV cache manager is hybridcache's (see module docstring)."""

    kv_cache_manager: HybridKVCacheManager  # type: ignore[assignment]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._check_supported()
        config = cache_config_from(self.vllm_config.additional_config)
        manager_cls = HybridKVCacheManager if self.connector is None else ConnectorKVCacheManager
        manager_cls, spec_kwargs = spec_decode.manager_for(self.vllm_config, manager_cls)
        self.kv_cache_manager = manager_cls(
            self.kv_cache_config,
            max_model_len=self.max_model_len,
            config=config,
            hf_config=getattr(self.vllm_config.model_config, "hf_config", None),
            enable_caching=bool(self.cache_config.enable_prefix_caching),
            log_stats=self.log_stats,
            prefix_match_unit=spec_decode.sub_block_unit(self.vllm_config, self.prefix_match_unit()),
            **spec_kwargs,
        )
        if self.enable_kv_cache_events:  # vLLM's KV events for routers (see .kv_events)
            self.kv_cache_manager.kv_events = VllmKVEvents.for_adapter(
                self.kv_cache_manager, self.hash_block_size)
        if self.connector is not None:
            # vLLM bound its own manager before we replaced it.
            self.connector.bind_kv_cache_manager(self.kv_cache_manager)
        if self.kv_cache_manager.block_size != self.block_size:
            raise ValueError(
                f"hybridcache: scheduler block size {self.block_size} differs from the cache "
                f"groups' {self.kv_cache_manager.block_size}"
            )
        # Our split runs for every hybrid model (see _mamba_block_aligned_split).
        self.need_mamba_block_aligned_split = self.has_mamba_layers
        # Backends that export a state from inside a chunk (vLLM's "prefill checkpoint":
        # some Mamba2 / KDA kernels) write into the block table's second-to-last column;
        # never give them a chunk that crosses a block boundary.
        self.split_every_block = bool(self.mamba_has_prefill_checkpoint_blocks)
        logger.info(
            "hybridcache: manager over %d vLLM blocks of %d tokens (admission=%s, eviction=%s)",
            self.kv_cache_manager.num_blocks,
            self.block_size,
            config.admission,
            config.eviction,
        )

    def prefix_match_unit(self) -> int | None:
        """Our hash unit inside vLLM's block, or ``None`` (hits on block boundaries only).

        ``--prefix-match-unit`` if given, else ``{"hybridcache": {"prefix_match_unit": N}}``
        (0: off), else :data:`DEFAULT_PREFIX_MATCH_UNIT`. Only hybrid models' inflated
        blocks get sub-block tails, and not with a KV connector (tails stay on the device).

        Raises:
            ValueError: a unit that does not divide the block.
        """
        unit = self.cache_config.prefix_match_unit
        if unit is None:
            extra = self.vllm_config.additional_config
            section = (extra.get("hybridcache") or {}) if isinstance(extra, dict) else {}
            unit = int(section.get("prefix_match_unit", DEFAULT_PREFIX_MATCH_UNIT))
        if not unit or not self.has_mamba_layers or unit >= self.block_size:
            return None
        if self.block_size % unit:
            raise ValueError(f"hybridcache: prefix_match_unit {unit} does not divide the "
                             f"block size {self.block_size}")
        return None if self.connector is not None else unit

    def _check_supported(self) -> None:
        """Refuse configurations whose block handling the adapter does not implement."""
        reasons = []
        if self.has_mamba_layers and self.cache_config.mamba_cache_mode != "align":
            reasons.append(
                f"mamba_cache_mode={self.cache_config.mamba_cache_mode!r}: the worker keeps "
                "per-block states only in 'align' mode (pass --mamba-cache-mode align and "
                "--enable-prefix-caching)"
            )
        if self.vllm_config.max_concurrent_batches > 1:
            reasons.append(
                "asynchronous scheduling or pipeline parallelism (entries are committed one "
                "step after they are scheduled; pass --no-async-scheduling)"
            )
        if self.connector is not None and not _is_hybridcache_connector(self.connector):
            reasons.append(
                f"KV connector {type(self.connector).__name__} (only HybridCacheConnector: "
                "its loads are asynchronous and its saves follow this manager's snapshots)"
            )
        if self.is_encoder_decoder:
            reasons.append("encoder-decoder models")
        if self.hash_block_size != self.block_size and not self.has_mamba_layers:
            reasons.append(
                f"--prefix-match-unit {self.hash_block_size} below the block "
                f"{self.block_size} without state layers (sub-block hits are made for "
                "hybrid models' inflated blocks)"
            )
        if reasons:
            raise ValueError("HybridCacheScheduler does not support: " + "; ".join(reasons))

    def _mamba_block_aligned_split(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        """End a prefill chunk at the next boundary where the manager will save a state.

        The worker writes a recurrent state only at a step's end, into the block of the
        step's last column, so every admission point (end of prompt, branch point,
        interval) must be a step end; the manager answers where the next one is. For
        backends that export checkpoints from inside a chunk, chunks also stop at every
        block boundary, so the export never fires and cannot write into a block we use.
        Decode steps are not split.
        """
        start = request.num_computed_tokens + num_new_local_computed_tokens
        start += num_external_computed_tokens
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if start >= prefill_end:
            return num_new_tokens
        end = start + num_new_tokens
        if self.split_every_block:
            end = min(end, (start // self.block_size + 1) * self.block_size)
        save = self.kv_cache_manager.next_save_boundary(request, start, end)
        if save is not None:
            end = save
        return max(end - start, 0)

    def hybridcache_stats(self) -> dict[str, object]:
        """Our engine's metrics and the adapter's counters (JSON-friendly)."""
        return self.kv_cache_manager.stats()
