"""The entry format: one prefix's KV pages and state snapshot, checksummed, zero-copy.

An :class:`Entry` is a set of named pieces (numpy arrays or torch CPU tensors) plus a little
metadata. The KV pages and the recurrent-state snapshot of one prefix travel as *one* entry
because restoring KV without its state silently corrupts a hybrid model's output (LMCache
#2845): they are stored together and come back together or not at all.

Encoded form = a header + the raw bytes of each piece, optionally cut into chunks (Redis
stores each chunk as a hash field: redis-py parses ~4 MiB values much faster than 40 MiB
ones). The header is::

    b"HCTE" | u16 format version | msgpack body | u64 xxh3-64 of everything before

with the msgpack body ``{"fp", "t", "h", "cs", "m", "p"}``: model fingerprint, tenant,
prefix hash, chunk size, metadata, and per piece ``[name, kind, dtype, shape, nbytes,
xxh3-64]``. Decoding checks, in this order, and raises a specific
:class:`~hybridcache.tiers.errors.EntryFormatError` on the first failure: magic, version,
header checksum, header structure, fingerprint, tenant and prefix hash (against the key the
entry was read under), each chunk's presence and length, each piece's checksum. Nothing is
returned unless every check passed.

For transports that want a single buffer, :func:`to_blob` / :func:`from_blob` frame the
header and payload as ``u32 header length | header | payload``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgpack
import numpy as np
import xxhash

from hybridcache.tiers import dtypes
from hybridcache.tiers.dtypes import Array
from hybridcache.tiers.errors import (
    ChecksumMismatchError,
    EntryFormatError,
    FingerprintMismatchError,
    FormatVersionError,
    InvalidEntryError,
    KeyMismatchError,
    MissingPieceError,
    TruncatedEntryError,
)
from hybridcache.tiers.keys import EntryKey

FORMAT_VERSION = 1
MAGIC = b"HCTE"
_PREFIX = struct.Struct("<4sH")
_CHECKSUM = struct.Struct("<Q")
_BLOB_LEN = struct.Struct("<I")

MAX_PIECES = 4096
MAX_NAME_CHARS = 128
MAX_META_BYTES = 64 << 10

Scalar = int | float | str | bool | None
Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, eq=False)
class Entry:
    """The pieces of one prefix (e.g. ``{"kv": pages, "state.kda": snapshot}``) and metadata.

    Validation here is cheap (no copies): ``put`` calls it in the caller's thread so that a
    programming error raises at once instead of vanishing in a background writer.

    Args:
        pieces: name -> numpy array or torch CPU tensor; order is preserved.
        meta: small scalar metadata (e.g. ``{"tokens": 4096}``), at most 64 KiB packed.
    """

    pieces: Mapping[str, Array]
    meta: Mapping[str, Scalar] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.pieces, Mapping) or not self.pieces:
            raise InvalidEntryError("Entry.pieces: need a non-empty mapping name -> array")
        if len(self.pieces) > MAX_PIECES:
            raise InvalidEntryError(f"Entry.pieces: at most {MAX_PIECES} pieces")
        for name, value in self.pieces.items():
            if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_CHARS:
                raise InvalidEntryError(f"Entry.pieces: bad piece name {name!r}")
            dtypes.describe(value, name)
        _check_meta(self.meta)

    @property
    def nbytes(self) -> int:
        """Payload bytes (sum over pieces)."""
        return sum(dtypes.describe(v, k)[3] for k, v in self.pieces.items())


@dataclass(frozen=True)
class PieceInfo:
    """What the header records about one piece."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: int

    def num_chunks(self, chunk_bytes: int) -> int:
        """Chunks this piece is cut into (at least one, possibly empty)."""
        if chunk_bytes <= 0 or self.nbytes == 0:
            return 1
        return math.ceil(self.nbytes / chunk_bytes)

    def to_wire(self) -> list[object]:
        return [self.name, self.kind, self.dtype, list(self.shape), self.nbytes, self.checksum]


@dataclass(frozen=True)
class Header:
    """A validated header (see :func:`parse_header`)."""

    fingerprint: str
    tenant: str
    prefix_hash: bytes
    chunk_bytes: int
    meta: Mapping[str, Scalar]
    pieces: tuple[PieceInfo, ...]

    @property
    def num_chunks(self) -> int:
        return sum(p.num_chunks(self.chunk_bytes) for p in self.pieces)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


@dataclass(frozen=True)
class EncodedEntry:
    """An entry ready to store: ``header`` then ``chunks`` (views of the caller's memory)."""

    header: bytes
    chunks: tuple[memoryview, ...]
    nbytes: int

    @property
    def stored_bytes(self) -> int:
        """Bytes a tier holds for this entry (header + payload)."""
        return len(self.header) + self.nbytes


