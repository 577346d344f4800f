"""Entry format: exact round trips of every dtype, and a specific error for every defect."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest
import torch
import xxhash
from tiers_testlib import FINGERPRINT, assert_same, key

from hybridcache.tiers import (
    ChecksumMismatchError,
    Entry,
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

# Decoded tensors alias immutable bytes by design (see hybridcache.tiers.dtypes).
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable:UserWarning")

K = key("alice", 1)
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
    out = from_blob(K, to_blob(encode(K, entry, chunk_bytes=chunk_bytes)))
    assert_same(out, entry)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("chunk_bytes", [0, 64])
def test_torch_round_trip_is_exact(dtype, chunk_bytes):
    entry = Entry({"x": _torch(dtype), "y": _torch(dtype, (1, 1))})
    out = from_blob(K, to_blob(encode(K, entry, chunk_bytes=chunk_bytes)))
    assert_same(out, entry)


def test_bfloat16_nan_and_inf_payloads_survive():
    raw = np.array([0x7FC1, 0x7F80, 0xFF80, 0x0001, 0x8000], dtype=np.uint16)
    bits = torch.from_numpy(raw.view(np.int16))
    entry = Entry({"s": bits.view(torch.bfloat16)})
    out = from_blob(K, to_blob(encode(K, entry)))
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
    out = from_blob(K, to_blob(encode(K, entry, chunk_bytes=8)))
    assert out.pieces["scalar"].shape == () and out.pieces["scalar"] == 2.5
    assert out.pieces["empty"].shape == (0, 3) and out.pieces["empty_t"].shape == (0,)
    np.testing.assert_array_equal(out.pieces["strided"], base[:, ::2])
    assert torch.equal(out.pieces["transposed"], entry.pieces["transposed"])
    np.testing.assert_array_equal(out.pieces["big_endian"], np.arange(5))
    assert dict(out.meta) == dict(entry.meta)


def test_encode_is_zero_copy_for_contiguous_pieces():
    arr = np.arange(1000, dtype=np.float32)
    ten = torch.arange(1000, dtype=torch.float32).to(torch.bfloat16)
    enc = encode(K, Entry({"a": arr, "t": ten}))
    assert np.shares_memory(np.frombuffer(enc.chunks[0], np.uint8), arr)
    assert np.frombuffer(enc.chunks[1], np.uint8).ctypes.data == ten.data_ptr()


def test_decode_of_bytes_is_zero_copy_and_read_only():
    enc = encode(K, Entry({"a": np.arange(64, dtype=np.float32)}))
    chunk = bytes(enc.chunks[0])
    out = decode(K, enc.header, [chunk])
    assert not out.pieces["a"].flags.writeable
    assert out.pieces["a"].ctypes.data == np.frombuffer(chunk, np.uint8).ctypes.data


def test_multi_chunk_pieces_are_reassembled_writable():
    enc = encode(K, Entry({"a": np.arange(64, dtype=np.float32)}), chunk_bytes=100)
    assert [c.nbytes for c in enc.chunks] == [100, 100, 56]
    out = decode(K, enc.header, [bytes(c) for c in enc.chunks])
    assert out.pieces["a"].flags.writeable
    np.testing.assert_array_equal(out.pieces["a"], np.arange(64, dtype=np.float32))


# ---------------------------------------------------------------------- defects


def _blob(chunk_bytes: int = 0) -> bytearray:
    entry = Entry({"kv": np.arange(100, dtype=np.float32), "s": np.arange(10, dtype=np.int8)})
    return bytearray(to_blob(encode(K, entry, chunk_bytes=chunk_bytes)))


def test_flipped_payload_bit_is_a_checksum_mismatch():
    blob = _blob()
    blob[-50] ^= 0x01
    with pytest.raises(ChecksumMismatchError, match="kv"):
        from_blob(K, blob)
    assert from_blob(K, blob, verify=False) is not None  # only the checksum caught it


def test_flipped_header_bit_is_a_checksum_mismatch():
    blob = _blob()
    blob[20] ^= 0x40
    with pytest.raises(ChecksumMismatchError, match="header"):
        from_blob(K, blob)


@pytest.mark.parametrize("cut", [1, 40, 440])
def test_truncated_blob_is_detected(cut):
    blob = _blob()
    with pytest.raises(EntryFormatError) as info:
        from_blob(K, blob[:-cut])
    assert isinstance(info.value, TruncatedEntryError | ChecksumMismatchError)


def test_trailing_bytes_are_detected():
    with pytest.raises(TruncatedEntryError):
        from_blob(K, _blob() + b"\x00")


def test_short_chunk_and_missing_chunk():
    enc = encode(K, Entry({"a": np.arange(64, dtype=np.float32)}), chunk_bytes=100)
    chunks = [bytes(c) for c in enc.chunks]
    with pytest.raises(TruncatedEntryError, match="chunk 1"):
        decode(K, enc.header, [chunks[0], chunks[1][:-1], chunks[2]])
    with pytest.raises(MissingPieceError, match="chunk 2"):
        decode(K, enc.header, [chunks[0], chunks[1], None])
    with pytest.raises(MissingPieceError):
        decode(K, enc.header, chunks[:2])


def _rewrite_header(header: bytes, version: int | None = None, **changes) -> bytes:
    """A header re-signed with a valid checksum (as a different writer would produce)."""
    magic, old_version = struct.unpack_from("<4sH", header)
    body = msgpack.unpackb(header[6:-8], raw=False)
    body.update(changes)
    head = struct.pack("<4sH", magic, old_version if version is None else version)
    head += msgpack.packb(body, use_bin_type=True)
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


def test_version_fingerprint_tenant_and_prefix_mismatches():
    enc = encode(K, Entry({"a": np.arange(4, dtype=np.float32)}))
    with pytest.raises(FormatVersionError):
        parse_header(K, _rewrite_header(enc.header, version=2))
    with pytest.raises(FingerprintMismatchError):
        parse_header(K, _rewrite_header(enc.header, fp="ffffffffffffffff"))
    with pytest.raises(KeyMismatchError):
        parse_header(K, _rewrite_header(enc.header, t="bob"))
    with pytest.raises(KeyMismatchError):
        parse_header(K, _rewrite_header(enc.header, h=b"\x00" * 16))
    # Read under another key (same bytes): another tenant never gets the entry.
    with pytest.raises(KeyMismatchError):
        parse_header(key("bob", 1), enc.header)
    with pytest.raises(FingerprintMismatchError):
        parse_header(EntryKey("alice", "feedface", K.prefix_hash), enc.header)


def test_structurally_bad_headers_are_format_errors():
    enc = encode(K, Entry({"a": np.arange(4, dtype=np.float32)}))
    bad = [
        {"p": [["a", "np", "complex64", [4], 32, 0]]},  # unknown dtype
        {"p": [["a", "np", "float32", [4], 15, 0]]},  # length does not match shape
        {"p": [["a", "np", "float32", [-4], -16, 0]]},  # negative dim
        {"p": "nope"},
        {"cs": -1},
        {"m": {"x": [1, 2]}},
    ]
    for change in bad:
        with pytest.raises(EntryFormatError):
            parse_header(K, _rewrite_header(enc.header, **change))
    with pytest.raises(EntryFormatError, match="magic"):
        parse_header(K, b"XXXX" + enc.header[4:])
    with pytest.raises(TruncatedEntryError):
        parse_header(K, enc.header[:10])


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
    enc = encode(K, Entry({"kv": np.zeros((2, 3), np.float16)}))
    header = parse_header(K, enc.header)
    assert (header.fingerprint, header.tenant, header.prefix_hash) == (
        FINGERPRINT,
        "alice",
        K.prefix_hash,
    )
    (piece,) = header.pieces
    assert (piece.name, piece.dtype, piece.shape, piece.nbytes) == ("kv", "float16", (2, 3), 12)
    assert piece.checksum == xxhash.xxh3_64_intdigest(np.zeros((2, 3), np.float16).tobytes())
