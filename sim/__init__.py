"""Trace simulator: replay real and synthetic traces through :class:`HybridCacheManager`.

Modules, one job each: :mod:`.traces` (Mooncake and token readers), :mod:`.generate`
(synthetic workloads), :mod:`.policies` (baselines as manager settings), :mod:`.replay` (one
policy at one capacity), :mod:`.runner` (capacity sweeps), :mod:`.vllm_native` (vLLM's own
manager), :mod:`.report` (tables, JSON, plot) and :mod:`.cli` (``hybridcache-sim``). See
``docs/simulator.md``.
"""
