"""The entry format: one prefix's KV pages and state snapshot, authenticated, zero-copy.

An :class:`Entry` is a set of named pieces (numpy arrays or torch CPU tensors) plus a little
metadata. The KV pages and the recurrent-state snapshot of one prefix travel as *one* entry
because restoring KV without its state silently corrupts a hybrid model's output (LMCache
#2845): they are stored together and come back together or not at all.

Encoded form = a header (the manifest) + the raw bytes of each piece, optionally cut into
chunks (Redis stores each chunk under its own key: redis-py parses ~4 MiB values much faster
than 40 MiB ones). The header is::

    b"HCTE" | u16 format version | msgpack body | HMAC-SHA256 (32 B) of everything before

with the msgpack body ``{"fp", "t", "k", "cs", "m", "p", "cm", "n"}``: model fingerprint,
tenant, keyed digest of the prefix hash (never the hash itself), chunk size, metadata, per
piece ``[name, kind, dtype, shape, nbytes, [chunk tags]]``, the chunk MAC algorithm and the
entry's random nonce. Tags are keyed by the tier secret (see
:mod:`hybridcache.tiers.auth`), so only a holder of the secret can write an entry a tier
accepts. Decoding checks, in this order, and raises a specific
:class:`~hybridcache.tiers.errors.EntryFormatError` on the first failure: size of the header,
magic, version, the header's MAC (before any field is trusted), header structure and hard
limits (:data:`MAX_HEADER_BYTES`, :data:`MAX_PIECES`, :data:`MAX_CHUNKS`,
:data:`MAX_ENTRY_BYTES`, :data:`MAX_DIMS`: bounded before a single chunk is read),
fingerprint, tenant and prefix digest (against the key the entry was read under), each
chunk's presence and length, each chunk's MAC. Nothing is returned unless every check passed.

For transports that want a single buffer, :func:`to_blob` / :func:`from_blob` frame the
header and payload as ``u32 header length | header | payload``.
"""

from __future__ import annotations

import hmac
import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgpack
import numpy as np

from hybridcache.tiers import dtypes
from hybridcache.tiers.auth import (
    CHUNK_TAG_BYTES,
    DEFAULT_CHUNK_MAC,
    MANIFEST_TAG_BYTES,
    NONCE_BYTES,
    EntryAuth,
)
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
from hybridcache.tiers.keys import DIGEST_BYTES, EntryKey

#: 2: MACs keyed by the tier secret, keyed prefix digest instead of the raw hash (1: xxh3).
FORMAT_VERSION = 2
MAGIC = b"HCTE"
_PREFIX = struct.Struct("<4sH")
_BLOB_LEN = struct.Struct("<I")

#: Hard limits, checked at ``encode`` (a refused put) and, after the MAC, at decode (a miss)
#: before any chunk is read: a header is at most 1 MiB, an entry at most 4,096 pieces of at
#: most 32 dimensions, 65,536 chunks and 64 GiB of payload.
MAX_HEADER_BYTES = 1 << 20
MAX_PIECES = 4096
MAX_DIMS = 32
MAX_CHUNKS = 1 << 16
MAX_ENTRY_BYTES = 1 << 36
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
        pieces: name -> numpy array or torch CPU tensor (strided); order is preserved.
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
            if len(dtypes.describe(value, name)[2]) > MAX_DIMS:
                raise InvalidEntryError(f"piece {name!r}: more than {MAX_DIMS} dimensions")
        _check_meta(self.meta)

    @property
    def nbytes(self) -> int:
        """Payload bytes (sum over pieces)."""
        return sum(dtypes.describe(v, k)[3] for k, v in self.pieces.items())


