"""Eviction policies, registered by name.

A policy is one file: a *pure priority function* (what an entry is worth, from its
recency, hits, FLOPs and bytes), the queues that keep evictable entries ranked by it, and
optionally a victim chooser; a ``@register_policy("name")`` on a builder makes it
selectable as ``CacheConfig(eviction="name")`` (vLLM's ``kv_cache_spec_registry`` style).
The :class:`~hybridcache.eviction.Evictor` alone chooses victims, through the policy's
queues and chooser, and owns the arena they free.

Built in: ``lru`` (:mod:`.lru`), ``value`` (GreedyDual-Size-Frequency, :mod:`.value`,
the default), ``marconi`` (:mod:`.marconi`) and ``lru-plain`` (LRU without the
stranded-KV rule, as vLLM evicts: :mod:`.lru_plain`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridcache.errors import UnknownNameError


@dataclass(frozen=True)
class PolicySettings:
    """What a policy builder gets from the index.

    Attributes:
        flops_per_byte_scale: FLOPs per byte of one priority unit (so values are ~O(1)).
        kv_unit_bytes: bytes of one KV unit (every attention group).
        snapshot_evictable: whether a snapshot handle may be evicted now (unpinned).
        marconi_alpha / marconi_window: Marconi's utility weight and candidate window.
    """

    flops_per_byte_scale: float
    kv_unit_bytes: int
    snapshot_evictable: Callable[[Any], bool]
    marconi_alpha: float = 1.0
    marconi_window: int = 64


@dataclass
class PolicyParts:
    """A built policy: the two queues (KV units, snapshots) and, if the policy does not
    simply take the lower of the two queues' tops, its chooser factory
    ``(kv_queue, snapshot_queue) -> chooser`` (see :class:`hybridcache.eviction.LowestFirst`)."""

    kv_queue: Any
    snapshot_queue: Any
    chooser: Callable[[Any, Any], Any] | None = None


PolicyBuilder = Callable[[PolicySettings], PolicyParts]
_REGISTRY: dict[str, PolicyBuilder] = {}


def register_policy(name: str) -> Callable[[PolicyBuilder], PolicyBuilder]:
    """Decorator: make ``builder`` the eviction policy called ``name``."""

    def deco(builder: PolicyBuilder) -> PolicyBuilder:
        if name in _REGISTRY and _REGISTRY[name] is not builder:
            raise ValueError(f"eviction policy {name!r} is registered already")
        _REGISTRY[name] = builder
        return builder

    return deco


def policy_names() -> tuple[str, ...]:
    """Registered names: the built-in ones first, then in registration order."""
    return tuple(_REGISTRY)


def check_policy_name(name: str) -> str:
    if name not in policy_names():
        raise UnknownNameError(f"unknown eviction policy {name!r}; known: {', '.join(_REGISTRY)}")
    return name


def build_policy(name: str, settings: PolicySettings) -> PolicyParts:
    """The queues (and chooser) of the policy called ``name``."""
    return _REGISTRY[check_policy_name(name)](settings)


# The built-in policies register on import, in the order the docs list them (last: they
# import the names above).
from hybridcache.policies import lru, value, marconi, lru_plain  # noqa: E402, F401, I001
