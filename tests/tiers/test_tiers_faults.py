"""Tier fault suite against a real redis-server: forged, truncated and oversized manifests, a
paused server, a restart with empty data, and ``maxmemory`` under ``allkeys-lru`` and
``noeviction``.

Every case runs its calls through :class:`Tally`, which counts calls, hits, misses,
exceptions reaching the caller and wrong payloads, asserts the last two are zero, and
prints one line per case (``pytest -s`` or ``-rA`` shows them; each count is also a junit
property). A wrong payload is any returned entry whose bytes differ from what was put.
"""

from __future__ import annotations

import re
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack
import numpy as np
import pytest
import xxhash
from offload_testlib import make_engine, serve
from test_offload import PROMPT
from tiers_testlib import SECRET, assert_same, entry_for, key, poll

from hybridcache.tiers import Entry, EntryAuth, EntryKey, RedisTier
from hybridcache.tiers.format import MAX_CHUNKS
from hybridcache.tiers.offload import OffloadCoordinator

pytestmark = [
    pytest.mark.redis,
    pytest.mark.filterwarnings("ignore:The given buffer is not writable:UserWarning"),
    pytest.mark.filterwarnings("ignore::hybridcache.tiers.unseeded.UnseededCacheWarning"),
]

_CHUNK_RE = re.compile(r"(.*\}):([0-9a-f]{16}):(\d+)")


@dataclass
class Tally:
    """Counts of one fault case; every call of the caller's API goes through it."""

    case: str
    counts: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("calls", "hits", "misses", "exceptions", "wrong_payloads"), 0
        )
    )

    def get(self, tier: RedisTier, k: EntryKey, expected: Entry | None) -> Entry | None:
        """``tier.get(k)``; a returned entry must be ``expected`` byte for byte."""
        self.counts["calls"] += 1
        try:
            out = tier.get(k)
        except Exception:  # counted, then failed on in ``check``
            self.counts["exceptions"] += 1
            return None
        if out is None:
            self.counts["misses"] += 1
            return None
        self.counts["hits"] += 1
        try:
            assert expected is not None
            assert_same(out, expected)
        except AssertionError:
            self.counts["wrong_payloads"] += 1
        return out

    def call(self, fn: Callable[[], object]) -> object:
        """Any other caller-facing call (put, contains, delete): it must not raise."""
        self.counts["calls"] += 1
        try:
            return fn()
        except Exception:
            self.counts["exceptions"] += 1
            return None

    def check(self, record_property) -> None:
        for name, n in self.counts.items():
            record_property(f"{self.case}.{name}", n)
        line = " ".join(f"{k}={v}" for k, v in self.counts.items())
        print(f"\n[tier fault suite] {self.case}: {line}")
        assert self.counts["exceptions"] == 0, self.counts
        assert self.counts["wrong_payloads"] == 0, self.counts


def _stored(tier: RedisTier, r, k: EntryKey, entry: Entry | None = None):
    entry = entry or entry_for(k)
    tier.put(k, entry)
    assert tier.flush(10)
    name = tier.codec.entry_key(k)
    return name, r.get(name), entry


def _header_of(manifest: bytes) -> tuple[bytes, dict]:
    header = manifest[16:]
    return header, msgpack.unpackb(header[6:-32], raw=False)


def _signed(body: dict, auth: EntryAuth, version: int = 2, tenant: str = "alice") -> bytes:
    head = struct.pack("<4sH", b"HCTE", version) + msgpack.packb(body, use_bin_type=True)
    return head + auth.manifest_tag(tenant, head)


def _mget_calls(r) -> int:
    return int(r.info("commandstats").get("cmdstat_mget", {}).get("calls", 0))


# ---------------------------------------------------------------------- manifests


