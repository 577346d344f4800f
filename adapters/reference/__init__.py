"""A tiny hybrid decoder (KDA + full attention) in torch that proves cached == uncached.

``python -m hybridcache.adapters.reference.check`` serves a random workload through
:class:`~hybridcache.manager.HybridCacheManager` with caching on and off and compares every
generated token and its logits; see ``docs/reference-model.md``.
"""

from __future__ import annotations

from .config import ReferenceConfig, model_spec
from .kda import kda_chunked, kda_recurrent, short_conv
from .model import DenseContext, PagedContext, ReferenceModel
from .runner import RequestResult, Runner, RunnerConfig, RunStats, ngram_draft
from .workload import Session, Turn, WorkloadShape, make_workload

__all__ = [
    "DenseContext",
    "PagedContext",
    "ReferenceConfig",
    "ReferenceModel",
    "RequestResult",
    "RunStats",
    "Runner",
    "RunnerConfig",
    "Session",
    "Turn",
    "WorkloadShape",
    "kda_chunked",
    "kda_recurrent",
    "make_workload",
    "model_spec",
    "ngram_draft",
    "short_conv",
]
