"""Chained prefix hashes over fixed-size hash units of tokens.

Unit ``i`` of a request hashes ``parent || tokens[i*U:(i+1)*U] || extra_i`` where ``parent``
is the digest of unit ``i-1``. The chain starts from a *root* digest that mixes in the
algorithm's seed, the tenant salt and the LoRA id, so two tenants (or two adapters) with
identical prompts share nothing: every unit's digest differs from the first one on. Equal
digests therefore mean equal token prefixes under equal keys, which is what lets the
manager share KV pages and state snapshots by digest alone (as vLLM's block hashes do).

Why this shape:
- 16-token units (default) decouple matching granularity from physical blocks: a state
  snapshot can be registered at any unit boundary, unlike vLLM's inflated blocks.
- Tokens are serialised once with numpy (``uint32`` little-endian) and each unit is one call
  into xxh3 or sha256 on a memoryview slice: no per-token Python work. Appending decode
  tokens hashes only the units they complete (:class:`TokenHasher`).
- ``xxh3_128`` is the fast default; ``sha256`` gives a cryptographic chain for deployments
  that share caches across mutually distrusting tenants. Both are deterministic across
  processes and machines (no per-process random seed); ``seed`` lets a deployment pick its
  own stable salt.
- Digests are 16-byte ``bytes`` (sha256 truncated to 128 bits): hashable, cheap dict keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import xxhash

from hybridcache.errors import InvalidRequestError, UnknownNameError

Digest = bytes

HASH_ALGOS = ("xxh3_128", "sha256")
_MAX_TOKEN = (1 << 32) - 1
_MAX_TOKEN_U64 = np.uint64(_MAX_TOKEN)  # a numpy scalar: no conversion on every compare
_U32 = np.dtype(np.uint32)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:16]


def hash_function(algo: str):
    """The digest function of ``algo`` (``xxh3_128`` or ``sha256``)."""
    if algo == "xxh3_128":
        return xxhash.xxh3_128_digest  # the C function itself: no Python frame per unit
    if algo == "sha256":
        return _sha256
    raise UnknownNameError(f"unknown hash algorithm {algo!r}; known: {', '.join(HASH_ALGOS)}")


@dataclass(frozen=True)
class MultiModalItem:
    """A non-text input (image, audio) whose placeholder tokens occupy ``[offset, offset+length)``.

    ``identifier`` is the content digest of the item (as vLLM's ``mm_hash``): placeholder
    token ids are identical for different images, so the identifier must enter the hash of
    every unit the item covers.
    """

    identifier: str | bytes
    offset: int
    length: int


@lru_cache(maxsize=4096)
def root_digest(
    algo: str = "xxh3_128",
    seed: str = "",
    tenant: str | None = None,
    lora: str | int | None = None,
) -> Digest:
    """Digest that starts a request's chain; tenant and LoRA enter here (see module doc)."""
    fn = hash_function(algo)
    parts = [b"hybridcache/v1", seed.encode(), b"t", _key_bytes(tenant), b"l", _key_bytes(lora)]
    return fn(b"\x00".join(parts))


def _key_bytes(value: str | bytes | int | None) -> bytes:
    if value is None:
        return b"\xff"  # distinct from every encoded string
    if isinstance(value, bytes):
        return b"b" + value
    return b"s" + str(value).encode()


def as_token_array(tokens: Sequence[int] | np.ndarray, what: str = "token ids") -> np.ndarray:
    """Validate and convert token ids to ``uint32``.

    Raises:
        InvalidRequestError: non-integer ids, negative ids or ids that do not fit 32 bits.
    """
    if type(tokens) is np.ndarray and tokens.dtype == _U32 and tokens.ndim == 1:
        return tokens  # already what the hasher reads: nothing to check or convert
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        if arr.size == 0:
            return np.zeros(0, dtype=np.uint32)
        raise InvalidRequestError(f"{what}: expected a flat sequence, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.uint32)
    if arr.dtype.kind not in "iu":
        raise InvalidRequestError(f"{what}: token ids must be integers, got dtype {arr.dtype}")
    if arr.dtype.itemsize <= 4 and arr.dtype.kind == "u":
        return arr.astype(np.uint32, copy=False)
    # One pass for the common case: negative ids wrap to huge unsigned values.
    if arr.dtype.itemsize == 8 and arr.view(np.uint64).max() <= _MAX_TOKEN_U64:
        return arr.astype(np.uint32)  # negative ids wrapped past the maximum: none here
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        bad = int(np.argmax(arr < 0))
        raise InvalidRequestError(f"{what}: negative token id {int(arr[bad])} at index {bad}")
    if int(arr.max()) > _MAX_TOKEN:
        bad = int(np.argmax(arr > _MAX_TOKEN))
        raise InvalidRequestError(f"{what}: token id {int(arr[bad])} at index {bad} exceeds 2^32-1")
    return arr.astype(np.uint32, copy=False)


def _unit_extras(
    items: Iterable[MultiModalItem], unit: int, algo: str
) -> dict[int, bytes]:
    """Extra key bytes per unit index for the multimodal items that overlap it."""
    fn = hash_function(algo)
    extras: dict[int, list[bytes]] = {}
    for item in items:
        if item.offset < 0 or item.length <= 0:
            raise InvalidRequestError(
                f"multimodal item {item.identifier!r}: offset must be >= 0 and length > 0"
            )
        ident = item.identifier if isinstance(item.identifier, bytes) else item.identifier.encode()
        tag = fn(ident + b"@" + str(item.offset).encode())
        for u in range(item.offset // unit, (item.offset + item.length - 1) // unit + 1):
            extras.setdefault(u, []).append(tag)
    return {u: b"".join(tags) for u, tags in extras.items()}


def _le_bytes(tokens: np.ndarray) -> bytes:
    """The bytes a unit of ``tokens`` hashes as: ``uint32``, little-endian."""
    return np.ascontiguousarray(tokens, dtype="<u4").tobytes()


@lru_cache(maxsize=64)
def _void(nbytes: int) -> np.dtype:
    """The void dtype of one unit's bytes (made once: parsing ``"V64"`` costs a call)."""
    return np.dtype(f"V{nbytes}")


def hash_units(
    tokens: np.ndarray,
    unit: int,
    parent: Digest,
    algo: str = "xxh3_128",
    first_unit: int = 0,
    extras: dict[int, bytes] | None = None,
    head: bytes = b"",
) -> list[Digest]:
    """Digests of every *full* unit of ``tokens`` (already ``uint32``), chained from ``parent``.

    Args:
        tokens: validated token ids starting at unit ``first_unit`` (after ``head``).
        unit: tokens per hash unit.
        parent: digest of the unit before (or the root digest).
        algo: ``xxh3_128`` or ``sha256``.
        first_unit: absolute index of the first unit (for ``extras`` look-ups).
        extras: extra key bytes by absolute unit index (multimodal items).
        head: the first unit's ids seen before ``tokens`` (an incremental hasher's partial
            unit), as little-endian ``uint32`` bytes; shorter than a unit.

    Returns:
        One digest per full unit; a trailing partial unit is not hashed.
    """
    fn = hash_function(algo)
    units: list[bytes] = []
    if head:
        need = unit - len(head) // 4
        if len(tokens) < need:
            return []
        units.append(head + _le_bytes(tokens[:need]))
        tokens = tokens[need:]
    n_full = len(tokens) // unit
    if n_full:
        # One bytes object per unit straight from numpy (a void view keeps trailing zero
        # bytes, unlike an "S" view): no Python-level slicing of one big buffer per unit.
        units += np.ascontiguousarray(tokens[: n_full * unit], dtype="<u4").view(_void(unit * 4)).tolist()
    h = parent
    if not extras:
        return [h := fn(h + blob) for blob in units]
    get = extras.get
    return [h := fn(h + blob + get(i, b"")) for i, blob in enumerate(units, first_unit)]


class TokenHasher:
    """Incremental chained hashing of one request's tokens.

    Holds the digests of every full unit seen so far and the trailing partial unit, so that
    appending decode tokens hashes only the units they complete.
    """

    __slots__ = ("unit", "algo", "root", "digests", "_tail", "_extras", "num_tokens")

    def __init__(
        self,
        unit: int = 16,
        algo: str = "xxh3_128",
        seed: str = "",
        tenant: str | None = None,
        lora: str | int | None = None,
        mm_items: Sequence[MultiModalItem] = (),
    ) -> None:
        if unit <= 0:
            raise InvalidRequestError(f"hash unit must be positive, got {unit}")
        self.unit = unit
        self.algo = algo
        self.root = root_digest(algo, seed, tenant, lora)
        self.digests: list[Digest] = []
        self._tail = b""  # the trailing partial unit, as the little-endian bytes it hashes
        self._extras = _unit_extras(mm_items, unit, algo) if mm_items else None
        self.num_tokens = 0

    def extend(self, tokens: Sequence[int] | np.ndarray) -> list[Digest]:
        """Append tokens; returns the digests of the units they completed."""
        arr = as_token_array(tokens)
        return self.extend_validated(arr)

    def extend_validated(self, arr: np.ndarray) -> list[Digest]:
        """:meth:`extend` for an already validated ``uint32`` array."""
        if len(arr) == 0:
            return []
        unit, tail = self.unit, self._tail
        parent = self.digests[-1] if self.digests else self.root
        new = hash_units(arr, unit, parent, self.algo, len(self.digests), self._extras, tail)
        self.digests += new
        # The partial unit is kept as bytes and completed first: an append copies no array.
        rest = (len(tail) // 4 + len(arr)) % unit
        if not new:
            self._tail = tail + _le_bytes(arr)
        else:
            self._tail = _le_bytes(arr[len(arr) - rest :]) if rest else b""
        self.num_tokens = len(self.digests) * unit + rest
        return new