def test_forged_manifests_and_chunks_are_misses_and_deleted(
    redis_url, make_tier, redis_server, record_property
):
    """Whoever can write keys but lacks the secret: a structurally valid manifest signed
    with another key, the old unkeyed layout (xxh3), and other bytes under the chunk names
    of an authentic manifest. Each is a miss and is deleted; the authentic entry is served
    again once rewritten."""
    tally = Tally("forged")
    tier = make_tier(redis_url)
    r = redis_server.client()
    k = key("alice", 1)
    name, manifest, entry = _stored(tier, r, k)
    gen = manifest[:16]
    header, body = _header_of(manifest)
    evil = Entry({n: np.zeros_like(np.asarray(v)) for n, v in {"kv": entry.pieces["kv"]}.items()})
    forger = EntryAuth(b"a-forger-guessed-this-secret-32b")
    # 1. Wrong MAC: the forger re-signs the same body (and then its own pieces).
    forgeries = [gen + _signed(body, forger)]
    # 2. Version 1 layout: msgpack body + unkeyed xxh3-64 (old entries are misses too).
    head = struct.pack("<4sH", b"HCTE", 1) + msgpack.packb(body, use_bin_type=True)
    forgeries.append(gen + head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)))
    # 3. The authentic header, MAC bytes flipped.
    forgeries.append(manifest[:-1] + bytes([manifest[-1] ^ 1]))
    for forged in forgeries:
        r.set(name, forged)
        assert tally.get(tier, k, entry) is None
        assert r.exists(name) == 0, "a forged manifest is deleted"
    # The first chunks are orphans now (a forged manifest cannot name them): they wait for
    # their TTL (none here). Start clean for the next case.
    r.flushall()
    # 4. Authentic manifest, chunk bytes replaced by the forger's (same lengths).
    name, manifest, entry = _stored(tier, r, k)
    for chunk in sorted(n for n in r.keys(f"{name}:*")):
        r.set(chunk, b"\x00" * r.strlen(chunk))
    assert tally.get(tier, k, entry) is None
    assert r.keys("*") == [], "the entry and its chunks are deleted"
    # A forged entry built end to end with the wrong secret.
    fake = make_tier(redis_url, secret=b"a-forger-guessed-this-secret-32b")
    fake.put(k, evil)
    assert fake.flush(10)
    # Same key name? No: names are keyed too. Copy the forger's keys under ours.
    fname = fake.codec.entry_key(k)
    fmanifest = r.get(fname)
    r.set(name, fmanifest)
    for chunk in r.keys(f"{fname}:*"):
        r.set(chunk.decode().replace(fname, name), r.get(chunk))
    assert tally.get(tier, k, entry) is None
    assert r.exists(name) == 0
    _, _, entry = _stored(tier, r, k)
    assert tally.get(tier, k, entry) is not None
    assert tier.stats().corrupt == 5
    tally.check(record_property)


@pytest.mark.parametrize("cut", [1, 15, 17, 40, 0.5])
def test_truncated_manifests_are_misses(redis_url, make_tier, redis_server, record_property, cut):
    tally = Tally(f"truncated-{cut}")
    tier = make_tier(redis_url)
    r = redis_server.client()
    k = key("alice", 2)
    name, manifest, entry = _stored(tier, r, k)
    keep = int(len(manifest) * cut) if isinstance(cut, float) else len(manifest) - cut
    r.set(name, manifest[:keep])
    assert tally.get(tier, k, entry) is None
    assert tally.call(lambda: tier.contains(k)) is False
    assert r.exists(name) == 0
    tally.check(record_property)