@dataclass(frozen=True)
class PieceInfo:
    """What the header records about one piece (``tags``: one MAC per chunk, or none)."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    tags: tuple[bytes, ...]

    def num_chunks(self, chunk_bytes: int) -> int:
        """Chunks this piece is cut into (at least one, possibly empty)."""
        return _num_chunks(self.nbytes, chunk_bytes)

    def to_wire(self) -> list[object]:
        return [self.name, self.kind, self.dtype, list(self.shape), self.nbytes, list(self.tags)]


@dataclass(frozen=True)
class Header:
    """A validated header (see :func:`parse_header`)."""

    fingerprint: str
    tenant: str
    prefix_digest: bytes
    chunk_bytes: int
    meta: Mapping[str, Scalar]
    pieces: tuple[PieceInfo, ...]
    chunk_mac: str = DEFAULT_CHUNK_MAC
    nonce: bytes = b""

    @property
    def num_chunks(self) -> int:
        return sum(p.num_chunks(self.chunk_bytes) for p in self.pieces)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    @property
    def tagged(self) -> bool:
        """Whether every chunk has a MAC (an entry a tier may serve from shared storage)."""
        return all(len(p.tags) == p.num_chunks(self.chunk_bytes) for p in self.pieces)


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


def check_layout(entry: Entry, chunk_bytes: int) -> None:
    """Refuse an entry the hard limits would make unreadable (before anything is stored)."""
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 0:
        raise InvalidEntryError(f"chunk_bytes: must be an int >= 0, got {chunk_bytes!r}")
    sizes = [dtypes.describe(v, k)[3] for k, v in entry.pieces.items()]
    if sum(sizes) > MAX_ENTRY_BYTES:
        raise InvalidEntryError(f"entry: {sum(sizes)} bytes, at most {MAX_ENTRY_BYTES}")
    if sum(_num_chunks(n, chunk_bytes) for n in sizes) > MAX_CHUNKS:
        raise InvalidEntryError(f"entry: more than {MAX_CHUNKS} chunks of {chunk_bytes} bytes")


def encode(
    key: EntryKey, entry: Entry, auth: EntryAuth, *, chunk_bytes: int = 0, tag: bool = True
) -> EncodedEntry:
    """Header + zero-copy chunks of ``entry`` stored under ``key``, authenticated by ``auth``.

    Args:
        chunk_bytes: cut pieces into chunks of at most this many bytes (0: one chunk each).
        tag: compute a MAC per chunk. Only a tier that never lets the bytes out of its own
            memory (HostTier without ``verify_reads``) may skip it; such an entry can only
            be decoded with ``verify=False``. The header always carries its MAC.

    The chunks alias the caller's arrays where they are contiguous: do not modify the pieces
    until the tier has stored them.
    """
    check_layout(entry, chunk_bytes)
    nonce = os.urandom(NONCE_BYTES)
    tagger = auth.chunk_tagger(key.tenant, DEFAULT_CHUNK_MAC, nonce)
    infos: list[PieceInfo] = []
    chunks: list[memoryview] = []
    for name, value in entry.pieces.items():
        kind, dname, shape, nbytes = dtypes.describe(value, name)
        raw = dtypes.to_bytes(value)
        step = chunk_bytes if chunk_bytes > 0 and nbytes > 0 else max(nbytes, 1)
        mine = [raw[i : i + step] for i in range(0, max(nbytes, 1), step)]
        first = len(chunks)
        tags = tuple(tagger(first + i, c) for i, c in enumerate(mine)) if tag else ()
        infos.append(PieceInfo(name, kind, dname, shape, nbytes, tags))
        chunks.extend(mine)
    body = msgpack.packb(
        {
            "fp": key.fingerprint,
            "t": key.tenant,
            "k": _prefix_digest(auth, key),
            "cs": int(chunk_bytes),
            "m": dict(entry.meta),
            "p": [p.to_wire() for p in infos],
            "cm": DEFAULT_CHUNK_MAC,
            "n": nonce,
        },
        use_bin_type=True,
    )
    head = _PREFIX.pack(MAGIC, FORMAT_VERSION) + body
    header = head + auth.manifest_tag(key.tenant, head)
    if len(header) > MAX_HEADER_BYTES:
        raise InvalidEntryError(f"entry: header of {len(header)} bytes, at most {MAX_HEADER_BYTES}")
    return EncodedEntry(header, tuple(chunks), sum(p.nbytes for p in infos))


def verify_header(tenant: str, data: Buffer, auth: EntryAuth) -> Header:
    """Check size, magic, version and the MAC of a header of ``tenant``, then its structure
    and hard limits; raise the specific error on the first failure.

    Without the fingerprint / prefix checks of :func:`parse_header`: only for housekeeping
    (a writer finding which chunks a replaced manifest named), never to serve a read.
    """
    if len(data) > MAX_HEADER_BYTES:
        raise EntryFormatError(f"header: {len(data)} bytes, at most {MAX_HEADER_BYTES}")
    data = bytes(data)
    if len(data) < _PREFIX.size + MANIFEST_TAG_BYTES:
        raise TruncatedEntryError(f"header: {len(data)} bytes is too short")
    magic, version = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise EntryFormatError("header: not a hybridcache entry (bad magic)")
    if version != FORMAT_VERSION:
        raise FormatVersionError(
            f"header: format version {version}, this code reads {FORMAT_VERSION}"
        )
    head, tag = data[:-MANIFEST_TAG_BYTES], data[-MANIFEST_TAG_BYTES:]
    if not hmac.compare_digest(auth.manifest_tag(tenant, head), tag):
        raise ChecksumMismatchError("header: MAC mismatch (forged, corrupt or truncated)")
    try:
        body = msgpack.unpackb(head[_PREFIX.size :], raw=False, strict_map_key=True)
        return _header_from_body(body)
    except EntryFormatError:
        raise
    except Exception as exc:  # any malformed structure is a format error, never a crash
        raise EntryFormatError(f"header: malformed body ({type(exc).__name__}: {exc})") from exc


def parse_header(key: EntryKey, data: Buffer, auth: EntryAuth) -> Header:
    """Validate a header read under ``key``; raise the specific error on the first failure."""
    header = verify_header(key.tenant, data, auth)
    if header.fingerprint != key.fingerprint:
        raise FingerprintMismatchError(
            f"header: written for model {header.fingerprint}, read for {key.fingerprint}"
        )
    if header.tenant != key.tenant or header.prefix_digest != _prefix_digest(auth, key):
        raise KeyMismatchError("header: entry belongs to another tenant or prefix")
    return header


def decode(
    key: EntryKey,
    header: Buffer | Header,
    chunks: Sequence[Buffer | None],
    auth: EntryAuth,
    *,
    verify: bool = True,
) -> Entry:
    """Rebuild the entry from its header and chunks, validating everything.

    Args:
        header: the stored header bytes (or an already parsed :class:`Header`).
        chunks: the stored chunks in order; ``None`` marks one that was not found.
        verify: check every chunk's MAC (a tier may skip this only for memory it owns).

    Single-chunk pieces alias their chunk (read-only when the chunk is ``bytes``); pieces cut
    into several chunks are reassembled into a fresh, writable buffer.
    """
    parsed = header if isinstance(header, Header) else parse_header(key, header, auth)
    if len(chunks) != parsed.num_chunks:
        raise MissingPieceError(f"{len(chunks)} chunks stored, header names {parsed.num_chunks}")
    tagger = None
    if verify:
        try:
            tagger = auth.chunk_tagger(key.tenant, parsed.chunk_mac, parsed.nonce)
        except KeyError:
            raise ChecksumMismatchError(
                f"chunk MAC {parsed.chunk_mac!r} cannot be verified here (install cryptography)"
            ) from None
    pieces: dict[str, Array] = {}
    pos = 0
    for info in parsed.pieces:
        n = info.num_chunks(parsed.chunk_bytes)
        views = _check_chunks(info, parsed.chunk_bytes, chunks[pos : pos + n])
        if tagger is not None:
            if len(info.tags) != n:
                raise ChecksumMismatchError(f"piece {info.name!r}: stored without chunk MACs")
            for i, (view, tag) in enumerate(zip(views, info.tags, strict=True)):
                if not hmac.compare_digest(tagger(pos + i, view), tag):
                    raise ChecksumMismatchError(f"piece {info.name!r}: chunk {i} MAC mismatch")
        pos += n
        buf = _join(info.nbytes, views)
        pieces[info.name] = dtypes.from_bytes(info.kind, info.dtype, info.shape, buf)
    return Entry(pieces, parsed.meta)


def to_blob(encoded: EncodedEntry) -> bytes:
    """One contiguous buffer: ``u32 header length | header | payload`` (one copy)."""
    return b"".join((_BLOB_LEN.pack(len(encoded.header)), encoded.header, *encoded.chunks))


def from_blob(key: EntryKey, blob: Buffer, auth: EntryAuth, *, verify: bool = True) -> Entry:
    """Inverse of :func:`to_blob`; pieces alias ``blob``."""
    view = memoryview(blob).cast("B")
    if view.nbytes < _BLOB_LEN.size:
        raise TruncatedEntryError(f"blob: {view.nbytes} bytes is too short")
    (hlen,) = _BLOB_LEN.unpack_from(view)
    if _BLOB_LEN.size + hlen > view.nbytes:
        raise TruncatedEntryError("blob: shorter than its header length")
    parsed = parse_header(key, view[_BLOB_LEN.size : _BLOB_LEN.size + hlen], auth)
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
    return decode(key, parsed, chunks, auth, verify=verify)


def _prefix_digest(auth: EntryAuth, key: EntryKey) -> bytes:
    return auth.prefix_digest(key.fingerprint, key.tenant, key.prefix_hash, DIGEST_BYTES)


def _num_chunks(nbytes: int, chunk_bytes: int) -> int:
    if chunk_bytes <= 0 or nbytes == 0:
        return 1
    return -(-nbytes // chunk_bytes)


def _check_chunks(
    info: PieceInfo, chunk_bytes: int, chunks: Sequence[Buffer | None]
) -> list[memoryview]:
    """Check each chunk's presence and length."""
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
    return views


