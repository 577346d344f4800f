"""Key layout: tenant-scoped, model-scoped, keyed digests that hide the prefix hash."""

from __future__ import annotations

import pytest
from tiers_testlib import FINGERPRINT, SECRET, key

from hybridcache.tiers import EntryKey, KeyCodec, TenantLimits, TierConfigError


def test_layout_is_namespace_tenant_fingerprint_digest():
    codec = KeyCodec("hc", SECRET)
    name = codec.entry_key(key("alice", 1))
    ns, tenant, fp, digest = name.split(":")
    assert (ns, tenant, fp) == ("hc", "alice", FINGERPRINT)
    assert digest[0] + digest[-1] == "{}"  # the hash tag keeps an entry on one cluster slot
    assert len(digest) == 34 and int(digest[1:-1], 16) >= 0
    assert name.startswith(codec.tenant_prefix("alice"))


def test_digest_hides_the_prefix_hash_and_differs_per_tenant_model_and_secret():
    k = key("alice", 1)
    codec = KeyCodec("hc", SECRET)
    digest = codec.digest(k)
    assert k.prefix_hex not in codec.entry_key(k)
    assert codec.digest(key("bob", 1)) != digest  # same prefix hash, other tenant
    assert codec.digest(key("alice", 1, fingerprint="feedface")) != digest
    assert KeyCodec("hc", SECRET + b"!").digest(k) != digest
    assert KeyCodec("other", SECRET).digest(k) == digest  # namespace is a separate component
    assert codec.digest(key("alice", 1)) == digest  # deterministic across calls / engines


def test_ledger_keys_share_a_hash_tag_and_the_tenant_prefix():
    codec = KeyCodec("hc", SECRET)
    z, h = codec.ledger_keys("alice")
    assert z.startswith("hc:alice:") and h.startswith("hc:alice:")
    tag = lambda s: s[s.index("{") + 1 : s.index("}")]  # noqa: E731
    assert tag(z) == tag(h) == "hc:alice"


@pytest.mark.parametrize("tenant", ["", "a:b", "a{b}", "x" * 65, "é", "a b", None])
def test_bad_tenant_names_are_refused(tenant):
    with pytest.raises(TierConfigError):
        EntryKey(tenant, FINGERPRINT, b"\x01")


def test_bad_keys_and_secrets_are_refused():
    with pytest.raises(TierConfigError):
        EntryKey("alice", "fp:x", b"\x01")
    with pytest.raises(TierConfigError):
        EntryKey("alice", FINGERPRINT, b"")
    with pytest.raises(TierConfigError):
        EntryKey("alice", FINGERPRINT, "not-bytes")  # type: ignore[arg-type]
    with pytest.raises(TierConfigError):
        EntryKey.from_int("alice", FINGERPRINT, 1 << 128)
    with pytest.raises(TierConfigError):
        KeyCodec("hc", b"short")
    with pytest.raises(TierConfigError):
        KeyCodec("h:c", SECRET)


def test_from_int_is_big_endian_fixed_width():
    k = EntryKey.from_int("alice", FINGERPRINT, 0x0102)
    assert k.prefix_hash == b"\x00" * 14 + b"\x01\x02"


def test_limits_resolution_and_validation():
    limits = TenantLimits(
        default_ttl_s=60, tenant_ttls={"bob": 5}, default_quota=100, tenant_quotas={"bob": 7}
    )
    assert limits.ttl_for("alice") == 60 and limits.ttl_for("bob") == 5
    assert limits.ttl_for("bob", 1.5) == 1.5  # a session's own TTL wins
    assert limits.quota_for("alice") == 100 and limits.quota_for("bob") == 7
    assert TenantLimits().ttl_for("x") is None and TenantLimits().quota_for("x") is None
    for bad in ({"default_ttl_s": 0}, {"default_quota": -1}, {"tenant_ttls": {"a:b": 1}}):
        with pytest.raises(TierConfigError):
            TenantLimits(**bad)
    with pytest.raises(TierConfigError):
        limits.ttl_for("alice", float("inf"))
