"""hybridcache: prefix caching for hybrid LLMs (attention KV + recurrent state snapshots).

The engine is :class:`~hybridcache.manager.HybridCacheManager`; see ``docs/architecture.md``
for the path of one request and ``docs/api.md`` for the public API. Side packages:
``hybridcache.kernels`` (copy kernels), ``hybridcache.tiers`` (host / Redis offload),
``hybridcache.adapters`` (HF configs, vLLM, reference model), ``hybridcache.sim`` (simulator).
"""

from hybridcache.config import CacheConfig
from hybridcache.errors import (
    CapacityError,
    ConfigError,
    HybridCacheError,
    InvalidRequestError,
    OutOfSpaceError,
    SpecError,
    UnknownNameError,
)
from hybridcache.manager import HybridCacheManager
from hybridcache.metrics import CacheMetrics
from hybridcache.pending_saves import WithdrawnSave
from hybridcache.plans import Allocation, CopyPlan, MatchResult, SavePoint
from hybridcache.presets import get_preset, preset_names
from hybridcache.spec import ModelSpec

__version__ = "0.2.0"

__all__ = [
    "Allocation",
    "CacheConfig",
    "CacheMetrics",
    "CapacityError",
    "ConfigError",
    "CopyPlan",
    "HybridCacheError",
    "HybridCacheManager",
    "InvalidRequestError",
    "MatchResult",
    "ModelSpec",
    "OutOfSpaceError",
    "SavePoint",
    "SpecError",
    "UnknownNameError",
    "WithdrawnSave",
    "get_preset",
    "preset_names",
]