def _join(nbytes: int, views: list[memoryview]) -> memoryview:
    """One chunk as it is; several joined into one fresh buffer."""
    if len(views) == 1:
        return views[0]
    out = np.empty(nbytes, dtype=np.uint8)
    pos = 0
    for view in views:
        out[pos : pos + view.nbytes] = np.frombuffer(view, dtype=np.uint8)
        pos += view.nbytes
    return memoryview(out)


def _header_from_body(body: object) -> Header:
    """Type-check a decoded msgpack body and apply the hard limits (the MAC passed, so a
    failure here means a buggy writer or a leaked secret: still a miss, never a crash)."""
    if not isinstance(body, dict):
        raise EntryFormatError("header: body is not a map")
    fp, tenant, digest = body["fp"], body["t"], body["k"]
    chunk_bytes, meta, wire = body["cs"], body["m"], body["p"]
    chunk_mac, nonce = body["cm"], body["n"]
    if not (isinstance(fp, str) and isinstance(tenant, str) and isinstance(digest, bytes)):
        raise EntryFormatError("header: bad key fields")
    if not isinstance(chunk_mac, str) or not isinstance(nonce, bytes) or len(nonce) > 64:
        raise EntryFormatError("header: bad chunk MAC fields")
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 0:
        raise EntryFormatError(f"header: bad chunk size {chunk_bytes!r}")
    _check_meta(meta)
    if not isinstance(wire, list) or not 1 <= len(wire) <= MAX_PIECES:
        raise EntryFormatError("header: bad piece list")
    pieces = tuple(_piece_from_wire(p, chunk_bytes) for p in wire)
    total = sum(p.nbytes for p in pieces)
    if total > MAX_ENTRY_BYTES:
        raise EntryFormatError(f"header: {total} payload bytes, at most {MAX_ENTRY_BYTES}")
    if sum(p.num_chunks(chunk_bytes) for p in pieces) > MAX_CHUNKS:
        raise EntryFormatError(f"header: more than {MAX_CHUNKS} chunks")
    return Header(fp, tenant, digest, chunk_bytes, meta, pieces, chunk_mac, nonce)


