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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import xxhash

from hybridcache.errors import ConfigError, InvalidRequestError, UnknownNameError
from hybridcache.validation import as_count, check_key, check_text

Digest = bytes

HASH_ALGOS = ("xxh3_128", "sha256")
_MAX_TOKEN = (1 << 32) - 1
_MAX_TOKEN_U64 = np.uint64(_MAX_TOKEN)  # a numpy scalar: no conversion on every compare
_U32 = np.dtype(np.uint32)
_NO_OWNER = object()  # as_token_array: ids of no request


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
    """Digest that starts a request's chain; tenant and LoRA enter here (see module doc).

    Each part is written with a type tag and its length, so no two different
    ``(seed, tenant, lora)`` give the same bytes: joining with a separator would let a
    tenant ``"x\\0l\\0sy"`` with LoRA ``"z"`` share the chain of tenant ``"x"`` with LoRA
    ``"y\\0l\\0sz"``. A LoRA given as ``int`` and the same digits as ``str`` differ too.

    Raises:
        ConfigError: ``seed`` is not text.
        InvalidRequestError: ``tenant`` or ``lora`` of a wrong type, or not valid text.
    """
    fn = hash_function(algo)
    if not isinstance(seed, str):
        raise ConfigError(f"hash_seed must be a str, got {type(seed).__name__}")
    check_key(tenant, lora)
    parts = (
        _field(b"s", check_text(seed, "hash_seed", ConfigError)),
        _key_field(tenant, "tenant"),
        _key_field(lora, "lora"),
    )
    return fn(b"hybridcache/v2" + b"".join(parts))


def _field(tag: bytes, data: bytes) -> bytes:
    """``tag || len(data) as 8 bytes || data``: self-delimiting."""
    return tag + len(data).to_bytes(8, "little") + data


def _key_field(value: str | int | None, what: str) -> bytes:
    if value is None:
        return _field(b"n", b"")
    if isinstance(value, str):
        return _field(b"s", check_text(value, what))
    return _field(b"i", str(int(value)).encode())


def as_token_array(
    tokens: Sequence[int] | np.ndarray, what: str = "token ids", owner: object = _NO_OWNER
) -> np.ndarray:
    """Validate and convert token ids to native ``uint32``.

    Any integer dtype and byte order is accepted (a big-endian ``int64`` array is read by
    value, never truncated); Python ints too. A flat native ``uint32`` array is returned
    as is: that is what the hasher reads, and the engine's common input.

    ``owner``: the request id the ids belong to, named in errors (``request 'r' <what>``;
    the message is only made when one is raised).

    Raises:
        InvalidRequestError: non-integer ids (float, bool, object, str), negative ids, ids
            that do not fit 32 bits, or a shape that is not flat.
    """
    if type(tokens) is np.ndarray and tokens.dtype == _U32 and tokens.ndim == 1:
        return tokens  # already what the hasher reads: nothing to check or convert
    if owner is not _NO_OWNER:
        what = f"request {owner!r} {what}"
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError, OverflowError) as e:  # ragged nesting, huge ints
        raise InvalidRequestError(f"{what}: not a flat sequence of integers ({e})") from None
    if arr.ndim != 1:
        if arr.size == 0:
            return np.zeros(0, dtype=np.uint32)
        raise InvalidRequestError(f"{what}: expected a flat sequence, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.uint32)
    if arr.dtype.kind not in "iu":
        _reject_non_integer(arr, what)
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))  # the checks below read native values
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


def _reject_non_integer(arr: np.ndarray, what: str) -> None:
    """Raise for an array that is not of an integer dtype, naming the first bad id.

    An ``object`` array of Python ints is what numpy makes of ids beyond 64 bits: those are
    integers out of range, and the message says so.
    """
    if arr.dtype.kind == "O":
        for i, v in enumerate(arr.tolist()):
            if isinstance(v, bool) or not isinstance(v, int):
                break
            if not 0 <= v <= _MAX_TOKEN:
                raise InvalidRequestError(f"{what}: token id {v} at index {i} is outside [0, 2^32-1]")
    raise InvalidRequestError(f"{what}: token ids must be integers, got dtype {arr.dtype}")