def test_oversized_manifests_cost_no_chunk_reads(
    redis_url, make_tier, redis_server, record_property
):
    """The issue's 60-byte manifest naming a million chunks, forged and (worse) signed with
    the real secret, and a 2 MiB manifest: each is refused from the manifest alone, without
    one ``MGET`` of chunks, in milliseconds."""
    tally = Tally("oversized")
    tier = make_tier(redis_url)
    r = redis_server.client()
    k = key("alice", 3)
    name, manifest, entry = _stored(tier, r, k)
    gen = manifest[:16]
    _, body = _header_of(manifest)
    crafted = dict(body, cs=1, p=[["x", "np", "uint8", [1_000_000], 1_000_000, []]])
    cases = {
        "forged": gen + _signed(crafted, EntryAuth(b"a-forger-guessed-this-secret-32b")),
        "signed": gen + _signed(crafted, EntryAuth(SECRET)),  # a leaked secret
        "signed-65537-tags": gen
        + _signed(
            dict(body, cs=1, p=[["x", "np", "uint8", [MAX_CHUNKS + 1], MAX_CHUNKS + 1, []]]),
            EntryAuth(SECRET),
        ),
        "2MiB": gen + b"HCTE\x02\x00" + bytes(2 << 20),
        # Within the limits and signed, but without chunk MACs: never read from Redis.
        "signed-untagged": gen
        + _signed(
            dict(body, cs=1, p=[["x", "np", "uint8", [60_000], 60_000, []]]), EntryAuth(SECRET)
        ),
    }
    # The attack as it was: the old layout, an unkeyed checksum, ~60 bytes.
    old = struct.pack("<4sH", b"HCTE", 1) + msgpack.packb(
        {"cs": 1, "p": [["x", "np", "uint8", [1_000_000], 1_000_000, 0]]}, use_bin_type=True
    )
    cases["v1-60-bytes"] = gen + old + struct.pack("<Q", xxhash.xxh3_64_intdigest(old))
    assert len(cases["forged"]) < 256 and len(cases["v1-60-bytes"]) < 80
    for label, value in cases.items():
        r.set(name, value)
        before = _mget_calls(r)
        t0 = time.perf_counter()
        assert tally.get(tier, k, entry) is None, label
        elapsed = time.perf_counter() - t0
        assert _mget_calls(r) == before, f"{label}: chunks were read"
        assert elapsed < 1.0, f"{label}: {elapsed:.2f} s"  # a correctness bound, not a benchmark
        assert r.exists(name) == 0, label
    tally.check(record_property)


# ---------------------------------------------------------------------- outages


