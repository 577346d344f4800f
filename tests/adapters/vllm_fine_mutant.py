"""Mutated ``HybridCacheScheduler`` classes for the end-to-end mutation tests.

Named by ``--scheduler-cls vllm_fine_mutant.<Class>`` in the workload's own process (this
folder is the script's folder, so the module is importable there; the engine runs in
that process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

* :class:`PartialPageSkipped` (``test_vllm_fine_e2e.py``): skips the partial-page copy of
  a sub-block hit. The request's column then starts from a zeroed block instead of the
  cached KV before the hit, and its outputs must move.
* :class:`ConvWindowsNotSpread` (``test_vllm_specdec_e2e.py``): the worker's speculative
  forwards no longer give every state column its conv window
  (``cpu_kernels.spread_conv_windows``) while the scheduler still makes tails at any
  accepted boundary: a tail inside a step with drafts pairs the right recurrent state
  with a stale conv window, and an output that hits one must move.
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


class ConvWindowsNotSpread(HybridCacheScheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from hybridcache.adapters.vllm import cpu_kernels, kda_layer

        def not_spread(conv_buf: Any, cols: Any, width: int) -> None:
            return None

        cpu_kernels.spread_conv_windows = not_spread
        kda_layer.spread_conv_windows = not_spread
