"""Entry format: exact round trips of every dtype, and a specific error for every defect."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest
import torch
import xxhash
from tiers_testlib import FINGERPRINT, SECRET, assert_same, key

from hybridcache.tiers import (
    ChecksumMismatchError,
    Entry,
    EntryAuth,
    EntryFormatError,
    EntryKey,
    FingerprintMismatchError,
    FormatVersionError,
    InvalidEntryError,
    KeyMismatchError,
    MissingPieceError,
    TruncatedEntryError,
    decode,
    encode,
    from_blob,
    parse_header,
    to_blob,
)
from hybridcache.tiers import format as format_module
from hybridcache.tiers.auth import CHUNK_MACS
from hybridcache.tiers.format import MAX_CHUNKS, MAX_HEADER_BYTES

# Decoded tensors alias immutable bytes by design (see hybridcache.tiers.dtypes).
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable:UserWarning")

K = key("alice", 1)
AUTH = EntryAuth(SECRET)
NUMPY_DTYPES = ["float32", "float16", "int8", "uint8", "float64", "int16", "int32", "int64"]
TORCH_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int8,
    torch.uint8,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int64,
    torch.bool,
]


def _numpy(dtype: str, shape=(3, 5, 7)) -> np.ndarray:
    rng = np.random.default_rng(7)
    if dtype.startswith("float"):
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


def _torch(dtype: torch.dtype, shape=(3, 5, 7)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=dtype)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("chunk_bytes", [0, 64])
def test_numpy_round_trip_is_exact(dtype, chunk_bytes):
    entry = Entry({"x": _numpy(dtype), "y": _numpy(dtype, (2,))})
    out = from_blob(K, to_blob(encode(K, entry, AUTH, chunk_bytes=chunk_bytes)), AUTH)
    assert_same(out, entry)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("chunk_bytes", [0, 64])
def test_torch_round_trip_is_exact(dtype, chunk_bytes):
    entry = Entry({"x": _torch(dtype), "y": _torch(dtype, (1, 1))})
    out = from_blob(K, to_blob(encode(K, entry, AUTH, chunk_bytes=chunk_bytes)), AUTH)
    assert_same(out, entry)


def test_bfloat16_nan_and_inf_payloads_survive():
    raw = np.array([0x7FC1, 0x7F80, 0xFF80, 0x0001, 0x8000], dtype=np.uint16)
    bits = torch.from_numpy(raw.view(np.int16))
    entry = Entry({"s": bits.view(torch.bfloat16)})
    out = from_blob(K, to_blob(encode(K, entry, AUTH)), AUTH)
    assert torch.equal(out.pieces["s"].view(torch.int16), bits)


def test_edge_shapes_and_layouts():
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    entry = Entry(
        {
            "scalar": np.array(2.5, dtype=np.float32),
            "empty": np.zeros((0, 3), np.float16),
            "empty_t": torch.zeros(0, dtype=torch.bfloat16),
            "strided": base[:, ::2],  # non-contiguous: copied, bytes in C order
            "transposed": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
            "big_endian": np.arange(5, dtype=">i4"),
        },
        meta={"tokens": 4096, "note": "x", "f": 0.5, "b": True, "none": None},
    )
    out = from_blob(K, to_blob(encode(K, entry, AUTH, chunk_bytes=8)), AUTH)
    assert out.pieces["scalar"].shape == () and out.pieces["scalar"] == 2.5
    assert out.pieces["empty"].shape == (0, 3) and out.pieces["empty_t"].shape == (0,)
    np.testing.assert_array_equal(out.pieces["strided"], base[:, ::2])
    assert torch.equal(out.pieces["transposed"], entry.pieces["transposed"])
    np.testing.assert_array_equal(out.pieces["big_endian"], np.arange(5))
    assert dict(out.meta) == dict(entry.meta)


def test_encode_is_zero_copy_for_contiguous_pieces():
    arr = np.arange(1000, dtype=np.float32)
    ten = torch.arange(1000, dtype=torch.float32).to(torch.bfloat16)
    enc = encode(K, Entry({"a": arr, "t": ten}), AUTH)
    assert np.shares_memory(np.frombuffer(enc.chunks[0], np.uint8), arr)
    assert np.frombuffer(enc.chunks[1], np.uint8).ctypes.data == ten.data_ptr()


def test_decode_of_bytes_is_zero_copy_and_read_only():
    enc = encode(K, Entry({"a": np.arange(64, dtype=np.float32)}), AUTH)
    chunk = bytes(enc.chunks[0])
    out = decode(K, enc.header, [chunk], AUTH)
    assert not out.pieces["a"].flags.writeable
    assert out.pieces["a"].ctypes.data == np.frombuffer(chunk, np.uint8).ctypes.data


def test_multi_chunk_pieces_are_reassembled_writable():
    enc = encode(K, Entry({"a": np.arange(64, dtype=np.float32)}), AUTH, chunk_bytes=100)
    assert [c.nbytes for c in enc.chunks] == [100, 100, 56]
    out = decode(K, enc.header, [bytes(c) for c in enc.chunks], AUTH)
    assert out.pieces["a"].flags.writeable
    np.testing.assert_array_equal(out.pieces["a"], np.arange(64, dtype=np.float32))


# ---------------------------------------------------------------------- defects


def _blob(chunk_bytes: int = 0) -> bytearray:
    entry = Entry({"kv": np.arange(100, dtype=np.float32), "s": np.arange(10, dtype=np.int8)})
    return bytearray(to_blob(encode(K, entry, AUTH, chunk_bytes=chunk_bytes)))


def test_flipped_payload_bit_is_a_checksum_mismatch():
    blob = _blob()
    blob[-50] ^= 0x01
    with pytest.raises(ChecksumMismatchError, match="kv"):
        from_blob(K, blob, AUTH)
    assert from_blob(K, blob, AUTH, verify=False) is not None  # only the chunk MAC caught it


def test_flipped_header_bit_is_a_checksum_mismatch():
    blob = _blob()
    blob[20] ^= 0x40
    with pytest.raises(ChecksumMismatchError, match="header"):
        from_blob(K, blob, AUTH)


@pytest.mark.parametrize("cut", [1, 40, 440])
def test_truncated_blob_is_detected(cut):
    blob = _blob()
    with pytest.raises(EntryFormatError) as info:
        from_blob(K, blob[:-cut], AUTH)
    assert isinstance(info.value, TruncatedEntryError | ChecksumMismatchError)


def test_trailing_bytes_are_detected():
    with pytest.raises(TruncatedEntryError):
        from_blob(K, _blob() + b"\x00", AUTH)


def test_short_chunk_and_missing_chunk():
    enc = encode(K, Entry({"a": np.arange(64, dtype=np.float32)}), AUTH, chunk_bytes=100)
    chunks = [bytes(c) for c in enc.chunks]
    with pytest.raises(TruncatedEntryError, match="chunk 1"):
        decode(K, enc.header, [chunks[0], chunks[1][:-1], chunks[2]], AUTH)
    with pytest.raises(MissingPieceError, match="chunk 2"):
        decode(K, enc.header, [chunks[0], chunks[1], None], AUTH)
    with pytest.raises(MissingPieceError):
        decode(K, enc.header, chunks[:2], AUTH)


def _rewrite_header(
    header: bytes,
    version: int | None = None,
    auth: EntryAuth = AUTH,
    tenant: str = "alice",
    **changes,
) -> bytes:
    """A header re-signed with a valid MAC under ``auth`` (as a holder of the secret, e.g. a
    buggy writer, would produce)."""
    magic, old_version = struct.unpack_from("<4sH", header)
    body = msgpack.unpackb(header[6:-32], raw=False)
    body.update(changes)
    head = struct.pack("<4sH", magic, old_version if version is None else version)
    head += msgpack.packb(body, use_bin_type=True)
    return head + auth.manifest_tag(tenant, head)


def test_version_fingerprint_tenant_and_prefix_mismatches():
    enc = encode(K, Entry({"a": np.arange(4, dtype=np.float32)}), AUTH)
    with pytest.raises(FormatVersionError):
        parse_header(K, _rewrite_header(enc.header, version=1), AUTH)
    with pytest.raises(FingerprintMismatchError):
        parse_header(K, _rewrite_header(enc.header, fp="ffffffffffffffff"), AUTH)
    with pytest.raises(KeyMismatchError):
        parse_header(K, _rewrite_header(enc.header, t="bob"), AUTH)
    with pytest.raises(KeyMismatchError):
        parse_header(K, _rewrite_header(enc.header, k=b"\x00" * 16), AUTH)
    # Read under another key (same bytes): another tenant never gets the entry (its MAC
    # key differs, so the MAC fails first).
    with pytest.raises(ChecksumMismatchError):
        parse_header(key("bob", 1), enc.header, AUTH)
    with pytest.raises(KeyMismatchError):
        parse_header(key("alice", 2), enc.header, AUTH)
    with pytest.raises(FingerprintMismatchError):
        parse_header(EntryKey("alice", "feedface", K.prefix_hash), enc.header, AUTH)


def test_forged_header_with_wrong_key_or_an_unkeyed_checksum_is_refused():
    """A forger without the secret: a structurally perfect header signed with another key,
    or the version-1 layout (xxh3 of the bytes before) re-stamped as version 2."""
    enc = encode(K, Entry({"a": np.arange(4, dtype=np.float32)}), AUTH)
    other = EntryAuth(b"another-secret-of-32-bytes-long!")
    with pytest.raises(ChecksumMismatchError, match="MAC"):
        parse_header(K, _rewrite_header(enc.header, auth=other), AUTH)
    head = enc.header[:-32]
    unkeyed = head + xxhash.xxh3_128_digest(head) + xxhash.xxh3_128_digest(head[::-1])
    with pytest.raises(ChecksumMismatchError, match="MAC"):
        parse_header(K, unkeyed, AUTH)


def test_chunk_with_other_bytes_and_a_valid_header_is_refused():
    """Replaced chunk bytes fail their MAC even when the header is authentic."""
    enc = encode(K, Entry({"a": np.arange(64, dtype=np.float32)}), AUTH, chunk_bytes=100)
    chunks = [bytes(c) for c in enc.chunks]
    chunks[1] = bytes(len(chunks[1]))
    with pytest.raises(ChecksumMismatchError, match="chunk 1"):
        decode(K, enc.header, chunks, AUTH)
    swapped = [chunks[0], bytes(enc.chunks[2]), bytes(enc.chunks[1])]
    with pytest.raises(EntryFormatError):
        decode(K, enc.header, swapped, AUTH)


def test_untagged_entries_decode_only_unverified():
    enc = encode(K, Entry({"a": np.arange(8, dtype=np.int16)}), AUTH, tag=False)
    with pytest.raises(ChecksumMismatchError, match="without chunk MACs"):
        decode(K, enc.header, [bytes(c) for c in enc.chunks], AUTH)
    out = decode(K, enc.header, [bytes(c) for c in enc.chunks], AUTH, verify=False)
    np.testing.assert_array_equal(out.pieces["a"], np.arange(8, dtype=np.int16))


def test_structurally_bad_headers_are_format_errors():
    enc = encode(K, Entry({"a": np.arange(4, dtype=np.float32)}), AUTH)
    bad = [
        {"p": [["a", "np", "complex64", [4], 32, []]]},  # unknown dtype
        {"p": [["a", "np", "float32", [4], 15, []]]},  # length does not match shape
        {"p": [["a", "np", "float32", [-4], -16, []]]},  # negative dim
        {"p": [["a", "np", "float32", [4], 16, [b"x" * 16] * 2]]},  # 2 tags for 1 chunk
        {"p": [["a", "np", "float32", [4], 16, [b"x" * 3]]]},  # short tag
        {"p": "nope"},
        {"cs": -1},
        {"cs": True},
        {"m": {"x": [1, 2]}},
        {"k": "not bytes"},
    ]
    for change in bad:
        with pytest.raises(EntryFormatError):
            parse_header(K, _rewrite_header(enc.header, **change), AUTH)
    body = msgpack.unpackb(enc.header[6:-32], raw=False)
    del body["k"]
    head = enc.header[:6] + msgpack.packb(body, use_bin_type=True)
    with pytest.raises(EntryFormatError, match="malformed"):
        parse_header(K, head + AUTH.manifest_tag("alice", head), AUTH)
    with pytest.raises(EntryFormatError, match="magic"):
        parse_header(K, b"XXXX" + enc.header[4:], AUTH)
    with pytest.raises(TruncatedEntryError):
        parse_header(K, enc.header[:10], AUTH)


@pytest.mark.parametrize(
    "piece, why",
    [
        (["a", "np", "uint8", [1_000_000], 1_000_000, []], "chunks"),  # cs=1: 10^6 chunks
        (["a", "np", "uint8", [1 << 20, 1 << 20], 1 << 40, []], "bytes"),  # 1 TiB
        (["a", "np", "uint8", [1] * 40, 1, []], "shape"),  # 40 dimensions
    ],
)
def test_crafted_headers_hit_the_hard_limits_before_any_chunk(piece, why):
    """Even with a valid MAC (a leaked secret, a buggy writer), the work a header can ask
    for is bounded: it is refused from its declared sizes, in microseconds."""
    enc = encode(K, Entry({"a": np.arange(4, dtype=np.float32)}), AUTH)
    crafted = _rewrite_header(enc.header, cs=1, p=[piece])
    assert len(crafted) < 200
    with pytest.raises(EntryFormatError, match=why):
        parse_header(K, crafted, AUTH)


def test_oversized_header_is_refused_before_its_mac():
    with pytest.raises(EntryFormatError, match="at most"):
        parse_header(K, b"HCTE" + bytes(MAX_HEADER_BYTES), AUTH)


def test_encode_refuses_entries_past_the_limits():
    entry = Entry({"a": np.zeros(MAX_CHUNKS + 1, np.uint8)})
    with pytest.raises(InvalidEntryError, match="chunks"):
        encode(K, entry, AUTH, chunk_bytes=1)
    with pytest.raises(InvalidEntryError, match="dimensions"):
        Entry({"a": np.zeros([1] * 33, np.uint8)})


def test_invalid_entries_raise_at_construction():
    with pytest.raises(InvalidEntryError):
        Entry({})
    with pytest.raises(InvalidEntryError, match="complex"):
        Entry({"a": np.zeros(2, np.complex64)})
    with pytest.raises(InvalidEntryError):
        Entry({"a": [1, 2, 3]})
    with pytest.raises(InvalidEntryError):
        Entry({"": np.zeros(2)})
    with pytest.raises(InvalidEntryError):
        Entry({"a": np.zeros(2)}, meta={"x": object()})
    with pytest.raises(InvalidEntryError, match="meta"):
        Entry({"a": np.zeros(2)}, meta={"x": "y" * 70_000})
    with pytest.raises(InvalidEntryError, match="host memory"):
        Entry({"a": torch.zeros(2, device="meta")})


def test_header_records_what_the_issue_asks():
    enc = encode(K, Entry({"kv": np.zeros((2, 3), np.float16)}), AUTH)
    header = parse_header(K, enc.header, AUTH)
    assert (header.fingerprint, header.tenant) == (FINGERPRINT, "alice")
    # A keyed digest of the prefix hash, never the hash itself (nor anywhere in the bytes).
    assert header.prefix_digest == AUTH.prefix_digest(FINGERPRINT, "alice", K.prefix_hash, 16)
    assert K.prefix_hash not in enc.header
    (piece,) = header.pieces
    assert (piece.name, piece.dtype, piece.shape, piece.nbytes) == ("kv", "float16", (2, 3), 12)
    tagger = AUTH.chunk_tagger("alice", header.chunk_mac, header.nonce)
    assert piece.tags == (tagger(0, np.zeros((2, 3), np.float16).tobytes()),)
    assert header.chunk_mac == CHUNK_MACS[0] and len(header.nonce) == 16


@pytest.mark.parametrize("alg", CHUNK_MACS)
def test_every_chunk_mac_round_trips_and_catches_a_flipped_bit(monkeypatch, alg):
    monkeypatch.setattr(format_module, "DEFAULT_CHUNK_MAC", alg)
    entry = Entry({"a": np.arange(300, dtype=np.float32)})
    enc = encode(K, entry, AUTH, chunk_bytes=256)
    assert parse_header(K, enc.header, AUTH).chunk_mac == alg
    chunks = [bytearray(c) for c in enc.chunks]
    out = decode(K, enc.header, [bytes(c) for c in chunks], AUTH)
    np.testing.assert_array_equal(out.pieces["a"], entry.pieces["a"])
    chunks[3][7] ^= 0x04
    with pytest.raises(ChecksumMismatchError, match="chunk 3"):
        decode(K, enc.header, [bytes(c) for c in chunks], AUTH)


def test_an_unknown_chunk_mac_is_never_trusted():
    enc = encode(K, Entry({"a": np.arange(4, dtype=np.float32)}), AUTH)
    forged = _rewrite_header(enc.header, cm="none")
    with pytest.raises(ChecksumMismatchError, match="cannot be verified"):
        decode(K, forged, [bytes(c) for c in enc.chunks], AUTH)
