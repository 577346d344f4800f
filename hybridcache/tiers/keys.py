"""Entry keys and the Redis key layout.

An entry is addressed by :class:`EntryKey` = (tenant, model fingerprint, prefix hash). The
tiers never trust the prefix hash alone:

* **Tenant isolation.** The hash chain is already salted with the tenant upstream (two
  tenants with the same prompt get different prefix hashes). The tiers add a second,
  independent wall: the tenant is part of every key and of every stored header, and a read
  checks the header's tenant against the key's, so an entry is never returned across tenants
  even if two tenants' hashes collided.
* **Unguessable keys.** Redis keys do not carry the raw prefix hash but a keyed digest::

      tenant_key = BLAKE2b(key=secret, person="hc-tier-tenant", data=tenant)
      digest     = BLAKE2b(key=tenant_key, person="hc-tier-entry",
                           data=fingerprint || 0x00 || prefix_hash)[:16 bytes]

  BLAKE2b in keyed mode is a MAC (like HMAC-SHA256, faster, one pass). Without the
  deployment secret nobody who can list or probe keys (another tenant with a Redis login,
  a leaked ``SCAN``) can tell which prompt a key belongs to, nor compute the key of a prompt
  it knows; and the per-tenant sub-key makes one tenant's digests useless for any other.

Redis key layout (namespace, tenant and fingerprint are validated to exclude ``:``, ``{``
and ``}``; literal braces below are Redis Cluster hash tags)::

    ns:tenant:fingerprint:{digest}               manifest of one entry (names its pieces)
    ns:tenant:fingerprint:{digest}:gen:i         piece chunk i of the entry's generation gen
    ns:tenant:quota:{ns:tenant}:z / :h           quota ledger (sorted set / sizes)

Every key of a tenant starts with ``ns:tenant:``, so a Redis ACL user per tenant
(``~hc:alice:*``) confines a compromised engine to its own tenant's keys. An entry's
manifest and chunks share the ``{digest}`` hash tag, so they live on one Cluster slot (one
``MGET``, one Lua script); the ledger keys share ``{ns:tenant}`` for the same reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hybridcache.tiers.auth import MIN_SECRET_BYTES, EntryAuth
from hybridcache.tiers.errors import TierConfigError

__all__ = ["MIN_SECRET_BYTES", "DIGEST_BYTES", "EntryKey", "KeyCodec", "check_name"]

#: Tenants, namespaces and fingerprints: safe inside Redis keys and ACL patterns.
_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")

#: Bytes of the keyed digest kept in a key (128 bits: collisions are not a concern).
DIGEST_BYTES = 16


def check_name(value: object, what: str) -> str:
    """Validate a tenant, namespace or fingerprint for use inside a key.

    Raises:
        TierConfigError: if ``value`` is not 1-64 characters of ``[A-Za-z0-9_.-]``. Colons and
            braces are refused so that no tenant can forge another's key prefix or hash tag.
    """
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise TierConfigError(f"{what}: must be 1-64 characters of [A-Za-z0-9_.-], got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class EntryKey:
    """Address of one entry: the KV pages and state snapshot of one prefix of one tenant.

    Args:
        tenant: tenant name, ``[A-Za-z0-9_.-]{1,64}``.
        fingerprint: model layout fingerprint (:meth:`hybridcache.spec.ModelSpec.fingerprint`).
        prefix_hash: the chained prefix hash (1-64 bytes), already tenant-salted upstream.
    """

    tenant: str
    fingerprint: str
    prefix_hash: bytes

    def __post_init__(self) -> None:
        check_name(self.tenant, "EntryKey.tenant")
        check_name(self.fingerprint, "EntryKey.fingerprint")
        if not isinstance(self.prefix_hash, bytes) or not 1 <= len(self.prefix_hash) <= 64:
            raise TierConfigError(
                f"EntryKey.prefix_hash: must be 1-64 bytes, got {self.prefix_hash!r:.80}"
            )

    @classmethod
    def from_int(cls, tenant: str, fingerprint: str, value: int, nbytes: int = 16) -> EntryKey:
        """Build a key from an integer hash (e.g. xxh3-128 ``intdigest``), big-endian."""
        if not isinstance(value, int) or value < 0:
            raise TierConfigError(f"EntryKey.prefix_hash: need a non-negative int, got {value!r}")
        try:
            raw = value.to_bytes(nbytes, "big")
        except OverflowError:
            raise TierConfigError(
                f"EntryKey.prefix_hash: {value} does not fit in {nbytes} bytes"
            ) from None
        return cls(tenant, fingerprint, raw)

    @property
    def prefix_hex(self) -> str:
        return self.prefix_hash.hex()


class KeyCodec:
    """Turns :class:`EntryKey` into Redis key strings with a keyed, per-tenant digest.

    Args:
        namespace: first key component; lets several deployments share one Redis.
        secret: deployment secret, at least 16 bytes (a str is encoded as UTF-8), or an
            :class:`~hybridcache.tiers.auth.EntryAuth` built from it; identical on every
            engine that shares the cache (a different secret is a different, disjoint cache).
    """

    def __init__(self, namespace: str, secret: bytes | str | EntryAuth) -> None:
        self.namespace = check_name(namespace, "namespace")
        self.auth = secret if isinstance(secret, EntryAuth) else EntryAuth(secret)

    def digest(self, key: EntryKey) -> str:
        """Hex keyed digest of (fingerprint, prefix hash) under the tenant's sub-key."""
        return self.auth.prefix_digest(
            key.fingerprint, key.tenant, key.prefix_hash, DIGEST_BYTES
        ).hex()

    def entry_key(self, key: EntryKey) -> str:
        """``ns:tenant:fingerprint:{digest}``: the entry's manifest key (chunks extend it)."""
        return f"{self.namespace}:{key.tenant}:{key.fingerprint}:{{{self.digest(key)}}}"

    def tenant_prefix(self, tenant: str) -> str:
        """Prefix of every key of ``tenant`` (for ACL key patterns and ``SCAN MATCH``)."""
        return f"{self.namespace}:{check_name(tenant, 'tenant')}:"

    def ledger_keys(self, tenant: str) -> tuple[str, str]:
        """The quota ledger's sorted set and hash, on one cluster slot (shared hash tag)."""
        base = f"{self.tenant_prefix(tenant)}quota:{{{self.namespace}:{tenant}}}"
        return f"{base}:z", f"{base}:h"
