"""Configuration of :class:`~.connector.HybridCacheConnector`: settings, tier, fingerprint.

Everything here is decided once, at engine start, from vLLM's ``kv_transfer_config``:

* :func:`parse_config` reads ``kv_connector_extra_config`` and refuses unknown keys and
  bad values with an error that names the field, so a typo fails at start-up instead of
  silently disabling the cache.
* :func:`open_tier` builds the tier both connector roles talk to. The scheduler-side and
  worker-side connectors are separate objects (and, with a multi-process executor,
  separate processes), and the tier is the only thing they share: RedisTier works across
  processes; HostTier is a per-process object, so it is shared through a named registry and
  only allowed when the worker runs in the scheduler's process (``uni`` executor).
* :func:`layout_fingerprint` names the cache layout. Entries hold raw block bytes, so an
  entry may only be read by an engine with the same model, dtype, block size, group layout
  and vLLM release; the fingerprint is part of every key (a different layout is a disjoint
  cache, never a wrong read).
* :func:`classify_groups` splits vLLM's KV cache groups into full-attention groups (KV
  pages) and Mamba-family groups (recurrent states) and refuses anything else.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from hybridcache.hashing import HASH_ALGOS
from hybridcache.tiers import HostTier, RedisTier, TenantLimits, Tier
from hybridcache.tiers.keys import MIN_SECRET_BYTES, check_name
from hybridcache.tiers.redis_tier import SECRET_ENV

logger = logging.getLogger("hybridcache.adapters.vllm.connector")

#: Bumped when the entry layout written by the connector changes (part of the fingerprint).
CONNECTOR_FORMAT = 1

#: Keys of ``kv_connector_extra_config`` and what they mean (also the error message).
CONFIG_KEYS = {
    "tier": "'redis' or 'host' (default: 'redis' when 'url' is given, else 'host')",
    "url": "Redis URL (redis://, rediss://, unix://, redis-cluster://); required for 'redis'",
    "secret": "deployment secret for Redis key digests, >= 16 bytes (or HYBRIDCACHE_TIER_SECRET)",
    "namespace": "first component of every Redis key (default 'hc')",
    "host_bytes": "HostTier capacity in bytes (default 4 GiB)",
    "host_name": "name of the shared in-process HostTier (default 'default')",
    "ttl_s": "time to live of saved entries in seconds (default: the tier's)",
    "default_tenant": "tenant of requests without cache_salt (default 'default')",
    "model_id": "model identity used in the fingerprint instead of the model path",
    "hash_algo": f"prefix hash chain: {' or '.join(HASH_ALGOS)} (default xxh3_128)",
}

DEFAULT_HOST_BYTES = 4 << 30


class ConnectorConfigError(ValueError):
    """A bad ``kv_connector_extra_config`` value (the message names the field)."""


@dataclass(frozen=True)
class ConnectorConfig:
    """Parsed connector settings (see :data:`CONFIG_KEYS`)."""

    tier: str
    url: str | None
    secret: bytes | None
    namespace: str
    host_bytes: int
    host_name: str
    ttl_s: float | None
    default_tenant: str
    model_id: str | None
    hash_algo: str
    load: bool
    save: bool


def _opt_str(extra: dict[str, Any], key: str) -> str | None:
    value = extra.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise ConnectorConfigError(f"kv_connector_extra_config.{key}: need a non-empty string")
    return value


def _secret(extra: dict[str, Any]) -> bytes | None:
    raw = extra.get("secret", os.environ.get(SECRET_ENV))
    if raw is None:
        return None
    if isinstance(raw, str):
        raw = raw.encode()
    if not isinstance(raw, bytes) or len(raw) < MIN_SECRET_BYTES:
        raise ConnectorConfigError(
            f"kv_connector_extra_config.secret: need at least {MIN_SECRET_BYTES} bytes "
            f"(or set {SECRET_ENV})"
        )
    return raw


def _number(extra: dict[str, Any], key: str, default: Any, kind: type) -> Any:
    value = extra.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConnectorConfigError(f"kv_connector_extra_config.{key}: need a positive number")
    if kind is int and int(value) != value:
        raise ConnectorConfigError(f"kv_connector_extra_config.{key}: need an integer")
    return kind(value)


def parse_config(extra: dict[str, Any] | None, kv_role: str | None) -> ConnectorConfig:
    """Validate ``kv_connector_extra_config``; ``kv_role`` decides loading and saving.

    ``kv_both`` loads and saves, ``kv_producer`` only saves, ``kv_consumer`` only loads.

    Raises:
        ConnectorConfigError: unknown keys (listing the known ones) or a bad value.
    """
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(CONFIG_KEYS))
    if unknown:
        known = "; ".join(f"{k}: {v}" for k, v in CONFIG_KEYS.items())
        raise ConnectorConfigError(
            f"HybridCacheConnector: unknown kv_connector_extra_config keys {unknown}; known: {known}"
        )
    url = _opt_str(extra, "url")
    tier = extra.get("tier", "redis" if url else "host")
    if tier not in ("redis", "host"):
        raise ConnectorConfigError(
            f"kv_connector_extra_config.tier: 'redis' or 'host', got {tier!r}"
        )
    if tier == "redis" and url is None:
        raise ConnectorConfigError("kv_connector_extra_config.url: required when tier is 'redis'")
    secret = _secret(extra)
    if tier == "redis" and secret is None:
        raise ConnectorConfigError(
            "kv_connector_extra_config.secret: required for tier 'redis' "
            f"(or set {SECRET_ENV}); every engine sharing the cache needs the same"
        )
    hash_algo = extra.get("hash_algo", "xxh3_128")
    if hash_algo not in HASH_ALGOS:
        raise ConnectorConfigError(
            f"kv_connector_extra_config.hash_algo: one of {HASH_ALGOS}, got {hash_algo!r}"
        )
    try:
        namespace = check_name(extra.get("namespace", "hc"), "kv_connector_extra_config.namespace")
        tenant = check_name(
            extra.get("default_tenant", "default"), "kv_connector_extra_config.default_tenant"
        )
    except ValueError as exc:
        raise ConnectorConfigError(str(exc)) from None
    if kv_role not in ("kv_both", "kv_producer", "kv_consumer"):
        raise ConnectorConfigError(f"kv_transfer_config.kv_role: unsupported {kv_role!r}")
    return ConnectorConfig(
        tier=tier,
        url=url,
        secret=secret,
        namespace=namespace,
        host_bytes=_number(extra, "host_bytes", DEFAULT_HOST_BYTES, int),
        host_name=_opt_str(extra, "host_name") or "default",
        ttl_s=_number(extra, "ttl_s", None, float),
        default_tenant=tenant,
        model_id=_opt_str(extra, "model_id"),
        hash_algo=hash_algo,
        load=kv_role in ("kv_both", "kv_consumer"),
        save=kv_role in ("kv_both", "kv_producer"),
    )


_HOST_TIERS: dict[str, HostTier] = {}
_HOST_LOCK = threading.Lock()


def shared_host_tier(name: str, capacity_bytes: int) -> HostTier:
    """The process-wide HostTier called ``name`` (created on first use).

    Both connector roles of one engine (and several engines in one process) find the same
    tier by name; the first caller's capacity wins.
    """
    with _HOST_LOCK:
        tier = _HOST_TIERS.get(name)
        if tier is None:
            tier = _HOST_TIERS[name] = HostTier(capacity_bytes, limits=TenantLimits())
        return tier


def drop_host_tier(name: str) -> None:
    """Forget the shared HostTier ``name`` (tests; the next use creates an empty one)."""
    with _HOST_LOCK:
        _HOST_TIERS.pop(name, None)


def open_tier(cfg: ConnectorConfig, executor_backend: str | None) -> Tier:
    """The tier named by ``cfg`` (a RedisTier is flushed at interpreter exit).

    Raises:
        ConnectorConfigError: tier 'host' with a worker in another process.
    """
    if cfg.tier == "host":
        if executor_backend not in (None, "uni"):
            raise ConnectorConfigError(
                "kv_connector_extra_config.tier: 'host' needs the worker in the scheduler's "
                f"process (executor 'uni'), got {executor_backend!r}; use tier 'redis'"
            )
        return shared_host_tier(cfg.host_name, cfg.host_bytes)
    tier = RedisTier(cfg.url, secret=cfg.secret, namespace=cfg.namespace)
    # The writer thread is a daemon: flush queued saves when the engine process exits.
    atexit.register(tier.close)
    return tier


def classify_groups(kv_cache_config: Any) -> tuple[list[int], list[int]]:
    """(full-attention group ids, Mamba-family group ids) of vLLM's ``KVCacheConfig``.

    Raises:
        ValueError: a group of another kind (sliding window, cross attention, ...), a Mamba
            group not in ``align`` mode, or a model without recurrent layers.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    kv_groups, state_groups, bad = [], [], []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            if spec.mamba_cache_mode != "align":
                bad.append(f"group {gid}: mamba_cache_mode={spec.mamba_cache_mode!r} (need align)")
            state_groups.append(gid)
        elif type(spec) is FullAttentionSpec and getattr(spec, "sliding_window", None) is None:
            kv_groups.append(gid)
        else:
            bad.append(f"group {gid}: {type(spec).__name__}")
    if not state_groups:
        bad.append("no recurrent-state (Mamba/GDN/KDA) group: use vLLM's OffloadingConnector")
    if bad:
        raise ValueError(
            "HybridCacheConnector supports hybrid models with full attention and Mamba-family "
            "layers in --mamba-cache-mode align with --enable-prefix-caching; not: "
            + "; ".join(bad)
        )
    return kv_groups, state_groups


def layout_fingerprint(vllm_config: Any, kv_cache_config: Any, model_id: str | None) -> str:
    """A name for the cache layout, identical in both roles and across restarts.

    Mixes the model identity (``model_id`` or the model path and revision), its dtype, the
    vLLM release, the tensor-parallel size and every group's layer names and spec (block
    size, head counts, state shapes and dtypes), and :data:`CONNECTOR_FORMAT`.
    """
    from .version import installed_vllm_version

    model = vllm_config.model_config
    groups = [
        [list(g.layer_names), repr(g.kv_cache_spec)] for g in kv_cache_config.kv_cache_groups
    ]
    ident = {
        "model": model_id or str(model.model),
        "revision": None if model_id else getattr(model, "revision", None),
        "dtype": str(model.dtype),
        "vllm": installed_vllm_version(),
        "tp": vllm_config.parallel_config.tensor_parallel_size,
        "layout": os.environ.get("VLLM_KV_CACHE_LAYOUT"),
        "groups": groups,
        "format": CONNECTOR_FORMAT,
    }
    blob = json.dumps(ident, sort_keys=True, default=str).encode()
    return "vllm-" + hashlib.blake2b(blob, digest_size=12).hexdigest()
