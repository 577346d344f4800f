"""The Redis read and write protocol of one batch (layout: :mod:`.redis_layout`).

Pure functions over a redis-py client: no counters, no breaker, no threads, so that the
protocol can be read (and reasoned about) in one place. Every function may raise redis-py
errors; :class:`~hybridcache.tiers.redis_tier.RedisTier` turns them into misses.

Read (two round trips per batch, whatever its size): pipelined ``GET`` of the manifests, then
one ``MGET`` per entry of exactly the chunks its manifest names (one slot per entry).

Write (one round trip per batch, plus one if old chunks must go): per put, ``SET`` each chunk
(TTL + grace), then ``SET manifest ... GET`` (the old manifest comes back atomically); per
delete, ``GETDEL manifest``. Then ``UNLINK`` the chunks of every manifest replaced or removed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridcache.tiers.auth import EntryAuth
from hybridcache.tiers.errors import EntryFormatError
from hybridcache.tiers.format import EncodedEntry, Entry, decode, parse_header, verify_header
from hybridcache.tiers.keys import EntryKey
from hybridcache.tiers.redis_conn import RedisClient
from hybridcache.tiers.redis_layout import (
    CHUNK_TTL_GRACE_MS,
    chunk_names,
    pack_manifest,
    unpack_manifest,
)

_UNLINK_BATCH = 512


@dataclass(frozen=True)
class BadEntry:
    """An entry that failed validation; ``manifest`` None means "not even our type"."""

    key: EntryKey
    name: str
    manifest: bytes | None
    chunks: list[str]
    reason: str


@dataclass
class Fetched:
    entries: list[Entry | None]
    bad: list[BadEntry] = field(default_factory=list)


@dataclass(frozen=True)
class WriteOp:
    """A put (``encoded`` set) or a delete (``encoded`` None) of the entry at ``name`` of
    ``tenant`` (whose MAC key reads the manifest it replaces)."""

    name: str
    tenant: str
    encoded: EncodedEntry | None = None
    ttl_s: float | None = None
    generation: str = ""


@dataclass
class Written:
    """Per op: the error that refused it (None: applied) and the manifest it replaced."""

    errors: list[Exception | None]
    replaced: list[bytes | None]


def pipelined(client: RedisClient, command: str, names: Sequence[str]) -> list[Any]:
    """One command per key in one round trip (Cluster: one per node); errors come back inline."""
    pipe = client.pipeline(transaction=False)
    for name in names:
        getattr(pipe, command)(name)
    return pipe.execute(raise_on_error=False)


def fetch(
    client: RedisClient, keys: Sequence[EntryKey], names: Sequence[str], auth: EntryAuth
) -> Fetched:
    """Read and validate the entries at ``names`` (``None`` for each one absent or bad).

    A manifest is authenticated and checked against the hard limits before its chunks are
    asked for, so a forged or crafted one costs one ``GET`` of at most 1 MiB, no more."""
    out = Fetched([None] * len(keys))
    plans: list[tuple[int, bytes, Any, list[str]]] = []
    for i, manifest in enumerate(pipelined(client, "get", names)):
        if manifest is None:
            continue
        if isinstance(manifest, Exception):  # WRONGTYPE: something else lives at our key
            out.bad.append(BadEntry(keys[i], names[i], None, [], str(manifest)))
            continue
        try:
            gen, header_bytes = unpack_manifest(manifest)
            header = parse_header(keys[i], header_bytes, auth)
            if not header.tagged:
                raise EntryFormatError("manifest: chunks without MACs")
        except EntryFormatError as exc:
            out.bad.append(BadEntry(keys[i], names[i], manifest, [], str(exc)))
            continue
        plans.append((i, manifest, header, chunk_names(names[i], gen, header.num_chunks)))
    if not plans:
        return out
    pipe = client.pipeline(transaction=False)
    for _, _, _, chunks in plans:
        pipe.execute_command("MGET", *chunks)  # one slot per entry; Cluster blocks pipe.mget
    for (i, manifest, header, chunks), values in zip(
        plans, pipe.execute(raise_on_error=False), strict=True
    ):
        try:
            if isinstance(values, Exception):
                raise EntryFormatError(f"chunks unreadable: {values}")
            out.entries[i] = decode(keys[i], header, values, auth)
        except EntryFormatError as exc:
            out.bad.append(BadEntry(keys[i], names[i], manifest, chunks, str(exc)))
    return out


def write(client: RedisClient, ops: Sequence[WriteOp]) -> Written:
    """Apply ``ops`` in order in one pipeline; see the module notes for the commands."""
    pipe = client.pipeline(transaction=False)
    spans: list[int] = []
    for op in ops:
        if op.encoded is None:
            pipe.getdel(op.name)
            spans.append(1)
            continue
        ttl_ms = None if op.ttl_s is None else max(1, round(op.ttl_s * 1000))
        chunk_ttl = None if ttl_ms is None else ttl_ms + CHUNK_TTL_GRACE_MS
        names = chunk_names(op.name, op.generation, len(op.encoded.chunks))
        for name, chunk in zip(names, op.encoded.chunks, strict=True):
            pipe.set(name, chunk, px=chunk_ttl)
        pipe.set(op.name, pack_manifest(op.generation, op.encoded.header), px=ttl_ms, get=True)
        spans.append(len(names) + 1)
    replies = pipe.execute(raise_on_error=False)
    errors: list[Exception | None] = []
    replaced: list[bytes | None] = []
    pos = 0
    for span in spans:
        mine = replies[pos : pos + span]
        pos += span
        errors.append(next((r for r in mine if isinstance(r, Exception)), None))
        last = mine[-1]
        replaced.append(last if isinstance(last, bytes) else None)
    return Written(errors, replaced)


def chunks_of(
    op: WriteOp, manifest: bytes | None, auth: EntryAuth, keep_generation: str = ""
) -> list[str]:
    """Chunk keys a stored manifest names (none if it is unreadable, not authentic or of
    ``keep_generation``): a writer never deletes keys a forged manifest points at."""
    if not manifest:
        return []
    name = op.name
    try:
        gen, header_bytes = unpack_manifest(manifest)
        header = verify_header(op.tenant, header_bytes, auth)
    except EntryFormatError:  # a corrupt manifest: its chunks expire with their TTL
        return []
    return [] if gen == keep_generation else chunk_names(name, gen, header.num_chunks)


def unlink(client: RedisClient, names: Sequence[str]) -> None:
    """``UNLINK`` many keys, pipelined (Cluster: each key routed to its node)."""
    for start in range(0, len(names), _UNLINK_BATCH):
        pipelined(client, "unlink", names[start : start + _UNLINK_BATCH])