def _stall_case(tier: RedisTier, k: EntryKey, entry: Entry, tally: Tally, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        tally.get(tier, k, entry)
        tally.call(lambda: tier.contains(k))
        times.append(time.perf_counter() - t0)
        time.sleep(0.02)  # the engine's own work between lookups; lets probes come due
    return times


@pytest.mark.parametrize("how", ["SIGSTOP", "CLIENT PAUSE"])
def test_black_holed_server_stalls_the_caller_once(own_redis, make_tier, record_property, how):
    """After the first timeout the breaker fails fast and probes run on their own thread:
    40 lookups over ~1 s (retry interval 0.05 s: a probe comes due every 0.05 s, and runs
    as soon as the previous one gave up) cost one socket timeout, not one per probe. Then
    the server answers again and reads hit."""
    tally = Tally(f"paused-{how}")
    timeout = 0.5
    tier = make_tier(own_redis.url, socket_timeout=timeout, retry_interval_s=0.05)
    k = key("alice", 4)
    entry = entry_for(k)
    tier.put(k, entry)
    assert tier.flush(10)
    admin = own_redis.client()
    if how == "SIGSTOP":
        own_redis.pause()
    else:
        admin.execute_command("CLIENT", "PAUSE", 4000, "ALL")
    try:
        times = _stall_case(tier, k, entry, tally, 40)
    finally:
        if how == "SIGSTOP":
            own_redis.resume()
        else:
            admin.execute_command("CLIENT", "UNPAUSE")
    print(f"\n[tier fault suite] paused-{how}: total {sum(times):.2f} s, max {max(times):.2f} s")
    assert tally.counts["misses"] >= 39
    # One timeout (two calls may race into it), plus slack for a loaded machine.
    assert sum(times) < 2 * timeout + 1.0, times
    assert sorted(times)[-3] < 0.1, "only the first calls may wait on the server"
    assert tier._breaker.probes >= 2, "probes ran in the background meanwhile"
    assert poll(lambda: tally.get(tier, k, entry) is not None, timeout_s=10)
    tally.check(record_property)


def _one_engine(tier: RedisTier, *, probe_batch: int = 16, **kw):
    m, st = make_engine()
    return m, st, OffloadCoordinator(m, st, [tier], probe_batch=probe_batch, **kw)


@pytest.mark.parametrize("probe_batch", [16, 2])
def test_redemotion_after_a_restart_with_empty_data(
    own_redis, make_tier, record_property, probe_batch
):
    """Engine 1 demoted a session; Redis restarts without persistence (empty). Engine 1
    serves the prompt again (its probe finds nothing) and evicts it: it must write the
    entries again, so that engine 2 hits. ``probe_batch=2`` leaves most units unprobed
    past the first hole: they must be re-demoted too."""
    tally = Tally(f"restart-empty-{probe_batch}")
    t1 = make_tier(own_redis.url, retry_interval_s=0.05)
    m1, st1, c1 = _one_engine(t1, probe_batch=probe_batch)
    serve(m1, st1, "a", PROMPT, coordinator=c1)
    m1.clear()
    assert c1.flush(10)
    first_puts = t1.stats().puts
    own_redis.kill()
    own_redis.start()
    assert own_redis.client().dbsize() == 0
    assert poll(lambda: tally.call(lambda: t1.contains(key("alice", 0))) is False)
    tally.call(lambda: serve(m1, st1, "b", PROMPT, coordinator=c1))
    m1.clear()
    assert c1.flush(10)
    assert t1.stats().puts > first_puts, "the lost entries were written again"
    m2, st2, c2 = _one_engine(make_tier(own_redis.url))
    hit, plan = tally.call(lambda: serve(m2, st2, "c", PROMPT + [7] * 6, coordinator=c2))
    tally.counts["engine2_hit_tokens"] = hit
    assert hit == 40 and plan is not None
    tally.check(record_property)


def test_stored_memory_expires_without_a_probe(redis_url, make_tier, redis_server, record_property):
    """An entry lost while the engine keeps it on the device is never probed; the belief
    that it is stored still expires after ``stored_max_age_s``."""
    tally = Tally("stored-expiry")
    t1 = make_tier(redis_url)
    m1, st1, c1 = _one_engine(t1, stored_max_age_s=0.3)
    serve(m1, st1, "a", PROMPT, coordinator=c1)
    m1.clear()
    assert c1.flush(10)
    serve(m1, st1, "b", PROMPT + [7] * 6, coordinator=c1)  # loads it all back, marks it stored
    redis_server.client().flushall()  # lost behind the engine's back (device copy intact)
    time.sleep(0.35)
    m1.clear()
    assert c1.flush(10)
    m2, st2, c2 = _one_engine(make_tier(redis_url))
    hit, plan = tally.call(lambda: serve(m2, st2, "c", PROMPT + [7] * 6, coordinator=c2))
    tally.counts["engine2_hit_tokens"] = hit
    assert hit == 40 and plan is not None
    tally.check(record_property)


# ---------------------------------------------------------------------- maxmemory


# name, PTTL, and the first 16 bytes of each string key (a manifest's generation), atomically.
_CENSUS_SCRIPT = """
local out = {}
for _, n in ipairs(redis.call('KEYS', '*')) do
  local head = ''
  if redis.call('TYPE', n).ok == 'string' then head = redis.call('GETRANGE', n, 0, 15) end
  out[#out + 1] = n
  out[#out + 1] = redis.call('PTTL', n)
  out[#out + 1] = head
end
return out
"""


def _key_census(r) -> tuple[list[str], list[str]]:
    """(orphan chunk keys, chunk keys without a TTL) of the whole database.

    One atomic view, taken by a script: Redis evicts before any command once memory is over
    ``maxmemory``, reads included, so under ``allkeys-lru`` a key listed by one ``KEYS`` may
    be gone by a later ``PTTL`` (-2), which is not a key without a TTL (-1)."""
    flat = r.eval(_CENSUS_SCRIPT, 0)
    keys = {flat[i].decode(): (flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)}
    orphans, no_ttl = [], []
    for n, (ttl_ms, _) in keys.items():
        m = _CHUNK_RE.fullmatch(n)
        if m is None:
            continue
        manifest = keys.get(m.group(1), (None, b""))[1]
        if not manifest or manifest.decode() != m.group(2):
            orphans.append(n)
        if ttl_ms == -1:
            no_ttl.append(n)
    return orphans, no_ttl


def _fill(tier: RedisTier, tally: Tally, r, n: int, ttl_s: float | None) -> dict:
    r.config_set("maxmemory", r.info("memory")["used_memory"] + (3 << 20))
    written = {}
    for i in range(n):
        k = key("alice", 100 + i)
        entry = Entry({"kv": np.full(700_000 + i, i % 251, np.uint8), "s": np.arange(i + 1)})
        written[k] = entry
        tally.call(lambda k=k, entry=entry: tier.put(k, entry, ttl_s=ttl_s))
        assert tier.flush(30), "a put still in flight: the census would see it half-written"
    return written


@pytest.mark.parametrize("policy", ["noeviction", "allkeys-lru"])
@pytest.mark.parametrize("ttl_s", [None, 600.0])
def test_maxmemory_leaves_no_orphans_and_no_wrong_reads(
    own_redis, make_tier, record_property, policy, ttl_s
):
    tally = Tally(f"maxmemory-{policy}-ttl{ttl_s}")
    tier = make_tier(own_redis.url, chunk_bytes=64 << 10)
    r = own_redis.client()
    r.config_set("maxmemory-policy", policy)
    written = _fill(tier, tally, r, 12, ttl_s)
    for k, entry in written.items():
        tally.get(tier, k, entry)
    orphans, no_ttl = _key_census(r)
    stats = tier.stats()
    print(f"\n[tier fault suite] {tally.case}: puts={stats.puts} dropped={stats.dropped_writes}")
    if policy == "noeviction":
        assert stats.dropped_writes > 0, "the test must reach maxmemory"
        assert orphans == [], f"{len(orphans)} orphan chunk keys"
        assert tally.counts["hits"] > 0, "what fitted is served"
    else:
        assert tally.counts["misses"] > 0, "the test must make Redis evict"
    if ttl_s is not None:
        assert no_ttl == [], f"{len(no_ttl)} chunk keys without a TTL"
    tally.check(record_property)


@pytest.mark.parametrize("ttl_s", [None, 600.0])
def test_a_put_refused_after_its_chunks_leaves_no_orphans(
    own_redis, make_tier, record_property, ttl_s
):
    """Deterministic version of a put refused half-way: a user may write chunk keys but not
    manifests (``NOPERM`` on the manifest ``SET``, after every chunk ``SET`` succeeded).
    The refused put must take its chunks back."""
    tally = Tally(f"refused-after-chunks-ttl{ttl_s}")
    admin = own_redis.client()
    admin.execute_command("ACL", "SETUSER", "halfway", "on", ">pw", "%R~*", "%W~*}:*", "+@all")
    url = f"redis://halfway:pw@127.0.0.1:{own_redis.port}"
    tier = make_tier(url, chunk_bytes=64 << 10)
    for i in range(4):
        k = key("alice", 200 + i)
        tally.call(
            lambda k=k, i=i: tier.put(k, Entry({"kv": np.full(200_000, i, np.uint8)}), ttl_s=ttl_s)
        )
        assert tier.flush(10)
        tally.get(tier, k, None)
    assert tier.stats().dropped_writes == 4
    assert admin.dbsize() == 0, f"{admin.dbsize()} keys left by refused puts"
    tally.check(record_property)