def _piece_from_wire(item: object, chunk_bytes: int) -> PieceInfo:
    if not isinstance(item, list) or len(item) != 6:
        raise EntryFormatError("header: bad piece record")
    name, kind, dname, shape, nbytes, tags = item
    size = (
        dtypes.itemsize(kind, dname) if isinstance(kind, str) and isinstance(dname, str) else None
    )
    if size is None:
        raise EntryFormatError(f"header: unsupported piece type {kind!r}/{dname!r}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(isinstance(s, int) and 0 <= s <= MAX_ENTRY_BYTES for s in shape)
    ):
        raise EntryFormatError(f"header: bad shape {shape!r:.200}")
    if not isinstance(nbytes, int) or nbytes != math.prod(shape) * size:
        raise EntryFormatError(f"header: byte length {nbytes!r} does not match shape {shape}")
    if nbytes > MAX_ENTRY_BYTES:
        raise EntryFormatError(f"header: piece of {nbytes} bytes, at most {MAX_ENTRY_BYTES}")
    if not isinstance(name, str) or not isinstance(tags, list):
        raise EntryFormatError("header: bad piece name or tags")
    n = _num_chunks(nbytes, chunk_bytes)
    if tags and (
        len(tags) != n or not all(isinstance(t, bytes) and len(t) == CHUNK_TAG_BYTES for t in tags)
    ):
        raise EntryFormatError(f"header: piece {name!r} needs {n} chunk tags")
    return PieceInfo(name, kind, dname, tuple(shape), nbytes, tuple(tags))


def _check_meta(meta: object) -> None:
    if not isinstance(meta, Mapping):
        raise InvalidEntryError("Entry.meta: need a mapping")
    for k, v in meta.items():
        if not isinstance(k, str) or not (v is None or isinstance(v, int | float | str | bool)):
            raise InvalidEntryError(f"Entry.meta: {k!r} must map a str to a scalar")
    if meta and len(msgpack.packb(dict(meta), use_bin_type=True)) > MAX_META_BYTES:
        raise InvalidEntryError(f"Entry.meta: more than {MAX_META_BYTES} bytes packed")
