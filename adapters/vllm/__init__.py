"""Run hybridcache inside vLLM: a drop-in scheduler, and a KV connector to host / Redis tiers.

Importing this package checks the installed vLLM first (:mod:`.version`, which reads
package metadata only): without vLLM the error says to install the ``vllm`` extra; with a
release outside :data:`~.version.SUPPORTED_VLLM` the error names the supported ones. The
classes are imported on first use, so that vLLM's plugin loader (which imports
:mod:`.plugin`, and so this package, in every vLLM process) pays for no vLLM module it
does not need. See ``docs/vllm.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

from .version import SUPPORTED_VLLM, UnsupportedVllmError, check_vllm_version

VLLM_VERSION = check_vllm_version()

_LAZY = {
    "HybridCacheConnector": ".connector",
    "HybridCacheScheduler": ".scheduler",
    "cache_config_from": ".scheduler",
    "HybridKVCacheManager": ".manager",
    "pool_spec": ".spec",
    "spec_from_kv_cache_config": ".spec",
    "spec_from_vllm_config": ".spec",
}

__all__ = ["SUPPORTED_VLLM", "VLLM_VERSION", "UnsupportedVllmError", "check_vllm_version", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