def encode(key: EntryKey, entry: Entry, *, chunk_bytes: int = 0) -> EncodedEntry:
    """Header + zero-copy chunks of ``entry`` stored under ``key``.

    Args:
        chunk_bytes: cut pieces into chunks of at most this many bytes (0: one chunk each).

    The chunks alias the caller's arrays where they are contiguous: do not modify the pieces
    until the tier has stored them.
    """
    if chunk_bytes < 0:
        raise InvalidEntryError(f"chunk_bytes: must be >= 0, got {chunk_bytes}")
    infos: list[PieceInfo] = []
    chunks: list[memoryview] = []
    for name, value in entry.pieces.items():
        kind, dname, shape, nbytes = dtypes.describe(value, name)
        raw = dtypes.to_bytes(value)
        infos.append(PieceInfo(name, kind, dname, shape, nbytes, xxhash.xxh3_64_intdigest(raw)))
        step = chunk_bytes if chunk_bytes > 0 and nbytes > 0 else max(nbytes, 1)
        chunks.extend(raw[i : i + step] for i in range(0, max(nbytes, 1), step))
    body = msgpack.packb(
        {
            "fp": key.fingerprint,
            "t": key.tenant,
            "h": key.prefix_hash,
            "cs": int(chunk_bytes),
            "m": dict(entry.meta),
            "p": [p.to_wire() for p in infos],
        },
        use_bin_type=True,
    )
    head = _PREFIX.pack(MAGIC, FORMAT_VERSION) + body
    header = head + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(head))
    return EncodedEntry(header, tuple(chunks), sum(p.nbytes for p in infos))


def parse_header(key: EntryKey | None, data: Buffer) -> Header:
    """Validate a header read under ``key``; raise the specific error on the first failure.

    ``key=None`` skips the fingerprint / tenant / prefix checks: only for housekeeping (a
    writer finding which chunks a replaced manifest named), never to serve a read.
    """
    data = bytes(data)
    if len(data) < _PREFIX.size + _CHECKSUM.size:
        raise TruncatedEntryError(f"header: {len(data)} bytes is too short")
    magic, version = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise EntryFormatError("header: not a hybridcache entry (bad magic)")
    if version != FORMAT_VERSION:
        raise FormatVersionError(
            f"header: format version {version}, this code reads {FORMAT_VERSION}"
        )
    head, (checksum,) = data[: -_CHECKSUM.size], _CHECKSUM.unpack_from(data, len(data) - 8)
    if xxhash.xxh3_64_intdigest(head) != checksum:
        raise ChecksumMismatchError("header: checksum mismatch (corrupt or truncated)")
    try:
        body = msgpack.unpackb(head[_PREFIX.size :], raw=False, strict_map_key=True)
        header = _header_from_body(body)
    except EntryFormatError:
        raise
    except Exception as exc:  # any malformed structure is a format error, never a crash
        raise EntryFormatError(f"header: malformed body ({type(exc).__name__}: {exc})") from exc
    if key is None:
        return header
    if header.fingerprint != key.fingerprint:
        raise FingerprintMismatchError(
            f"header: written for model {header.fingerprint}, read for {key.fingerprint}"
        )
    if header.tenant != key.tenant or header.prefix_hash != key.prefix_hash:
        raise KeyMismatchError("header: entry belongs to another tenant or prefix")
    return header


def decode(
    key: EntryKey,
    header: Buffer | Header,
    chunks: Sequence[Buffer | None],
    *,
    verify: bool = True,
) -> Entry:
    """Rebuild the entry from its header and chunks, validating everything.

    Args:
        header: the stored header bytes (or an already parsed :class:`Header`).
        chunks: the stored chunks in order; ``None`` marks one that was not found.
        verify: check piece checksums (a tier may skip this only for memory it owns).

    Single-chunk pieces alias their chunk (read-only when the chunk is ``bytes``); pieces cut
    into several chunks are reassembled into a fresh, writable buffer.
    """
    parsed = header if isinstance(header, Header) else parse_header(key, header)
    if len(chunks) != parsed.num_chunks:
        raise MissingPieceError(f"{len(chunks)} chunks stored, header names {parsed.num_chunks}")
    pieces: dict[str, Array] = {}
    pos = 0
    for info in parsed.pieces:
        n = info.num_chunks(parsed.chunk_bytes)
        buf = _assemble(info, parsed.chunk_bytes, chunks[pos : pos + n])
        pos += n
        if verify and xxhash.xxh3_64_intdigest(buf) != info.checksum:
            raise ChecksumMismatchError(f"piece {info.name!r}: checksum mismatch")
        pieces[info.name] = dtypes.from_bytes(info.kind, info.dtype, info.shape, buf)
    return Entry(pieces, parsed.meta)


def to_blob(encoded: EncodedEntry) -> bytes:
    """One contiguous buffer: ``u32 header length | header | payload`` (one copy)."""
    return b"".join((_BLOB_LEN.pack(len(encoded.header)), encoded.header, *encoded.chunks))


