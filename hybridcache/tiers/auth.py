"""Keys derived from the tier secret: key digests, entry MACs and chunk MACs.

Whoever can write a Redis key (another tenant's engine, anything on the network path to an
unauthenticated Redis) could otherwise store a manifest and chunks that pass every check of
an unkeyed checksum, and have an engine restore bytes of its choosing. So every stored piece
is authenticated under the deployment secret:

* **Tenant key** ``BLAKE2b(key=secret, person="hc-tier-tenant", data=tenant)`` (32 B): keys
  the per-tenant digests of Redis key names (:class:`~hybridcache.tiers.keys.KeyCodec`) and
  the digest ``k`` a manifest stores instead of the raw prefix hash.
* **MAC key** ``BLAKE2b(key=secret, person="hc-tier-mac", data=tenant)`` (32 B): keys the
  HMAC-SHA256 tag of every manifest (32 B over everything before the tag) and the tag of
  every chunk (16 B), which the manifest lists.

Chunk tags, one of two standard MACs (the manifest names which, under its own MAC):

* ``poly1305`` (default when the ``cryptography`` package is importable): Poly1305 with a
  one-time key per chunk, ``BLAKE2b(key=MAC key, person="hc-tier-poly", data=entry nonce
  || chunk index)``, where the entry nonce is 16 random bytes drawn at every encode. This is
  the construction of ChaCha20-Poly1305 (a PRF-derived one-time key): a forgery succeeds
  with probability below 2^-80 for a 4 MiB chunk, and it runs at ~15 GB/s here, so
  authenticating a 41 MiB snapshot costs ~3 ms.
* ``hmac-sha256`` (the fallback without ``cryptography``): HMAC-SHA256 truncated to 128
  bits; ~2.1 GB/s here (OpenSSL uses the CPU's SHA extensions), ~20 ms per snapshot.

Why not a MAC over xxh3 digests of the chunks: xxh3 is not collision resistant, so anyone
can make other bytes with the same digest and the MAC over the digest still verifies. Each
tag is compared with :func:`hmac.compare_digest`. A reader verifies whichever algorithm the
(authenticated) manifest names; one without ``cryptography`` cannot check ``poly1305``
entries and treats them as misses, never as hits.

Binding: the manifest's MAC covers the model fingerprint, the tenant, the keyed prefix digest,
the layout of every piece and every chunk tag, and its key is the tenant's, so a valid
manifest cannot be moved to another tenant, prefix or model, nor point at other chunks.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from collections.abc import Callable

from hybridcache.tiers.errors import TierConfigError

try:  # optional: 7x faster chunk MACs than HMAC-SHA256
    from cryptography.hazmat.primitives.poly1305 import Poly1305
except ImportError:  # pragma: no cover - depends on the environment
    Poly1305 = None

#: Shortest deployment secret accepted (128 bits).
MIN_SECRET_BYTES = 16

#: Bytes of a chunk tag (HMAC-SHA256 truncated to 128 bits, as RFC 2104 allows).
CHUNK_TAG_BYTES = 16

#: Bytes of a manifest tag (full HMAC-SHA256).
MANIFEST_TAG_BYTES = 32

#: Chunk MAC algorithms this process can verify, and the one it writes.
CHUNK_MACS: tuple[str, ...] = ("hmac-sha256",) if Poly1305 is None else ("poly1305", "hmac-sha256")
DEFAULT_CHUNK_MAC = CHUNK_MACS[0]

#: Bytes of the random per-encode nonce that poly1305 one-time keys are derived from.
NONCE_BYTES = 16

_CACHE_LIMIT = 65536  # derived keys kept per kind (bounds memory with many tenants)


def secret_bytes(secret: object, what: str = "secret") -> bytes:
    """``secret`` as bytes: a ``str`` is encoded as UTF-8 (as the environment variable and
    the vLLM connector give it), ``bytes``/``bytearray`` are taken as they are.

    Raises:
        TierConfigError: another type, or fewer than :data:`MIN_SECRET_BYTES` bytes.
    """
    if isinstance(secret, str):
        raw = secret.encode("utf-8", "strict")
    elif isinstance(secret, bytes | bytearray):
        raw = bytes(secret)
    else:
        raise TierConfigError(f"{what}: need str or bytes, got {type(secret).__name__}")
    if len(raw) < MIN_SECRET_BYTES:
        raise TierConfigError(
            f"{what}: need at least {MIN_SECRET_BYTES} bytes (a str counts its UTF-8 bytes), "
            f"got {len(raw)}"
        )
    return raw


class EntryAuth:
    """Per-tenant keys derived from one deployment secret (thread-safe, cached).

    Args:
        secret: at least 16 bytes, or a str of at least 16 UTF-8 bytes.
    """

    def __init__(self, secret: bytes | str) -> None:
        self._secret = secret_bytes(secret)
        self._tenant_keys: dict[str, bytes] = {}
        self._mac_keys: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def _derive(self, cache: dict[str, bytes], tenant: str, person: bytes) -> bytes:
        key = cache.get(tenant)
        if key is None:
            key = hashlib.blake2b(
                tenant.encode(), key=self._secret, digest_size=32, person=person
            ).digest()
            with self._lock:
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                cache[tenant] = key
        return key

    def tenant_key(self, tenant: str) -> bytes:
        """The tenant's sub-key for key-name digests."""
        return self._derive(self._tenant_keys, tenant, b"hc-tier-tenant")

    def prefix_digest(self, fingerprint: str, tenant: str, prefix_hash: bytes, size: int) -> bytes:
        """Keyed digest of (fingerprint, prefix hash) under the tenant's sub-key."""
        msg = fingerprint.encode() + b"\x00" + prefix_hash
        return hashlib.blake2b(
            msg, key=self.tenant_key(tenant), digest_size=size, person=b"hc-tier-entry"
        ).digest()

    def mac_key(self, tenant: str) -> bytes:
        """The tenant's MAC key (manifests and chunks)."""
        return self._derive(self._mac_keys, tenant, b"hc-tier-mac")

    def chunk_tagger(self, tenant: str, alg: str, nonce: bytes) -> Callable[[int, object], bytes]:
        """``tag(index, chunk) -> 16 B`` for the chunks of one encoded entry.

        Raises:
            KeyError: ``alg`` is not one this process can compute (see :data:`CHUNK_MACS`).
        """
        if alg not in CHUNK_MACS:
            raise KeyError(alg)
        mac_key = self.mac_key(tenant)
        if alg == "hmac-sha256":

            def hmac_tag(_i: int, data: object) -> bytes:
                return hmac.digest(mac_key, data, "sha256")[:CHUNK_TAG_BYTES]  # type: ignore[arg-type]

            return hmac_tag

        def poly(i: int, data: object) -> bytes:
            one_time = hashlib.blake2b(
                nonce + i.to_bytes(4, "little"), key=mac_key, digest_size=32, person=b"hc-tier-poly"
            ).digest()
            return Poly1305.generate_tag(one_time, data)  # type: ignore[union-attr, arg-type]

        return poly

    def manifest_tag(self, tenant: str, data: bytes) -> bytes:
        """HMAC-SHA256 of a manifest's bytes before the tag."""
        return hmac.digest(self.mac_key(tenant), data, "sha256")
