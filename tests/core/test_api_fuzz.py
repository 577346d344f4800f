"""Fuzz of the public manager API with bad input: the documented error, and nothing changed.

Each example builds a manager holding requests in every phase (cached prefixes of two
tenants, a waiting request, one decoding, one inside a speculative step), makes one bad
call drawn from the strategies below (wrong types, dtypes, byte orders, counts, names) and
checks that it raises the library's error (a :class:`HybridCacheError`, of the documented
class) and that :func:`tests.core.fingerprint.fingerprint` (stats, metrics, arena free
lists, every request field, the index's dicts and queues) is what it was.

Refused calls whose fix is the engine port's count-then-take allocation (a refused first
``allocate`` must not refresh the hit's recency, ``OutOfSpaceError`` must evict nothing)
are the two cases at the end.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridcache.errors import (
    CapacityError,
    ConfigError,
    HybridCacheError,
    InvalidRequestError,
    OutOfSpaceError,
)
from hybridcache.hashing import MultiModalItem
from hybridcache.manager import CacheConfig, HybridCacheManager
from tests.core.conftest import tiny_spec
from tests.core.fingerprint import fingerprint

U = 4
MAX_LEN = 256
FUZZ = settings(
    max_examples=300, derandomize=True, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
INT_DTYPES = ["i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8"]


def populated(**cfg) -> HybridCacheManager:
    """A manager with cached entries and live requests in every phase."""
    m = HybridCacheManager(tiny_spec(max_len=MAX_LEN), 1 << 20, CacheConfig(hash_unit=U, **cfg))
    for rid, tenant in (("c1", "x"), ("c2", None)):
        m.add_request(rid, list(range(24)), tenant=tenant)
        m.allocate(rid, 24)
        m.commit(rid, 24)
        m.free(rid)
    m.add_request("w", list(range(20)), tenant="x")  # waiting: matched, not allocated
    m.add_request("a", list(range(100, 110)))  # decoding
    m.allocate("a", 11)
    m.append_tokens("a", [7])
    m.commit("a", 11)
    m.add_request("d", list(range(200, 210)))  # inside a speculative step
    m.allocate("d", 10)
    m.commit("d", 10)
    m.allocate("d", 3, num_draft=2)
    return m


# ---------------------------------------------------------------------- bad values
not_int = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.just(np.bool_(True)),
    st.just(np.float64(2.0)),
    st.just(np.float32(1.5)),
    st.text(max_size=3),
    st.none(),
    st.just([1]),
    st.just(1 + 0j),
)
unhashable = st.sampled_from([[1], {"a": 1}, {1}, bytearray(b"r")])
bad_tenant = st.one_of(
    st.integers(), st.floats(), st.binary(max_size=3), st.booleans(),
    st.just("\ud800"), st.just("ok\udfff"), unhashable,
)
bad_lora = st.one_of(
    st.floats(), st.binary(min_size=1, max_size=3), st.booleans(), st.just("\udc80"), unhashable,
)


@st.composite
def bad_token_array(draw) -> object:
    """Ids that must be refused: out of [0, 2^32-1] in any integer dtype and byte order,
    or not integers at all, or not flat."""
    kind = draw(st.sampled_from(["range", "dtype", "shape", "python"]))
    n = draw(st.integers(1, 12))
    if kind == "range":
        code = draw(st.sampled_from(["i1", "i2", "i4", "i8", "u8"]))
        order = draw(st.sampled_from("<>"))
        info = np.iinfo(np.dtype(code))
        lo, hi = (info.min, -1) if code != "u8" else (1 << 32, info.max)
        if code == "i8" and draw(st.booleans()):
            lo, hi = 1 << 32, info.max
        # Zeros beside the bad id too: a byte-swapped view of small ids is huge, which
        # hid the truncation of big-endian 2^32 (it only showed when every other id was 0).
        base = st.integers(0, 100) if draw(st.booleans()) else st.just(0)
        arr = np.array(draw(st.lists(base, min_size=n, max_size=n)), dtype=code)
        big = st.integers(lo, hi)
        if lo > 0:  # multiples of 2^32: their byte-swapped view fits 32 bits
            big = st.one_of(big, st.integers(1, hi >> 32).map(lambda k: k << 32))
        arr[draw(st.integers(0, n - 1))] = draw(big)
        return arr.astype(np.dtype(code).newbyteorder(order))
    if kind == "dtype":
        code = draw(st.sampled_from(["f4", "f8", "?", "O", "c8", "U2", "f2"]))
        return np.zeros(n, dtype=code) if code != "O" else np.array([object()] * n)
    if kind == "shape":
        return np.zeros((2, n), dtype=draw(st.sampled_from(INT_DTYPES)))
    return draw(st.sampled_from([
        [1, -1], [2**32], [2**64 + 1], [1, 2**70], [0.5], [1, 2.5], [[1, 2], [3]], ["1"], [None],
        [True, False], "abc", 5, {1, 2}, {"a": 1},
    ]))


@st.composite
def bad_mm_items(draw) -> object:
    ok = MultiModalItem("img", 0, 4)
    bad = draw(st.sampled_from([
        MultiModalItem("img", -1, 4), MultiModalItem("img", 0, 0), MultiModalItem("img", 1.5, 4),
        MultiModalItem("img", 0, 2.0), MultiModalItem("img", True, 4), MultiModalItem(5, 0, 4),
        MultiModalItem(None, 0, 4), MultiModalItem("\ud800", 0, 4), ("img", 0, 4), {"id": "img"}, 7,
    ]))
    return bad if isinstance(bad, int) else [ok, bad]


@st.composite
def bad_digests(draw) -> tuple[object, object]:
    """``(token_ids, digests)`` pairs that must be refused."""
    good = [bytes([i]) * 16 for i in range(5)]
    case = draw(st.sampled_from(["length", "element", "container", "count"]))
    if case == "length":
        return 20, draw(st.sampled_from([[], good[:1], good[:4], good + good[:1]]))  # 5 wanted
    if case == "element":
        d = list(good)
        d[draw(st.integers(0, 4))] = draw(st.sampled_from(["ab", 5, None, b"", [1], 1.0]))
        return 20, d
    if case == "container":
        return 20, draw(st.sampled_from([b"x" * 16, "digests", 5, iter(good), {d: 1 for d in good}]))
    return draw(st.sampled_from([1.5, True, -20, None, object()])), good


@st.composite
def bad_call(draw) -> tuple[str, Callable[[HybridCacheManager], object], type[Exception]]:
    """One refused call: ``(label, call, expected error class)``."""
    rid = draw(st.sampled_from(["w", "a", "d"]))
    live = draw(st.sampled_from(["w", "a", "d"]))
    op = draw(st.sampled_from([
        "add_tokens", "add_id", "add_tenant", "add_lora", "add_mm", "add_digests",
        "append", "allocate", "allocate_draft", "commit", "accept", "free", "match", "unknown",
    ]))
    err: type[Exception] = InvalidRequestError
    if op == "add_tokens":
        t = draw(bad_token_array())
        return op, lambda m: m.add_request("new", t), err
    if op == "add_id":
        i = draw(st.one_of(unhashable, st.sampled_from(["w", "a", "d"])))
        return op, lambda m: m.add_request(i, [1, 2, 3]), err
    if op == "add_tenant":
        t = draw(bad_tenant)
        return op, lambda m: m.add_request("new", list(range(9)), tenant=t), err
    if op == "add_lora":
        lo = draw(bad_lora)
        return op, lambda m: m.add_request("new", list(range(9)), lora=lo), err
    if op == "add_mm":
        items = draw(bad_mm_items())
        return op, lambda m: m.add_request("new", list(range(9)), mm_items=items), err
    if op == "add_digests":
        n, d = draw(bad_digests())
        return op, lambda m: m.add_request("new", n, tenant="x", digests=d), err
    if op == "append":
        t = draw(st.one_of(bad_token_array(), st.just(list(range(MAX_LEN)))))
        return op, lambda m: m.append_tokens(live, t), err
    if op == "allocate":
        n = draw(st.one_of(not_int, st.integers(max_value=0)))
        return op, lambda m: m.allocate(rid, n), err
    if op == "allocate_draft":
        k = draw(st.one_of(not_int, st.integers(max_value=-1), st.integers(4, 10)))
        return op, lambda m: m.allocate("a", 4, num_draft=k), err
    if op == "commit":
        # Only commit("a", 11) is valid: "w" is not allocated, "d" has drafts to accept.
        n = draw(st.one_of(not_int, st.just(math.nan), st.just(100.5),
                           st.integers().filter(lambda n: n != 11)))
        return op, lambda m: m.commit(rid, n), err
    if op == "accept":
        n = draw(st.one_of(not_int, st.just(1.5), st.integers(max_value=0), st.integers(4, 99)))
        return op, lambda m: m.accept("d", n), err
    if op == "free":
        i = draw(st.one_of(unhashable, st.sampled_from(["nope", "c1", 3, None])))
        return op, lambda m: m.free(i), err
    if op == "match":
        i = draw(st.one_of(unhashable, st.just("nope")))
        return op, lambda m: m.match(i), err
    i = draw(unhashable)
    return op, lambda m: m.allocate(i, 1), err


@FUZZ
@given(call=bad_call(), cfg=st.sampled_from([{}, {"eviction": "lru"}, {"tenant_quotas": {"x": 1 << 14}},
                                          {"admission": "adaptive"}]))
def test_refused_call_raises_the_documented_error_and_changes_nothing(call, cfg):
    label, fn, err = call
    m = populated(**cfg)
    before = fingerprint(m)
    with pytest.raises(err):
        fn(m)
    assert fingerprint(m) == before, f"{label}: refused call changed the manager"
    # ... and the manager still works: every live request can go on.
    m.commit("a", 11)
    m.accept("d", 1)
    m.free("d")
    m.add_request("after", list(range(24)), tenant="x")
    m.allocate("after", 24)


# ---------------------------------------------------------------------- good values
@FUZZ
@given(
    code=st.sampled_from(INT_DTYPES),
    order=st.sampled_from("<>="),
    ids=st.lists(st.integers(0, 127), min_size=1, max_size=40),
)
def test_every_integer_dtype_and_byte_order_hashes_as_the_list(code, order, ids):
    m = populated()
    arr = np.array(ids, dtype=np.dtype(code).newbyteorder(order))
    m.add_request("p", ids + [0], tenant="x")
    m.add_request("q", np.concatenate([arr, np.zeros(1, dtype=arr.dtype)]), tenant="x")
    assert m.requests["p"].hasher.digests == m.requests["q"].hasher.digests
    assert m.match("p") == m.match("q")


@pytest.mark.parametrize("code", ["<i8", ">i8", "<u8", ">u8", ">u4", ">i4"])
def test_ids_past_32_bits_never_alias_small_ids(code):
    """A big-endian 64-bit id of 2^32 was read as token 0 and hit another prompt."""
    if code.endswith("4"):
        arr = np.array([1, 2, 3, 4, 5], dtype=code)  # in range: must equal the list
        m = populated()
        m.add_request("p", arr)
        m.add_request("q", [1, 2, 3, 4, 5])
        assert m.requests["p"].hasher.digests == m.requests["q"].hasher.digests
        return
    m = populated()
    m.add_request("zeros", [0] * 24)
    m.allocate("zeros", 24)
    m.commit("zeros", 24)
    m.free("zeros")
    before = fingerprint(m)
    for ids in ([0, 0, 0, 1 << 32], [1 << 32] * 25, [(1 << 32) + 7, 0]):
        with pytest.raises(InvalidRequestError, match="exceeds"):
            m.add_request("p", np.array(ids, dtype=code))
    assert fingerprint(m) == before


# ---------------------------------------------------------------------- settings
bad_config = st.sampled_from([
    ("hash_unit", 0), ("hash_unit", -4), ("hash_unit", 4.0), ("hash_unit", True), ("hash_unit", "16"),
    ("marconi_window", 0), ("marconi_window", 2.5), ("marconi_alpha", math.nan),
    ("marconi_alpha", math.inf), ("marconi_alpha", -1.0), ("marconi_alpha", "1"),
    ("min_seen", 0), ("min_seen", -1), ("min_seen", 1.5), ("alignment", 0), ("alignment", 3),
    ("alignment", 256.0), ("hash_seed", 5), ("hash_seed", b"seed"), ("hash_seed", "\ud800"),
    ("hash_seed", None), ("admission", None), ("eviction", 3), ("hash_algo", None),
    ("tenant_quotas", {"x": -1}), ("tenant_quotas", {"x": 1.5}), ("tenant_quotas", {"x": "1GiB"}),
    ("tenant_quotas", {5: 100}), ("tenant_quotas", {"x": True}), ("tenant_quotas", [("x", 1)]),
])


@FUZZ
@given(field_value=bad_config)
def test_bad_setting_is_refused_at_construction_with_the_field_named(field_value):
    field, value = field_value
    with pytest.raises(ConfigError, match=field):
        CacheConfig(**{field: value})


@pytest.mark.parametrize(
    "capacity", ["8GiB", "1000000", 1e6, 1048576.0, None, True, 0, -1, [1 << 20]]
)
def test_capacity_must_be_an_int_number_of_bytes(capacity):
    with pytest.raises(ConfigError, match="capacity_bytes.*parse_size"):
        HybridCacheManager(tiny_spec(), capacity)


def test_numpy_integer_capacity_and_counts_are_accepted():
    m = HybridCacheManager(tiny_spec(), np.int64(1 << 20), CacheConfig(hash_unit=U))
    m.add_request("r", np.arange(9, dtype=np.int16))
    m.allocate("r", np.int32(9), num_draft=np.uint8(0))
    m.commit("r", np.int64(9))
    m.free("r")


def test_capacity_of_one_block_that_serves_no_request_is_refused():
    """One block is a slab of pages or a state block, never both: no request fits."""
    probe = HybridCacheManager(tiny_spec(), 1 << 20, CacheConfig(hash_unit=U))
    one = probe.layout.block_bytes
    with pytest.raises(CapacityError, match="needs at least"):
        HybridCacheManager(tiny_spec(), one, CacheConfig(hash_unit=U))
    m = HybridCacheManager(tiny_spec(), 2 * one, CacheConfig(hash_unit=U))  # the least that serves
    m.add_request("r", [1, 2, 3])
    m.allocate("r", 3)


@pytest.mark.parametrize("args", [("not a spec", 1 << 20, None), (None, 1 << 20, None)])
def test_manager_arguments_of_a_wrong_type_are_config_errors(args):
    with pytest.raises(ConfigError):
        HybridCacheManager(*args)
    with pytest.raises(ConfigError, match="config"):
        HybridCacheManager(tiny_spec(), 1 << 20, {"hash_unit": 16})


def test_every_refusal_is_a_library_error():
    """The classes above are all HybridCacheError (callers catch one base class)."""
    for cls in (InvalidRequestError, ConfigError, CapacityError):
        assert issubclass(cls, HybridCacheError) and issubclass(cls, ValueError)


# ---------------------------------------------------------------------- count, then take
def _eviction_order(refuse: bool) -> list[tuple]:
    """What LRU evicts, one entry at a time, after an optional refused first allocate of a
    request that hits the oldest cached prefix."""
    m = populated(eviction="lru")
    m.add_request("long", list(range(24)), tenant="x")  # hits c1, the oldest prefix
    if refuse:
        with pytest.raises(InvalidRequestError, match="max_model_len"):
            m.allocate("long", MAX_LEN)
    order = []
    while m.index.evict_one():
        order.append((dict(m.index.evictions), dict(m.index.tenant_bytes)))
    return order


def test_refused_first_allocate_leaves_recency_unchanged():
    """A first ``allocate`` refused for length holds and releases the hit today, which
    makes the hit prefix the most recent: the refused call changes what is evicted."""
    assert _eviction_order(refuse=True) == _eviction_order(refuse=False)


def test_out_of_space_evicts_nothing():
    """An allocation that cannot fit even after evicting every cached entry must evict
    nothing (today the allocator evicts as it goes, then finds it is short)."""
    probe = HybridCacheManager(tiny_spec(), 1 << 20, CacheConfig(hash_unit=U))
    lay = probe.layout
    m = HybridCacheManager(tiny_spec(max_len=1 << 16), 4 * lay.block_bytes, CacheConfig(hash_unit=U))
    m.add_request("c", list(range(8)))
    m.allocate("c", 8)
    m.commit("c", 8)
    m.free("c")
    assert len(m.index.heads) == 1
    too_many = 4 * max(lay.pages_per_block, 1) * U + U
    m.add_request("huge", list(range(1000, 1000 + too_many)))
    before = fingerprint(m)
    with pytest.raises(OutOfSpaceError):
        m.allocate("huge", too_many)
    assert fingerprint(m) == before
