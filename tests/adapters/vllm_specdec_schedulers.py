"""``HybridCacheScheduler`` variants for ``test_vllm_specdec_e2e.py``.

Named by ``--scheduler-cls vllm_specdec_schedulers.<Class>`` in the workload's own process
(this folder is the script's folder, so the module is importable there; the engine runs
in that process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the worker's modules are this
process's).

* :class:`ConvWindowsNotSpread` (mutation): the worker's speculative forwards no longer
  give every state column its conv window (``cpu_kernels.spread_conv_windows``) while the
  scheduler still makes tails at any accepted boundary: a tail inside a step with drafts
  pairs the right recurrent state with a stale conv window, and an output that hits one
  must move.
* :class:`CurrentColumnOnly`: the scheduler as on a GPU (vLLM's kernels keep the conv
  window in column ``cur`` only): after a step with drafts, tails only where the step's
  first state lands. Correct on any worker; run here to measure what that mode caches.
"""

from __future__ import annotations

from typing import Any

from hybridcache.adapters.vllm import HybridCacheScheduler


class ConvWindowsNotSpread(HybridCacheScheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from hybridcache.adapters.vllm import cpu_kernels, kda_layer

        def not_spread(conv_buf: Any, cols: Any, width: int) -> None:
            return None

        cpu_kernels.spread_conv_windows = not_spread
        kda_layer.spread_conv_windows = not_spread


class CurrentColumnOnly(HybridCacheScheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kv_cache_manager.columns_whole = False
