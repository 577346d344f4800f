"""Offload tiers below the device cache: host memory and Redis.

A tier stores *entries*: the KV pages and the recurrent-state snapshot of one prefix, as one
unit (restoring one without the other corrupts a hybrid model's output). Every tier fails
closed: a missing, corrupt, foreign or unreachable entry is a miss, never wrong data and
never an exception in the engine's path.

Quick start::

    from hybridcache.tiers import Entry, EntryKey, HostTier, RedisTier, TenantLimits

    key = EntryKey("alice", spec.fingerprint(), prefix_hash_bytes)
    entry = Entry({"kv": kv_pages, "state": snapshot}, meta={"tokens": 4096})
    redis_tier = RedisTier("redis://cache:6379", secret=b"...32 random bytes...",
                           limits=TenantLimits(default_ttl_s=3600, default_quota=8 << 30))
    redis_tier.put(key, entry)            # returns at once; written in the background
    hit = redis_tier.get(key)             # Entry or None
    n = redis_tier.longest_prefix(keys)   # leading keys with complete entries

With the manager (phase 2): ``OffloadCoordinator(manager, storage, [HostTier(...),
RedisTier(...)])`` demotes what the device evicts and, from ``prefetch(request_id)`` after
``add_request``, loads a prefix's KV and snapshot back so the manager's match hits.

See ``docs/tiers.md`` for deployment, key layout, format and failure behaviour.
"""

from hybridcache.tiers.auth import EntryAuth
from hybridcache.tiers.base import Tier, TierStats
from hybridcache.tiers.errors import (
    ChecksumMismatchError,
    EntryFormatError,
    FingerprintMismatchError,
    FormatVersionError,
    InvalidEntryError,
    KeyMismatchError,
    MissingPieceError,
    TierConfigError,
    TierError,
    TruncatedEntryError,
)
from hybridcache.tiers.format import (
    FORMAT_VERSION,
    EncodedEntry,
    Entry,
    Header,
    PieceInfo,
    decode,
    encode,
    from_blob,
    parse_header,
    to_blob,
    verify_header,
)
from hybridcache.tiers.host import HostTier
from hybridcache.tiers.keys import EntryKey, KeyCodec
from hybridcache.tiers.limits import TenantLimits
from hybridcache.tiers.offload import OffloadCoordinator
from hybridcache.tiers.offload_plan import LoadPlan, OffloadMetrics
from hybridcache.tiers.offload_policy import DemotionPolicy
from hybridcache.tiers.redis_conn import connect
from hybridcache.tiers.redis_tier import RedisTier

__all__ = [
    "FORMAT_VERSION",
    "ChecksumMismatchError",
    "DemotionPolicy",
    "EncodedEntry",
    "Entry",
    "EntryAuth",
    "EntryFormatError",
    "EntryKey",
    "FingerprintMismatchError",
    "FormatVersionError",
    "Header",
    "HostTier",
    "InvalidEntryError",
    "KeyCodec",
    "KeyMismatchError",
    "LoadPlan",
    "MissingPieceError",
    "OffloadCoordinator",
    "OffloadMetrics",
    "PieceInfo",
    "RedisTier",
    "TenantLimits",
    "Tier",
    "TierConfigError",
    "TierError",
    "TierStats",
    "TruncatedEntryError",
    "connect",
    "decode",
    "encode",
    "from_blob",
    "parse_header",
    "to_blob",
    "verify_header",
]
