"""A ``HybridCacheScheduler`` that skips the partial-page copy of a sub-block hit.

Mutation for ``test_vllm_fine_e2e.py``: named by ``--scheduler-cls vllm_fine_mutant.
PartialPageSkipped`` in the workload's own process (this folder is the script's folder, so
the module is importable there). The request's column then starts from a zeroed block
instead of the cached KV before the hit, and its outputs must move.
"""

from __future__ import annotations

from typing import Any

from hybridcache.adapters.vllm import HybridCacheScheduler


class PartialPageSkipped(HybridCacheScheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        tails = self.kv_cache_manager.tails
        real = tails.restore

        def state_only(rid: str, tail: Any, kv_blocks: Any, state_blocks: Any) -> None:
            real(rid, tail, [], state_blocks)

        tails.restore = state_only

