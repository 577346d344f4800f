"""RedisTier: entries in Redis (single server, TLS, unix socket or Cluster), shared by engines.

Layout (:mod:`.redis_layout`): per entry, the pieces' bytes in chunk keys, written *before*
a manifest key that names them (generation + format header), so a reader never sees half an
entry; all of an entry's keys share one Cluster slot. Protocol: :mod:`.redis_io`.

Writes run on a background thread (:class:`~hybridcache.tiers.writer.BackgroundWriter`):
``put`` returns at once, a full queue drops the write (``dropped_writes``). Until a put or
delete has reached Redis, ``get``/``contains`` in this process answer from the pending queue,
so a process always reads its own writes. Reads are pipelined (two round trips per batch).

Never wrong: a manifest or chunk without a valid MAC under the tier secret (forged,
corrupt, truncated), a manifest from another model, tenant or prefix, one past the hard
limits (refused before any chunk is read), a short or missing chunk: all fail validation;
the read is a miss and the entry is deleted (only if its manifest is still the one read,
so a fresh entry written meanwhile survives).

Failures never reach the caller: connection errors and timeouts open a circuit breaker
(misses and dropped writes, one warning per outage, a probe every ``retry_interval_s`` on a
background thread, so the caller's thread waits on a black-holed server at most once, for
one socket timeout; recovery as soon as a probe is answered); server-side refusals (OOM,
NOPERM) are counted and warned once per kind.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from redis.exceptions import (
    ClusterError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from hybridcache.tiers import redis_io
from hybridcache.tiers.base import Counters, Tier, TierStats, check_key, check_keys, check_put
from hybridcache.tiers.errors import TierConfigError
from hybridcache.tiers.format import EncodedEntry, Entry, check_layout, encode
from hybridcache.tiers.health import Breaker
from hybridcache.tiers.keys import EntryKey, KeyCodec
from hybridcache.tiers.limits import TenantLimits
from hybridcache.tiers.quota import QuotaLedger
from hybridcache.tiers.redis_conn import RedisClient, connect, is_cluster_url, redact
from hybridcache.tiers.redis_layout import DROP_LUA, chunk_names, new_generation, pack_manifest
from hybridcache.tiers.writer import BackgroundWriter

_log = logging.getLogger("hybridcache.tiers.redis")

SECRET_ENV = "HYBRIDCACHE_TIER_SECRET"

#: Errors that mean "the server is not reachable right now" (open the breaker).
_OUTAGE_ERRORS = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterError,
    RedisClusterException,
    OSError,
)

T = TypeVar("T")


class _Unavailable:
    """Marker returned by :meth:`RedisTier._call` when Redis could not answer."""


UNAVAILABLE = _Unavailable()


@dataclass(eq=False)
class _Job:
    op: str  # "put" or "delete"
    key: EntryKey
    entry: Entry | None
    ttl_s: float | None
    nbytes: int
    encoded: Future[EncodedEntry] | None = None


class RedisTier(Tier):
    """Entries in Redis: tenant-isolated, authenticated under the tier secret, written in
    the background.

    Args:
        url: ``redis://``, ``rediss://``, ``unix://``, ``redis-cluster://`` or
            ``rediss-cluster://`` (see :mod:`hybridcache.tiers.redis_conn`); or pass ``client``.
        secret: deployment secret (>= 16 bytes; a ``str`` is encoded as UTF-8, as the
            ``HYBRIDCACHE_TIER_SECRET`` environment variable it defaults to). It keys the key
            digests and the MACs of every manifest and chunk (:mod:`.auth`). Every engine
            sharing the cache needs the same secret.
        namespace: first key component.
        client: an existing redis-py client (``decode_responses=False``) instead of ``url``.
        limits: per-tenant TTLs and byte quotas (quotas are kept in Redis, shared by engines).
        chunk_bytes: pieces are stored in keys of at most this size (redis-py parses
            ~4 MiB values much faster than one 40 MiB value).
        max_pending_writes / max_pending_bytes: bound of the write queue; beyond it, puts
            are dropped.
        retry_interval_s: after a connection failure, serve misses for this long before
            probing the server again.
        verify_reads: must stay ``True``: every chunk's MAC is checked on read (an entry
            from shared storage is never served unauthenticated); ``False`` is refused.
        write_batch_bytes: most payload bytes the writer sends in one pipeline (at least one
            entry); small entries are batched up to it, large ones go one by one.
        **redis_kwargs: passed to redis-py (``username``, ``password``, ``ssl_ca_certs``...).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        secret: bytes | str | None = None,
        namespace: str = "hc",
        client: RedisClient | None = None,
        limits: TenantLimits | None = None,
        chunk_bytes: int = 4 << 20,
        max_pending_writes: int = 256,
        max_pending_bytes: int = 1 << 30,
        retry_interval_s: float = 1.0,
        verify_reads: bool = True,
        write_batch_bytes: int = 64 << 20,
        **redis_kwargs: Any,
    ) -> None:
        if (url is None) == (client is None):
            raise TierConfigError("RedisTier: pass exactly one of url and client")
        if chunk_bytes <= 0:
            raise TierConfigError(f"chunk_bytes: must be positive, got {chunk_bytes}")
        if verify_reads is not True:
            raise TierConfigError("verify_reads: must be True (chunks are always authenticated)")
        if secret is None and os.environ.get(SECRET_ENV):
            secret = os.environ[SECRET_ENV]
        if secret is None:
            raise TierConfigError(f"RedisTier: pass secret= or set {SECRET_ENV}")
        self.codec = KeyCodec(namespace, secret)
        self.auth = self.codec.auth
        self.limits = limits or TenantLimits()
        self.chunk_bytes = chunk_bytes
        self.verify_reads = verify_reads
        self.name = f"redis tier {redact(url) if url else type(client).__name__}"
        self._url, self._redis_kwargs = url, redis_kwargs
        # A plain client is created now (it does not connect yet), so a bad URL raises here;
        # a Cluster client discovers the cluster when created: lazily, through the breaker.
        if url is not None and not is_cluster_url(url):
            client = connect(url, **redis_kwargs)
        self._client: RedisClient | None = client
        self._ledger: QuotaLedger | None = None
        self._drop_lua: Any = None
        self._client_lock = threading.Lock()
        self._breaker = Breaker(self.name, retry_interval_s, _log, probe=self._probe)
        self._counters = Counters()
        self._warned: set[str] = set()
        self._pending: dict[EntryKey, _Job] = {}
        self._plock = threading.Lock()
        self._closed = False
        self._encoder = ThreadPoolExecutor(1, thread_name_prefix="hybridcache-redis-encoder")
        self._writer: BackgroundWriter[_Job] = BackgroundWriter(
            self._write_batch,
            max_jobs=max_pending_writes,
            max_bytes=max_pending_bytes,
            batch_bytes=write_batch_bytes,
            name="hybridcache-redis-writer",
        )

    # ------------------------------------------------------------------ public API

    def put(
        self, key: EntryKey, entry: Entry, *, ttl_s: float | None = None, priority: float = 0.0
    ) -> bool:
        """Queue ``entry`` for writing; returns at once (``False``: queue full, dropped).

        The tier keeps references to the entry's arrays until written: do not modify them.
        ``priority`` is ignored (Redis evicts by quota order and TTL). Every argument is
        validated here, in the caller's thread (raising the library's error), so nothing
        can fail later in the writer thread but the server.
        """
        check_put(key, entry, ttl_s, priority)
        check_layout(entry, self.chunk_bytes)
        ttl = self.limits.ttl_for(key.tenant, ttl_s)
        job = _Job("put", key, entry, ttl, entry.nbytes)
        # MACs are computed on the encoder thread while the writer sends the previous
        # entry (socket sends release the GIL), so they overlap the network transfer.
        with self._plock:
            if self._closed:
                self._counters.add(dropped_writes=1)
                return False
            job.encoded = self._encoder.submit(
                encode, key, entry, self.auth, chunk_bytes=self.chunk_bytes
            )
            if not self._writer.submit(job):
                job.encoded.cancel()
                self._counters.add(dropped_writes=1)
                return False
            self._pending[key] = job
        return True

    def delete(self, key: EntryKey) -> None:
        """Queue a delete, ordered after earlier puts of the same key (never dropped)."""
        check_key(key)
        job = _Job("delete", key, None, None, 0)
        with self._plock:
            self._writer.submit(job, bounded=False)
            self._pending[key] = job

    def get_many(self, keys: Sequence[EntryKey]) -> list[Entry | None]:
        keys = check_keys(keys)
        results: list[Entry | None] = [None] * len(keys)
        remote = self._serve_pending(keys, results, lambda job: job.entry)
        if remote:
            wanted = [keys[i] for i in remote]
            names = [self.codec.entry_key(k) for k in wanted]
            fetched = self._call(lambda c: self._fetch(c, wanted, names))
            if fetched is not UNAVAILABLE:
                for i, entry in zip(remote, fetched, strict=True):
                    results[i] = entry
        hits = [e for e in results if e is not None]
        self._counters.add(
            hits=len(hits), misses=len(keys) - len(hits), bytes_out=sum(e.nbytes for e in hits)
        )
        return results

    def contains_many(self, keys: Sequence[EntryKey]) -> list[bool]:
        keys = check_keys(keys)
        found: list[bool] = [False] * len(keys)
        remote = self._serve_pending(keys, found, lambda job: job.entry is not None)
        if remote:
            names = [self.codec.entry_key(keys[i]) for i in remote]
            replies = self._call(lambda c: redis_io.pipelined(c, "exists", names))
            if replies is not UNAVAILABLE:
                for i, reply in zip(remote, replies, strict=True):
                    found[i] = reply == 1
        return found

    def stats(self) -> TierStats:
        return self._counters.snapshot(pending_writes=self._writer.pending)

    def flush(self, timeout_s: float | None = None) -> bool:
        return self._writer.flush(timeout_s)

    def close(self) -> None:
        with self._plock:
            self._closed = True
        self._writer.close()
        self._encoder.shutdown(wait=True, cancel_futures=True)
        with self._client_lock:
            if self._client is not None:
                self._client.close()

    def usage(self, tenant: str) -> int | None:
        """Bytes accounted to ``tenant`` in the shared ledger (``None``: no quota or down)."""
        if self.limits.quota_for(tenant) is None:
            return None
        out = self._call(lambda c: self._get_ledger().usage(tenant))
        return None if out is UNAVAILABLE else out

    def reconcile_quota(self, tenant: str) -> int | None:
        """Release ledger bytes of entries Redis no longer holds (see :mod:`.quota`)."""
        out = self._call(lambda c: self._get_ledger().reconcile(tenant))
        return None if out is UNAVAILABLE else out

    def ping(self) -> bool:
        """Whether the server answers now (bypasses the breaker's wait)."""
        try:
            ok = bool(self._get_client().ping())
        except (RedisError, *_OUTAGE_ERRORS) as exc:
            self._breaker.failure(exc)
            return False
        self._breaker.success()
        return ok

    # ------------------------------------------------------------------ reads

    def _serve_pending(
        self, keys: Sequence[EntryKey], out: list, answer: Callable[[_Job], object]
    ) -> list[int]:
        """Fill ``out`` for keys with a pending job; return the indices Redis must answer."""
        remote: list[int] = []
        with self._plock:
            for i, key in enumerate(keys):
                job = self._pending.get(key)
                if job is None:
                    remote.append(i)
                else:
                    out[i] = answer(job)
        return remote

    def _fetch(
        self, client: RedisClient, keys: list[EntryKey], names: list[str]
    ) -> list[Entry | None]:
        fetched = redis_io.fetch(client, keys, names, self.auth)
        for bad in fetched.bad:
            self._drop(client, bad)
        return fetched.entries

    def _drop(self, client: RedisClient, bad: redis_io.BadEntry) -> None:
        """Delete a bad entry if it is still the one read; count and log it."""
        if bad.manifest is None:
            client.unlink(bad.name)
            dropped = True
        else:
            dropped = bool(
                self._drop_script(client)(keys=[bad.name, *bad.chunks], args=[bad.manifest])
            )
        if dropped:  # otherwise it was replaced meanwhile: a race, not corruption
            _log.info("%s: dropped corrupt entry %s (%s)", self.name, bad.name, bad.reason)
            self._counters.add(corrupt=1)
            self._release(bad.key, bad.name)

    # ------------------------------------------------------------------ writes

    def _write_batch(self, jobs: list[_Job]) -> None:
        """Writer thread: reserve quota, write the batch, then clear the pending entries."""
        try:
            out = self._call(lambda c: self._write_now(c, jobs))
        except Exception:  # a bug, not an outage: never let it reach the engine
            _log.exception("%s: writing a batch of %d failed", self.name, len(jobs))
            self._counters.add(errors=1)
            out = UNAVAILABLE
        try:
            if out is UNAVAILABLE:
                self._counters.add(dropped_writes=sum(1 for j in jobs if j.op == "put"))
        finally:
            with self._plock:
                for job in jobs:
                    if self._pending.get(job.key) is job:
                        del self._pending[job.key]

    def _write_now(self, client: RedisClient, jobs: list[_Job]) -> None:
        ops: list[redis_io.WriteOp] = []
        owners: list[_Job | None] = []  # the job of each op (None: a quota victim)
        for job in jobs:
            name = self.codec.entry_key(job.key)
            if job.op == "delete":
                ops.append(redis_io.WriteOp(name, job.key.tenant))
                owners.append(job)
                continue
            assert job.entry is not None
            if job.encoded is not None:
                encoded = job.encoded.result()
            else:
                encoded = encode(job.key, job.entry, self.auth, chunk_bytes=self.chunk_bytes)
            admitted, victims = self._reserve(job, name, encoded.stored_bytes)
            if admitted:
                gen = new_generation()
                ops.append(redis_io.WriteOp(name, job.key.tenant, encoded, job.ttl_s, gen))
                owners.append(job)
            # Victims go after the put that evicted them, as the ledger saw them.
            ops.extend(redis_io.WriteOp(v, job.key.tenant) for v in victims)
            owners.extend([None] * len(victims))
        written = redis_io.write(client, ops)
        stale: list[str] = []
        puts = deletes = stored = 0
        for op, job, error, old in zip(ops, owners, written.errors, written.replaced, strict=True):
            stale += redis_io.chunks_of(op, old, self.auth, op.generation)
            if error is not None:
                self._counters.add(errors=1, dropped_writes=int(op.encoded is not None))
                self._warn_once(error)
                if op.encoded is not None:  # refused (OOM, NOPERM): take back what it wrote
                    stale += self._undo_put(client, op, job)
            elif op.encoded is not None:
                puts, stored = puts + 1, stored + op.encoded.nbytes
            elif job is not None:
                deletes += 1
                self._release(job.key, op.name)
        self._counters.add(
            puts=puts, deletes=deletes, bytes_in=stored, evictions=owners.count(None)
        )
        redis_io.unlink(client, stale)

    def _undo_put(self, client: RedisClient, op: redis_io.WriteOp, job: _Job | None) -> list[str]:
        """A put the server refused part of: drop its manifest if it is still ours (so no
        entry names a missing chunk), release its quota bytes, and return its chunk keys
        for the caller to unlink (so a refused put leaves no orphan chunk)."""
        assert op.encoded is not None
        chunks = chunk_names(op.name, op.generation, len(op.encoded.chunks))
        mine = pack_manifest(op.generation, op.encoded.header)
        try:
            self._drop_script(client)(keys=[op.name], args=[mine])
        except RedisError as exc:  # OOM refuses no deletes; any other refusal: chunks' TTL
            self._warn_once(exc)
        if job is not None:
            self._release(job.key, op.name)
        return chunks

    def _reserve(self, job: _Job, name: str, size: int) -> tuple[bool, list[str]]:
        """Account ``size`` bytes (header + payload) in the tenant's shared ledger."""
        quota = self.limits.quota_for(job.key.tenant)
        if quota is None:
            return True, []
        admitted, victims = self._get_ledger().reserve(job.key.tenant, name, size, job.ttl_s, quota)
        if not admitted:
            self._counters.add(quota_rejections=1)
        return admitted, victims

    def _release(self, key: EntryKey, name: str) -> None:
        if self.limits.quota_for(key.tenant) is not None:
            self._get_ledger().release(key.tenant, name)

    # ------------------------------------------------------------------ plumbing

    def _get_client(self) -> RedisClient:
        """The client, created on first use (a Cluster client connects when created)."""
        with self._client_lock:
            if self._client is None:
                assert self._url is not None
                self._client = connect(self._url, **self._redis_kwargs)
            return self._client

    def _probe(self) -> None:
        """The breaker's probe, on its background thread: raises unless Redis answers."""
        if not self._get_client().ping():
            raise RedisConnectionError("PING got no PONG")

    def _drop_script(self, client: RedisClient) -> Any:
        if self._drop_lua is None:
            self._drop_lua = client.register_script(DROP_LUA)
        return self._drop_lua

    def _get_ledger(self) -> QuotaLedger:
        if self._ledger is None:
            self._ledger = QuotaLedger(self._get_client(), self.codec)
        return self._ledger

    def _call(self, fn: Callable[[RedisClient], T]) -> T | _Unavailable:
        """Run ``fn`` against Redis, turning every failure into ``UNAVAILABLE``."""
        if not self._breaker.allow():
            return UNAVAILABLE
        try:
            out = fn(self._get_client())
        except _OUTAGE_ERRORS as exc:
            self._counters.add(errors=1)
            self._breaker.failure(exc)
            return UNAVAILABLE
        except (ResponseError, RedisError) as exc:  # the server refused: OOM, NOPERM, ...
            self._counters.add(errors=1)
            self._warn_once(exc)
            return UNAVAILABLE
        self._breaker.success()
        return out

    def _warn_once(self, exc: Exception) -> None:
        kind = f"{type(exc).__name__}:{str(exc).split(' ', 1)[0]}"
        if kind not in self._warned:
            self._warned.add(kind)
            _log.warning("%s: server refused a command (%s); counting it as a miss", self.name, exc)
