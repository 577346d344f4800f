"""How one entry is laid out in Redis: chunk keys first, then a manifest key naming them.

Per entry (all keys share the ``{digest}`` hash tag, so one Cluster slot)::

    ns:tenant:fp:{digest}            manifest = generation (16 hex chars) + format header
    ns:tenant:fp:{digest}:gen:0..n-1 the pieces' bytes, cut into chunks (plain strings)

Why this shape (measured: redis-py ``SET`` of plain strings runs ~2x faster than ``HSET``
of the same bytes, which the server copies, and ``MULTI`` costs another 10-25%):

* **Write order.** Chunks are written before the manifest, in one pipeline on one
  connection, so Redis applies them in that order: a reader that finds a manifest finds the
  chunks it names already stored. A reader never sees half an entry.
* **Generations.** Every put writes chunks under a fresh random generation, and switches the
  manifest with ``SET ... GET`` (atomic): readers holding the old manifest read the old
  chunks or, once the writer has deleted them, find them missing (a miss), but never bytes of
  another version under a name they trust. The old manifest returned by ``SET ... GET`` (or
  ``GETDEL`` for deletes) tells the writer exactly which chunks it replaced, so concurrent
  writers from several engines never orphan each other's chunks.
* **TTL.** Chunks live ``CHUNK_TTL_GRACE_MS`` longer than their manifest, so expiry never
  leaves a manifest naming chunks that are gone; orphans from a crashed writer expire too.
* **Conditional drop.** A reader that finds a corrupt or incomplete entry deletes it with
  :data:`DROP_LUA`, which only deletes if the manifest is still the one it read, so it never
  deletes a fresh entry another engine just wrote in its place.
"""

from __future__ import annotations

import os
import re

from hybridcache.tiers.errors import EntryFormatError

GEN_CHARS = 16
_GEN_RE = re.compile(rb"[0-9a-f]{16}")

#: Chunks outlive their manifest by this much, so TTL expiry never makes an entry partial.
CHUNK_TTL_GRACE_MS = 1000

#: Delete a manifest and its chunks if (and only if) the manifest still holds ARGV[1].
DROP_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
for i = 1, #KEYS, 512 do
  redis.call('UNLINK', unpack(KEYS, i, math.min(i + 511, #KEYS)))
end
return 1
"""


def new_generation() -> str:
    """A fresh random generation id (64 bits, hex)."""
    return os.urandom(GEN_CHARS // 2).hex()


def pack_manifest(generation: str, header: bytes) -> bytes:
    """The manifest value: the generation, then the format header (which names the pieces)."""
    return generation.encode() + header


def unpack_manifest(value: bytes) -> tuple[str, bytes]:
    """``(generation, header)``; the header is validated later by the format module."""
    gen = value[:GEN_CHARS]
    if not _GEN_RE.fullmatch(gen):
        raise EntryFormatError("manifest: bad generation prefix")
    return gen.decode(), value[GEN_CHARS:]


def chunk_names(manifest_name: str, generation: str, count: int) -> list[str]:
    """Keys of the ``count`` chunks of one generation of an entry."""
    return [f"{manifest_name}:{generation}:{i}" for i in range(count)]
