"""Chained hashing: determinism across processes, isolation, incremental appends."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridcache.errors import InvalidRequestError, UnknownNameError
from hybridcache.hashing import (
    MultiModalItem,
    TokenHasher,
    as_token_array,
    hash_function,
    hash_units,
    root_digest,
)

TOKENS = list(range(1000, 1100))

_CHILD = """
import sys
from hybridcache.hashing import TokenHasher
h = TokenHasher(16, sys.argv[1], seed="deploy-7", tenant="acme")
h.extend(list(range(1000, 1100)))
print(",".join(d.hex() for d in h.digests))
"""


@pytest.mark.parametrize("algo", ["sha256", "xxh3_128"])
def test_same_digests_in_two_processes(algo):
    outs = [
        subprocess.run([sys.executable, "-c", _CHILD, algo], capture_output=True, text=True, check=True).stdout.strip()
        for _ in range(2)
    ]
    h = TokenHasher(16, algo, seed="deploy-7", tenant="acme")
    h.extend(TOKENS)
    assert outs[0] == outs[1] == ",".join(d.hex() for d in h.digests)
    assert len(h.digests) == 6


def test_tenants_never_collide_on_same_tokens():
    seen = {}
    for tenant in [None, "", "a", "b", "acme"]:
        h = TokenHasher(16, tenant=tenant)
        h.extend(TOKENS)
        for d in h.digests:
            assert d not in seen, f"tenant {tenant!r} collides with {seen[d]!r}"
            seen[d] = tenant


def test_lora_and_seed_change_every_unit():
    base = TokenHasher(16)
    base.extend(TOKENS)
    for kw in ({"lora": "adapter-1"}, {"seed": "x"}, {"algo": "sha256"}):
        h = TokenHasher(16, **kw)
        h.extend(TOKENS)
        assert not set(h.digests) & set(base.digests)


def test_multimodal_identifier_changes_only_covered_units_and_after():
    plain = TokenHasher(16)
    plain.extend(TOKENS)
    img = TokenHasher(16, mm_items=[MultiModalItem("img-a", offset=40, length=10)])
    img.extend(TOKENS)
    other = TokenHasher(16, mm_items=[MultiModalItem("img-b", offset=40, length=10)])
    other.extend(TOKENS)
    assert img.digests[:2] == plain.digests[:2]  # units 0, 1 end before token 40
    assert img.digests[2] != plain.digests[2]
    assert all(a != b for a, b in zip(img.digests[2:], other.digests[2:]))


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200), cuts=st.lists(st.integers(0, 200), max_size=5))
@pytest.mark.parametrize("mm", [(), tuple(MultiModalItem(f"img{k}", offset=8 * k + 3, length=8) for k in range(25))])
def test_incremental_equals_one_shot(tokens, cuts, mm):
    """Appends in any pieces give the one-shot digests: a partial unit is completed first,
    with the multimodal keys of the unit it completes."""
    one = TokenHasher(8, mm_items=mm)
    one.extend(tokens)
    inc = TokenHasher(8, mm_items=mm)
    prev = 0
    for c in sorted(set(min(c, len(tokens)) for c in cuts)) + [len(tokens)]:
        inc.extend(tokens[prev:c])
        prev = c
    assert inc.digests == one.digests
    assert inc.num_tokens == len(tokens)


def test_chain_depends_on_prefix():
    a = hash_units(as_token_array([1] * 32), 16, root_digest())
    b = hash_units(as_token_array([2] * 16 + [1] * 16), 16, root_digest())
    assert a[1] != b[1]  # same unit content, different prefix


@pytest.mark.parametrize(
    "bad, msg",
    [([1, -2, 3], "negative token id -2 at index 1"), ([1.5, 2.0], "must be integers"),
     ([2**32], "exceeds"), ([[1, 2], [3, 4]], "flat sequence")],
)
def test_bad_tokens_are_named(bad, msg):
    with pytest.raises(InvalidRequestError, match=msg):
        TokenHasher(16).extend(bad)


def test_unknown_algorithm_lists_known():
    with pytest.raises(UnknownNameError, match="xxh3_128, sha256"):
        TokenHasher(16, algo="md5")


def test_numpy_input_matches_list():
    a = TokenHasher(16)
    a.extend(np.array(TOKENS, dtype=np.int32))
    b = TokenHasher(16)
    b.extend(TOKENS)
    assert a.digests == b.digests


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_units_are_the_exact_token_bytes(algo):
    """Each unit hashes parent + its 4-byte little-endian ids, trailing zero ids included
    (a byte-string view of the array would strip them and merge distinct prompts)."""
    fn = hash_function(algo)
    toks = np.array([7] + [0] * 15 + [0] * 16 + [3, 0] * 8, dtype=np.uint32)
    h, want = b"root", []
    for u in range(3):
        h = fn(h + toks[u * 16 : (u + 1) * 16].astype("<u4").tobytes())
        want.append(h)
    assert hash_units(toks, 16, b"root", algo) == want


@pytest.mark.parametrize("code", ["i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8"])
@pytest.mark.parametrize("order", ["<", ">"])
def test_every_integer_dtype_and_byte_order_reads_ids_by_value(code, order):
    dt = np.dtype(code).newbyteorder(order)
    ids = [0, 1, 5, 100, 127]
    assert as_token_array(np.array(ids, dtype=dt)).tolist() == ids
    assert as_token_array(np.array(ids, dtype=dt)).dtype == np.dtype(np.uint32)
    if dt.itemsize == 8:  # 2^32 and above: refused, never truncated to small ids
        for big in (1 << 32, (1 << 32) + 5, np.iinfo(dt).max):
            for ids in ([1, big], [0, big, 0], [big] * 3):  # zeros: the byte-swapped view is small
                with pytest.raises(InvalidRequestError, match="exceeds"):
                    as_token_array(np.array(ids, dtype=dt))
    if dt.kind == "i":
        with pytest.raises(InvalidRequestError, match="negative"):
            as_token_array(np.array([1, -1], dtype=dt))


@pytest.mark.parametrize(
    "bad, msg",
    [(np.array([True, False]), "integers"), (np.array([1.0, 2.0]), "integers"),
     (np.array([1, 2], dtype=object), "integers"), ([2**64 + 1], "outside"), ([1, 2**70], "outside"),
     ([[1, 2], [3]], "flat"), (np.zeros(3, dtype="c8"), "integers"), (np.array(["1"]), "integers")],
)
def test_non_integer_or_huge_ids_are_named(bad, msg):
    with pytest.raises(InvalidRequestError, match=msg):
        as_token_array(bad)


def test_native_uint32_is_returned_as_is():
    """The engine's common input: no copy and no check on the hot path."""
    arr = np.arange(64, dtype=np.uint32)
    assert as_token_array(arr) is arr
