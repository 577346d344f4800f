"""Per-tenant TTLs and byte quotas, shared by every tier.

Agents pause between turns for seconds (tool calls) to hours (humans); how long their cache
is worth keeping is a tenant (or session) decision, not a tier one. Quotas stop one tenant's
burst from evicting every other tenant's working set. Both are configured once here and
passed to each tier, so host memory and Redis enforce the same rules.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from hybridcache.tiers.errors import TierConfigError
from hybridcache.tiers.keys import check_name


@dataclass(frozen=True)
class TenantLimits:
    """TTLs and quotas per tenant, with defaults for tenants not listed.

    Args:
        default_ttl_s: TTL of an entry whose tenant has none and whose put gave none
            (``None``: entries live until evicted).
        tenant_ttls: tenant -> TTL in seconds.
        default_quota: byte quota of tenants not listed (``None``: unlimited).
        tenant_quotas: tenant -> byte quota (payload + header bytes held by the tier).
    """

    default_ttl_s: float | None = None
    tenant_ttls: Mapping[str, float] = field(default_factory=dict)
    default_quota: int | None = None
    tenant_quotas: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tenant_ttls", dict(self.tenant_ttls))
        object.__setattr__(self, "tenant_quotas", dict(self.tenant_quotas))
        check_ttl(self.default_ttl_s, "default_ttl_s")
        _check_quota(self.default_quota, "default_quota")
        for tenant, ttl in self.tenant_ttls.items():
            check_name(tenant, "tenant_ttls key")
            check_ttl(ttl, f"tenant_ttls[{tenant!r}]")
        for tenant, quota in self.tenant_quotas.items():
            check_name(tenant, "tenant_quotas key")
            _check_quota(quota, f"tenant_quotas[{tenant!r}]")

    def ttl_for(self, tenant: str, override: float | None = None) -> float | None:
        """The TTL of a put: the put's own (session) TTL, else the tenant's, else the default."""
        if override is not None:
            return check_ttl(override, "ttl_s")
        return self.tenant_ttls.get(tenant, self.default_ttl_s)

    def quota_for(self, tenant: str) -> int | None:
        """The tenant's byte quota, ``None`` when unlimited."""
        return self.tenant_quotas.get(tenant, self.default_quota)

    @property
    def has_quotas(self) -> bool:
        return self.default_quota is not None or bool(self.tenant_quotas)


def check_ttl(ttl: float | None, what: str) -> float | None:
    """A TTL must be a positive, finite number of seconds (or ``None``)."""
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl < math.inf:
        raise TierConfigError(f"{what}: must be a positive number of seconds, got {ttl!r}")
    return float(ttl)


def _check_quota(quota: int | None, what: str) -> None:
    if quota is None:
        return
    if isinstance(quota, bool) or not isinstance(quota, int) or quota < 0:
        raise TierConfigError(f"{what}: must be a non-negative number of bytes, got {quota!r}")
