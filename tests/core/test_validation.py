"""One test per class of hardening bug (issue 15, manager and hashing): each failed on the
code before the fix (see the commit message), and passes only with the check in place."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridcache.errors import ConfigError, HybridCacheError, InvalidRequestError
from hybridcache.hashing import MultiModalItem, TokenHasher, root_digest
from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.validation import as_count
from tests.core.conftest import tiny_spec
from tests.core.fingerprint import fingerprint

U = 4


def mgr(**kw) -> HybridCacheManager:
    return HybridCacheManager(tiny_spec(), 1 << 20, CacheConfig(hash_unit=U, **kw))


def serve(m, rid, n_tokens, **kw):
    res = m.add_request(rid, n_tokens, **kw)
    total = n_tokens if isinstance(n_tokens, int) else len(n_tokens)
    m.allocate(rid, total - res.hit_tokens)
    m.commit(rid, total)
    m.free(rid)
    return res


def block_digests(n: int) -> list[bytes]:
    return [bytes([i]) * 16 for i in range(n)]


# ---------------------------------------------------------------------- tenant isolation
def test_precomputed_digests_of_another_tenant_never_hit():
    m = mgr(admission="last-token")
    d = block_digests(10)
    serve(m, "a", 40, tenant="victim", digests=d)
    assert m.add_request("same", 41, tenant="victim", digests=d).hit_tokens > 0  # it is cached
    res = m.add_request("evil", 41, tenant="evil", digests=d)
    assert res.hit_tokens == 0 and res.kv_hit_tokens == 0
    res = m.add_request("none", 41, digests=d)  # no tenant is a tenant of its own
    assert res.kv_hit_tokens == 0


def test_precomputed_digests_are_salted_by_lora_and_seed_too():
    d = block_digests(4)
    roots = set()
    for seed, lora in (("", None), ("", "ad"), ("s", None), ("", 7)):
        h = TokenHasher(U, seed=seed, tenant="t", lora=lora)
        h.adopt(d, 16)
        roots.add(tuple(h.digests))
    assert len(roots) == 4


def test_root_digest_encodes_lengths_not_separators():
    """Joined with NUL, tenant 'x\\0l\\0sy' + LoRA 'z' was tenant 'x' + LoRA 'y\\0l\\0sz'."""
    assert root_digest(tenant="x\0l\0sy", lora="z") != root_digest(tenant="x", lora="y\0l\0sz")
    assert root_digest(seed="a\0t\0sb") != root_digest(seed="a", tenant="b")


keys = st.one_of(st.none(), st.text(alphabet="\0lstx\xff", max_size=6))


@settings(max_examples=400, derandomize=True, deadline=None)
@given(a=st.tuples(st.text(alphabet="\0lst", max_size=4), keys, st.one_of(keys, st.integers(-3, 99))),
       b=st.tuples(st.text(alphabet="\0lst", max_size=4), keys, st.one_of(keys, st.integers(-3, 99))))
def test_distinct_keys_give_distinct_roots(a, b):
    same = a == b and all(type(x) is type(y) for x, y in zip(a, b))
    assert (root_digest("xxh3_128", *a) == root_digest("xxh3_128", *b)) == same


def test_lora_int_and_its_digits_differ():
    assert root_digest(lora=5) != root_digest(lora="5")


@pytest.mark.parametrize("tenant", [5, 5.0, b"5", True, ("5",)])
def test_tenant_is_a_str(tenant):
    m = mgr(admission="last-token")
    serve(m, "a", list(range(40)), tenant="5")
    before = fingerprint(m)
    with pytest.raises(InvalidRequestError, match="tenant must be a str"):
        m.add_request("b", list(range(40)), tenant=tenant)
    assert fingerprint(m) == before


@pytest.mark.parametrize("lora", ["adapter", 3, np.int64(3), None])
def test_lora_may_be_str_or_int_as_documented(lora):
    m = mgr()
    m.add_request("r", list(range(9)), lora=lora)
    if isinstance(lora, np.integer):
        m.add_request("same", list(range(9)), lora=3)
        assert m.requests["r"].hasher.root == m.requests["same"].hasher.root


# ---------------------------------------------------------------------- refused = unchanged
@pytest.mark.parametrize(
    "digests, token_ids",
    [([b"ab", "cd"], 8), ([1, 2], 8), ("abcdefgh", 8), (None, 8), ([b"", b"x"], 8),
     (block_digests(2), 8.0), (block_digests(2), True), (block_digests(3), 8)],
)
def test_bad_digests_leave_no_zombie_request(digests, token_ids):
    m = mgr()
    before = fingerprint(m)
    with pytest.raises(InvalidRequestError):
        m.add_request("z", token_ids, digests=digests if digests is not None else iter([b"x"]))
    assert fingerprint(m) == before and "z" not in m.requests
    m.add_request("z", 8, digests=block_digests(2))  # the id is free


@pytest.mark.parametrize("bad", [1.5, 2.0, math.nan, math.inf, True, False, np.float64(3), "3", None])
def test_counts_must_be_integers(bad):
    m = mgr()
    m.add_request("r", list(range(10)))
    before = fingerprint(m)
    for call in (lambda: m.allocate("r", bad), lambda: m.allocate("r", 10, num_draft=bad)):
        with pytest.raises(InvalidRequestError, match="must be an integer"):
            call()
        assert fingerprint(m) == before  # no block taken (1.5 used to take one for good)
    m.allocate("r", 10)
    m.commit("r", 8)
    before = fingerprint(m)
    for call in (lambda: m.commit("r", bad), lambda: m.accept("r", bad)):
        with pytest.raises(InvalidRequestError, match="must be an integer"):
            call()
        assert fingerprint(m) == before


def test_commit_of_a_fraction_is_refused_and_the_request_goes_on():
    """``commit(r, 100.5)`` / ``nan`` were accepted and left the request stuck."""
    m = mgr()
    m.add_request("r", list(range(100)))
    m.allocate("r", 101)
    for bad in (100.5, math.nan):
        with pytest.raises(InvalidRequestError):
            m.commit("r", bad)
    m.commit("r", 101)
    m.free("r")


def test_as_count_accepts_numpy_integers_and_returns_int():
    for v in (np.int8(3), np.uint64(3), np.intp(3), 3):
        assert as_count(v, "n") == 3 and type(as_count(v, "n")) is int
    for v in (np.bool_(True), True, 3.0, np.float32(3)):
        with pytest.raises(InvalidRequestError):
            as_count(v, "n")


# ---------------------------------------------------------------------- exception types
@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.add_request(["r"], [1, 2]),
        lambda m: m.add_request({"r": 1}, [1, 2]),
        lambda m: m.match(["r"]),
        lambda m: m.allocate(["r"], 1),
        lambda m: m.append_tokens({"r"}, [1]),
        lambda m: m.commit(["r"], 1),
        lambda m: m.accept(["r"], 1),
        lambda m: m.free(["r"]),
        lambda m: m.add_request("s", [1, 2], tenant="\ud800"),
        lambda m: m.add_request("s", [1, 2], lora="\udfff"),
        lambda m: m.add_request("s", [1, 2], lora=1.5),
        lambda m: m.add_request("s", [1, 2], lora=[1]),
        lambda m: m.add_request("s", [1, 2], tenant=["t"]),
        lambda m: m.add_request("s", list(range(9)), mm_items=[("img", 0, 4)]),
        lambda m: m.add_request("s", list(range(9)), mm_items=[MultiModalItem(None, 0, 4)]),
        lambda m: m.add_request("s", list(range(9)), mm_items=[MultiModalItem("\ud800", 0, 4)]),
        lambda m: m.add_request("s", list(range(9)), mm_items=[MultiModalItem("i", 1.5, 4)]),
        lambda m: m.add_request("s", list(range(9)), mm_items=5),
    ],
)
def test_bad_input_raises_invalid_request_error_and_changes_nothing(call):
    m = mgr()
    m.add_request("r", list(range(9)))
    before = fingerprint(m)
    with pytest.raises(InvalidRequestError):
        call(m)
    assert fingerprint(m) == before


@pytest.mark.parametrize(
    "kw, field",
    [({"hash_seed": 5}, "hash_seed"), ({"hash_seed": b"s"}, "hash_seed"),
     ({"hash_seed": "\ud800"}, "hash_seed"), ({"hash_unit": 0}, "hash_unit"),
     ({"hash_unit": -16}, "hash_unit"), ({"hash_unit": 16.0}, "hash_unit"),
     ({"alignment": 0}, "alignment"), ({"min_seen": 0}, "min_seen"),
     ({"marconi_window": 0}, "marconi_window"), ({"marconi_alpha": math.nan}, "marconi_alpha"),
     ({"tenant_quotas": {"a": -1}}, "tenant_quotas"), ({"tenant_quotas": {"a": 1.5}}, "tenant_quotas")],
)
def test_settings_are_refused_at_construction_with_the_field_named(kw, field):
    with pytest.raises(ConfigError, match=field) as info:
        CacheConfig(**kw)
    assert isinstance(info.value, HybridCacheError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("unit", [0, -1, 1.5, "16", True])
def test_token_hasher_refuses_a_bad_unit_and_seed(unit):
    with pytest.raises(ConfigError, match="hash_unit"):
        TokenHasher(unit)
    with pytest.raises(ConfigError, match="hash_seed"):
        TokenHasher(16, seed=b"s")


# ---------------------------------------------------------------------- memory
def test_tenant_bytes_drops_tenants_with_nothing_cached():
    m = mgr(admission="last-token")
    for i in range(20):
        serve(m, f"r{i}", list(range(i, i + 12)), tenant=f"t{i}")
    assert len(m.index.tenant_bytes) == 20
    m.clear()
    assert m.index.tenant_bytes == {}


@pytest.mark.parametrize("kind", ["no-attention", "no-state"])
def test_tenant_bytes_drop_with_zero_byte_entries(kind):
    """A model without attention registers 0-byte KV: evicting it after the tenant's
    snapshot (which emptied the entry) must not fail."""
    spec = tiny_spec(attention=kind != "no-attention", state=kind != "no-state")
    m = HybridCacheManager(spec, 1 << 20, CacheConfig(hash_unit=U, admission="last-token"))
    for i in range(6):
        serve(m, f"r{i}", list(range(i, i + 12)), tenant=f"t{i % 2}")
    m.clear()
    assert m.index.tenant_bytes == {}