def _unit_extras(
    items: Iterable[MultiModalItem], unit: int, algo: str
) -> dict[int, bytes]:
    """Extra key bytes per unit index for the multimodal items that overlap it."""
    fn = hash_function(algo)
    extras: dict[int, list[bytes]] = {}
    for item in check_mm_items(items):
        ident = item.identifier if isinstance(item.identifier, bytes) else item.identifier.encode()
        tag = fn(ident + b"@" + str(item.offset).encode())
        for u in range(item.offset // unit, (item.offset + item.length - 1) // unit + 1):
            extras.setdefault(u, []).append(tag)
    return {u: b"".join(tags) for u, tags in extras.items()}


def check_mm_items(items: object) -> list[MultiModalItem]:
    """The items as a list, each a :class:`MultiModalItem` with a text or bytes identifier,
    an int ``offset >= 0`` and an int ``length > 0``.

    Raises:
        InvalidRequestError: the first malformed item, named.
    """
    if isinstance(items, (str, bytes, MultiModalItem)) or not isinstance(items, Iterable):
        raise InvalidRequestError(f"mm_items must be a sequence of MultiModalItem, got {type(items).__name__}")
    out = list(items)
    for i, item in enumerate(out):
        if not isinstance(item, MultiModalItem):
            raise InvalidRequestError(f"mm_items[{i}] must be a MultiModalItem, got {type(item).__name__}")
        ident = item.identifier
        if isinstance(ident, str):
            check_text(ident, f"mm_items[{i}] identifier")
        elif not isinstance(ident, bytes):
            raise InvalidRequestError(f"mm_items[{i}] identifier must be str or bytes, got {type(ident).__name__}")
        offset, length = _as_int(item.offset), _as_int(item.length)
        if offset is None or length is None or offset < 0 or length <= 0:
            raise InvalidRequestError(
                f"multimodal item {ident!r}: offset must be an int >= 0 and length an int > 0, "
                f"got {item.offset!r}, {item.length!r}"
            )
    return out


def _as_int(value: object) -> int | None:
    try:
        return as_count(value, "")
    except InvalidRequestError:
        return None


_LE_U32 = np.dtype("<u4")
#: Validated ids are native ``uint32``: on a little-endian machine (the usual one) they are
#: already the bytes a unit hashes, and a contiguous array is viewed, not copied.
_NATIVE_IS_LE = _U32 == _LE_U32


def _le_bytes(tokens: np.ndarray) -> bytes:
    """The bytes a unit of ``tokens`` hashes as: ``uint32``, little-endian."""
    return np.ascontiguousarray(tokens, dtype=_LE_U32).tobytes()


@lru_cache(maxsize=64)
def _void(nbytes: int) -> np.dtype:
    """The void dtype of one unit's bytes (made once: parsing ``"V64"`` costs a call)."""
    return np.dtype(f"V{nbytes}")


def _unit_blobs(tokens: np.ndarray, n_full: int, void: np.dtype) -> list[bytes]:
    """One ``bytes`` per unit of the first ``n_full`` units of validated ``tokens``, straight
    from numpy (a void view keeps trailing zero bytes, unlike an ``"S"`` view): no
    Python-level slicing of one big buffer per unit."""
    t = tokens[: n_full * (void.itemsize // 4)]
    if not (_NATIVE_IS_LE and t.flags.c_contiguous):
        t = np.ascontiguousarray(t, dtype=_LE_U32)
    return t.view(void).tolist()


def _chain(fn, parent: Digest, blobs: list[bytes], first_unit: int, extras: dict[int, bytes] | None) -> list[Digest]:
    """``fn(parent || blob [|| extra])`` for each blob, each digest the next one's parent.

    A plain loop with a bound ``append``: about 10 % faster than a comprehension that
    carries the chain in an assignment expression (a closure cell read and written per
    unit), and hashing is a fifth of a request's time in the manager.
    """
    out: list[Digest] = []
    append = out.append
    h = parent
    if not extras:
        for blob in blobs:
            h = fn(h + blob)
            append(h)
        return out
    get = extras.get
    for i, blob in enumerate(blobs, first_unit):
        h = fn(h + blob + get(i, b""))
        append(h)
    return out


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
    return _hash_from(hash_function(algo), _void(unit * 4), tokens, unit, parent, first_unit, extras, head)


def _hash_from(
    fn, void: np.dtype, tokens: np.ndarray, unit: int, parent: Digest, first_unit: int,
    extras: dict[int, bytes] | None, head: bytes,
) -> list[Digest]:
    """:func:`hash_units` with the hash function and the unit's void dtype resolved."""
    if head:
        need = unit - len(head) // 4
        if len(tokens) < need:
            return []
        blobs = [head + _le_bytes(tokens[:need])]
        tokens = tokens[need:]
        n_full = len(tokens) // unit
        if n_full:
            blobs += _unit_blobs(tokens, n_full, void)
    else:
        n_full = len(tokens) // unit
        if not n_full:
            return []
        blobs = _unit_blobs(tokens, n_full, void)
    return _chain(fn, parent, blobs, first_unit, extras)


class TokenHasher:
    """Incremental chained hashing of one request's tokens.

    Holds the digests of every full unit seen so far and the trailing partial unit, so that
    appending decode tokens hashes only the units they complete.
    """

    __slots__ = (
        "unit", "algo", "root", "digests", "_tail", "_extras", "num_tokens", "_fn", "_void", "token_bytes",
    )

    def __init__(
        self,
        unit: int = 16,
        algo: str = "xxh3_128",
        seed: str = "",
        tenant: str | None = None,
        lora: str | int | None = None,
        mm_items: Sequence[MultiModalItem] = (),
    ) -> None:
        n = unit if type(unit) is int else _as_int(unit)
        if n is None or n <= 0:
            raise ConfigError(f"hash_unit must be a positive int, got {unit!r}")
        if not isinstance(seed, str):
            raise ConfigError(f"hash_seed must be a str, got {type(seed).__name__}")
        check_key(tenant, lora)  # before root_digest: its cache would raise TypeError first
        self.unit = n
        self.algo = algo
        self.root = root_digest(algo, seed, tenant, lora)
        self._fn = hash_function(algo)  # resolved once: a request hashes twice or more
        self._void = _void(n * 4)
        self.digests: list[Digest] = []
        self._tail = b""  # the trailing partial unit, as the little-endian bytes it hashes
        plain = type(mm_items) is tuple and not mm_items  # the default: nothing to check
        self._extras = None if plain else _unit_extras(mm_items, n, algo) or None
        self.num_tokens = 0
        #: Every token seen, as the little-endian ``uint32`` bytes units hash: what the index
        #: keeps with registered KV so that a later prompt with the same tokens reuses its
        #: digests (:meth:`extend_reusing`). ``None`` when digests are not a function of the
        #: tokens and the root alone (multimodal extras, adopted digests).
        self.token_bytes: bytearray | None = bytearray() if self._extras is None else None

    def adopt(self, digests: Sequence[bytes], num_tokens: int) -> None:
        """Take precomputed unit digests (traces with block ids instead of tokens).

        Each digest is salted with this hasher's root, which mixes in the seed, tenant and
        LoRA: another tenant presenting the same precomputed digests gets different keys,
        as it would with tokens. The inputs must already be prefix-chained (equal digest,
        equal prefix); salting each with the same root keeps that.
        """
        fn, root = hash_function(self.algo), self.root
        try:
            self.digests = [fn(root + d) for d in digests]
        except TypeError:
            raise InvalidRequestError("digests must be bytes") from None
        self.num_tokens = num_tokens
        self.token_bytes = None  # digests of block ids, not of these tokens

    def extend(self, tokens: Sequence[int] | np.ndarray) -> list[Digest]:
        """Append tokens; returns the digests of the units they completed."""
        arr = as_token_array(tokens)
        return self.extend_validated(arr)

    def extend_validated(self, arr: np.ndarray) -> list[Digest]:
        """:meth:`extend` for an already validated ``uint32`` array."""
        k = len(arr)
        if not k:
            return []
        tb = self.token_bytes
        if tb is None:
            return self._extend_keyed(arr, k)
        # Every token is kept as bytes: the units to hash are read straight from them (the
        # partial unit before ``arr`` needs no joining), one void view for all.
        digests, ub = self.digests, self.unit * 4
        done = len(digests)
        tb += memoryview(_le_view(arr))  # the array's bytes, one copy
        n = len(tb) // ub
        self.num_tokens = len(tb) // 4
        if n == done:
            return []
        new = _chain(self._fn, digests[-1] if done else self.root, _blobs_of(tb, done, n, self._void), done, None)
        digests += new
        return new

    def _extend_keyed(self, arr: np.ndarray, k: int) -> list[Digest]:
        """:meth:`extend_validated` of a hasher that keeps no token bytes (multimodal extras
        or adopted digests): the partial unit is kept as bytes and completed first."""
        unit, tail, digests = self.unit, self._tail, self.digests
        done = len(digests)
        parent = digests[-1] if done else self.root
        new = _hash_from(self._fn, self._void, arr, unit, parent, done, self._extras, tail)
        digests += new
        rest = (len(tail) // 4 + k) % unit
        if not new:
            self._tail = tail + _le_bytes(arr)
        else:
            self._tail = _le_bytes(arr[k - rest :]) if rest else b""
        self.num_tokens = (done + len(new)) * unit + rest
        return new

    def extend_reusing(self, arr: np.ndarray, run_at: Callable[[Digest], Any]) -> list[Digest]:
        """:meth:`extend_validated` of a fresh hasher's first tokens, reusing the digests of
        cached stretches with the same tokens instead of hashing them again.

        ``run_at(digest)`` is the cached run (:class:`~hybridcache.runs.Run`) whose first unit
        has that digest, or ``None``. Walking as a prefix match does, each unit at a run's
        start is hashed and looked up; when the run keeps its units' tokens, the ones equal
        to ours (compared in place, the first differing unit found with numpy) take the
        run's digests. They are the digests hashing would give, bit for bit: the unit
        before them has the same digest and every unit since the same tokens, and a
        digest is a function of its parent and its unit alone (no multimodal extras on
        either side: a hasher with extras, or a run registered without tokens, hashes).
        Where the walk leaves the cache, the rest is hashed in bulk.
        """
        if self.num_tokens or self.token_bytes is None:
            return self.extend_validated(arr)
        unit, fn = self.unit, self._fn
        k = len(arr)
        n_full = k // unit
        data = self.token_bytes = bytearray(memoryview(_le_view(arr)))
        ub = unit * 4
        out = self.digests
        h, i = self.root, 0
        while i < n_full:
            h = fn(h + data[i * ub : (i + 1) * ub])
            out.append(h)
            run = run_at(h)
            if run is None or run.first != i or run.tokens is None:
                i += 1
                break
            left = min(len(run.digests), n_full - i) - 1
            same = _same_units(data, (i + 1) * ub, run.tokens, ub, left, ub, run.fork - 1)
            if same:
                if i:
                    out += run.digests[1 : 1 + same]
                else:  # the first unit is the run's: one copy, not a slice then an extend
                    out = self.digests = run.digests[: 1 + same]
                h = out[-1]
            i += 1 + same
        if i < n_full:
            out += _chain(fn, h, _blobs_of(data, i, n_full, self._void), i, None)
        self.num_tokens = k
        return out


def _blobs_of(data: bytearray, lo: int, hi: int, void: np.dtype) -> list[bytes]:
    """Units ``[lo, hi)`` of the token bytes ``data``, one ``bytes`` each (a void view keeps
    trailing zero bytes, unlike an ``"S"`` view); the view is gone before ``data`` grows."""
    return np.frombuffer(data, void, hi - lo, lo * void.itemsize).tolist()


def _le_view(arr: np.ndarray) -> np.ndarray:
    """Validated ids as a contiguous little-endian ``uint32`` array (no copy when they are)."""
    if _NATIVE_IS_LE and arr.flags.c_contiguous:
        return arr
    return np.ascontiguousarray(arr, dtype=_LE_U32)


def _same_units(
    a: bytes | bytearray, a_off: int, b: bytes | bytearray, b_off: int, n: int, ub: int, hint: int = -1
) -> int:
    """How many of the ``n`` units (``ub`` bytes each) from ``a[a_off:]`` and ``b[b_off:]``
    are equal, counted from the first until one differs. ``hint``: the count expected (where
    the last walk left the run: prompts that share a system prompt leave it at its end),
    checked with two comparisons before numpy finds the first differing byte."""
    if n <= 0:
        return 0
    size = n * ub
    with memoryview(a) as view:  # compared in place: no copy of either side
        if b.startswith(view[a_off : a_off + size], b_off):
            return n
        if 0 <= hint < n:
            cut = a_off + hint * ub
            if b.startswith(view[a_off:cut], b_off) and not b.startswith(view[cut : cut + ub], b_off + hint * ub):
                return hint
    x = np.frombuffer(a, np.uint8, size, a_off)
    y = np.frombuffer(b, np.uint8, size, b_off)
    return int((x != y).argmax()) // ub
