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
* :class:`LastDraftTails` (mutation): after a step with drafts, a sub-block tail copies the
  column of the step's *last* input (the state after its last draft, rejected when not
  every draft was accepted) instead of the column holding the state at the tail's
  boundary: the registered state of a rejected draft. The state oracle
  (:mod:`vllm_specdec_oracle`) must see it.
"""

from __future__ import annotations

from typing import Any

from hybridcache.adapters.vllm import HybridCacheScheduler
from hybridcache.adapters.vllm.spec_decode import SpecDecodeKVCacheManager


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


class _LastDraftTailsManager(SpecDecodeKVCacheManager):
    """The mutant manager of :class:`LastDraftTails` (a tail after a step with drafts is
    made from column ``cur + q - 1``, the state after the step's last input)."""

    def _accept_step(self, tr: Any) -> None:
        st = self._spec.get(tr.request.request_id)
        if st is not None and st.step is not None:
            self._last_steps[tr.request.request_id] = st.step  # (c, q, d)
        super()._accept_step(tr)

    def _tell_tails(self, tr: Any, n: int) -> None:
        rid = tr.request.request_id
        st, step = self._spec.get(rid), self._last_steps.get(rid)
        if st is None or st.landed is None or st.landed[1] != n or step is None:
            return super()._tell_tails(tr, n)
        last = st.landed[2] + step[1] - 1  # cur + q - 1
        tails, real = self.tails, self.tails.computed

        def computed(rid_: str, u: int, prompt: int, kv: Any, state: Any, *,
                     make_tail: bool = True) -> None:
            if state:
                state = [tr.tables[g][last] for g in self.mamba_ids]
            real(rid_, u, prompt, kv, state, make_tail=make_tail)

        tails.computed = computed
        try:
            super()._tell_tails(tr, n)
        finally:
            del tails.computed


class LastDraftTails(HybridCacheScheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        km = self.kv_cache_manager
        assert isinstance(km, SpecDecodeKVCacheManager), "LastDraftTails needs --speculative-config"
        km.__class__ = _LastDraftTailsManager
        km._last_steps = {}
