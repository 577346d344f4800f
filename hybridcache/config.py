"""The settings of a manager: :class:`CacheConfig`, checked when it is made.

Kept in a module of its own (not with the plans the manager hands out, where it used to be)
because it is what a user writes first and what every other module reads: the simulator's
baselines, the adaptive policy's candidates and the vLLM adapter's flags are all settings.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridcache.validation import check_cache_config


@dataclass(frozen=True)
class CacheConfig:
    """Settings of a manager; baselines of the simulator are settings too.

    Args:
        hash_unit: tokens per hash unit and per KV page.
        hash_algo: ``xxh3_128`` (default) or ``sha256``.
        hash_seed: stable salt of every chain (same value on every node of a deployment).
        admission: snapshot rules, see :mod:`hybridcache.policy`.
        eviction: ``value`` (default), ``lru`` or ``marconi``.
        marconi_alpha / marconi_window: Marconi's utility weight and candidate window.
        tenant_quotas: bytes of cached entries each tenant may hold (``None``: unlimited);
            the key ``"*"`` applies to tenants not listed.
        alignment: byte alignment of pages and slots in the arena (a power of two).
        min_seen: a prompt-end snapshot is saved once its prefix was seen this many times.

    Raises:
        ConfigError: a field of a wrong type or value (the message names it).
    """

    hash_unit: int = 16
    hash_algo: str = "xxh3_128"
    hash_seed: str = ""
    admission: str = "last-token+turn-end+seen-branch"
    eviction: str = "value"
    marconi_alpha: float = 1.0
    marconi_window: int = 64
    tenant_quotas: dict[str, int] | None = None
    alignment: int = 256
    min_seen: int = 1

    def __post_init__(self) -> None:
        """Refuse a bad field here, where it is set (:class:`~hybridcache.errors.ConfigError`
        naming it), not at the first request that reads it."""
        check_cache_config(self)