def from_blob(key: EntryKey, blob: Buffer, *, verify: bool = True) -> Entry:
    """Inverse of :func:`to_blob`; pieces alias ``blob``."""
    view = memoryview(blob).cast("B")
    if view.nbytes < _BLOB_LEN.size:
        raise TruncatedEntryError(f"blob: {view.nbytes} bytes is too short")
    (hlen,) = _BLOB_LEN.unpack_from(view)
    if _BLOB_LEN.size + hlen > view.nbytes:
        raise TruncatedEntryError("blob: shorter than its header length")
    parsed = parse_header(key, view[_BLOB_LEN.size : _BLOB_LEN.size + hlen])
    payload = view[_BLOB_LEN.size + hlen :]
    if payload.nbytes != parsed.nbytes:
        raise TruncatedEntryError(
            f"blob: payload is {payload.nbytes} bytes, header says {parsed.nbytes}"
        )
    chunks: list[memoryview] = []
    pos = 0
    for info in parsed.pieces:
        step = (
            parsed.chunk_bytes
            if parsed.chunk_bytes > 0 and info.nbytes > 0
            else max(info.nbytes, 1)
        )
        for i in range(info.num_chunks(parsed.chunk_bytes)):
            chunks.append(payload[pos + i * step : pos + min((i + 1) * step, info.nbytes)])
        pos += info.nbytes
    return decode(key, parsed, chunks, verify=verify)


def _assemble(info: PieceInfo, chunk_bytes: int, chunks: Sequence[Buffer | None]) -> memoryview:
    """Check each chunk's presence and length; join several chunks into one buffer."""
    views: list[memoryview] = []
    remaining = info.nbytes
    for i, chunk in enumerate(chunks):
        if chunk is None:
            raise MissingPieceError(f"piece {info.name!r}: chunk {i} is missing")
        view = memoryview(chunk).cast("B")
        expected = min(chunk_bytes, remaining) if len(chunks) > 1 else info.nbytes
        if view.nbytes != expected:
            raise TruncatedEntryError(
                f"piece {info.name!r}: chunk {i} has {view.nbytes} bytes, expected {expected}"
            )
        remaining -= expected
        views.append(view)
    if len(views) == 1:
        return views[0]
    out = np.empty(info.nbytes, dtype=np.uint8)
    pos = 0
    for view in views:
        out[pos : pos + view.nbytes] = np.frombuffer(view, dtype=np.uint8)
        pos += view.nbytes
    return memoryview(out)


def _header_from_body(body: object) -> Header:
    """Type-check a decoded msgpack body; the checksum passed, so failures mean a bad writer."""
    if not isinstance(body, dict):
        raise EntryFormatError("header: body is not a map")
    fp, tenant, prefix = body["fp"], body["t"], body["h"]
    chunk_bytes, meta, wire = body["cs"], body["m"], body["p"]
    if not (isinstance(fp, str) and isinstance(tenant, str) and isinstance(prefix, bytes)):
        raise EntryFormatError("header: bad key fields")
    if not isinstance(chunk_bytes, int) or chunk_bytes < 0:
        raise EntryFormatError(f"header: bad chunk size {chunk_bytes!r}")
    _check_meta(meta)
    if not isinstance(wire, list) or not 1 <= len(wire) <= MAX_PIECES:
        raise EntryFormatError("header: bad piece list")
    return Header(fp, tenant, prefix, chunk_bytes, meta, tuple(_piece_from_wire(p) for p in wire))


def _piece_from_wire(item: object) -> PieceInfo:
    if not isinstance(item, list) or len(item) != 6:
        raise EntryFormatError("header: bad piece record")
    name, kind, dname, shape, nbytes, checksum = item
    size = (
        dtypes.itemsize(kind, dname) if isinstance(kind, str) and isinstance(dname, str) else None
    )
    if size is None:
        raise EntryFormatError(f"header: unsupported piece type {kind!r}/{dname!r}")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise EntryFormatError(f"header: bad shape {shape!r}")
    if not isinstance(nbytes, int) or nbytes != math.prod(shape) * size:
        raise EntryFormatError(f"header: byte length {nbytes!r} does not match shape {shape}")
    if not isinstance(name, str) or not isinstance(checksum, int):
        raise EntryFormatError("header: bad piece name or checksum")
    return PieceInfo(name, kind, dname, tuple(shape), nbytes, checksum)


def _check_meta(meta: object) -> None:
    if not isinstance(meta, Mapping):
        raise InvalidEntryError("Entry.meta: need a mapping")
    for k, v in meta.items():
        if not isinstance(k, str) or not (v is None or isinstance(v, int | float | str | bool)):
            raise InvalidEntryError(f"Entry.meta: {k!r} must map a str to a scalar")
    if meta and len(msgpack.packb(dict(meta), use_bin_type=True)) > MAX_META_BYTES:
        raise InvalidEntryError(f"Entry.meta: more than {MAX_META_BYTES} bytes packed")
