"""Per-tenant byte quotas kept *in Redis*, so every engine sharing the cache enforces them.

Why not a plain ``INCRBY``/``DECRBY`` counter: entries leave Redis by TTL expiry too, and
nobody decrements a counter for an expired key, so the counter would only grow until the
tenant were locked out. The ledger therefore records each entry with its deadline:

* a sorted set ``member -> deadline`` (server clock, ms with a microsecond fraction, so
  successive puts keep their order; entries without TTL get ``now + 10^11`` ms, about three
  years, so they sort after every entry with a shorter TTL, oldest first), and
* a hash ``member -> bytes`` plus a ``#total`` field,

both under one cluster hash tag (see :meth:`KeyCodec.ledger_keys`). One Lua script (atomic,
server clock, one slot) prunes the tenant's expired members, then reserves room for a new
entry by releasing the members closest to expiry (for uniform TTLs: the oldest) until the
new entry fits, and returns those victims for the caller to delete. An entry larger than
the quota is refused.

Known drift, and the cure: an entry that Redis evicts under ``maxmemory`` or that is deleted
by hand stays counted until its deadline; :meth:`QuotaLedger.reconcile` drops members whose
entry no longer exists. Deadlines are taken just before the entry is written, so the ledger
frees bytes a few milliseconds before Redis drops the key: negligible.
"""

from __future__ import annotations

from hybridcache.tiers.keys import KeyCodec
from hybridcache.tiers.redis_conn import RedisClient

_LEDGER_LUA = """
local NO_TTL = 1e11
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local function drop(m)
  local size = tonumber(redis.call('HGET', KEYS[2], m) or '0')
  redis.call('HDEL', KEYS[2], m)
  redis.call('ZREM', KEYS[1], m)
  if size > 0 then redis.call('HINCRBY', KEYS[2], '#total', -size) end
  return size
end
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do drop(m) end
local op = ARGV[1]
if op == 'reserve' then
  local m, size, ttl, quota = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
  if size > quota then return {0} end
  drop(m)
  local used = tonumber(redis.call('HGET', KEYS[2], '#total') or '0')
  local out = {1}
  while used + size > quota do
    local first = redis.call('ZRANGE', KEYS[1], 0, 0)
    if #first == 0 then break end
    used = used - drop(first[1])
    out[#out + 1] = first[1]
  end
  local deadline = now + NO_TTL
  if ttl > 0 then deadline = now + ttl end
  redis.call('ZADD', KEYS[1], deadline, m)
  redis.call('HSET', KEYS[2], m, size)
  redis.call('HINCRBY', KEYS[2], '#total', size)
  return out
elseif op == 'release' then
  return {drop(ARGV[2])}
end
return {tonumber(redis.call('HGET', KEYS[2], '#total') or '0')}
"""


class QuotaLedger:
    """Reserve / release / inspect a tenant's bytes in Redis (see the module notes).

    Every method may raise redis-py errors; :class:`~hybridcache.tiers.redis_tier.RedisTier`
    turns them into misses and dropped writes.
    """

    def __init__(self, client: RedisClient, codec: KeyCodec) -> None:
        self._client = client
        self._codec = codec
        self._script = client.register_script(_LEDGER_LUA)

    def reserve(
        self, tenant: str, member: str, nbytes: int, ttl_s: float | None, quota: int
    ) -> tuple[bool, list[str]]:
        """Account ``nbytes`` for ``member``; ``(accepted, members evicted to make room)``."""
        ttl_ms = 0 if ttl_s is None else max(1, round(ttl_s * 1000))
        out = self._script(
            keys=self._codec.ledger_keys(tenant),
            args=["reserve", member, nbytes, ttl_ms, quota],
        )
        return bool(out[0]), [m.decode() for m in out[1:]]

    def release(self, tenant: str, member: str) -> int:
        """Forget ``member``; returns the bytes it held (0 if unknown)."""
        return int(self._script(keys=self._codec.ledger_keys(tenant), args=["release", member])[0])

    def usage(self, tenant: str) -> int:
        """Bytes currently accounted to ``tenant`` (expired entries pruned first)."""
        return int(self._script(keys=self._codec.ledger_keys(tenant), args=["usage"])[0])

    def reconcile(self, tenant: str) -> int:
        """Release members whose entry is gone (evicted by Redis, deleted by hand).

        Returns the bytes released. Costs one ``EXISTS`` per member: run it rarely (e.g. when
        a tenant's hit rate drops, or from a maintenance job).
        """
        zset, _ = self._codec.ledger_keys(tenant)
        members = [m.decode() for m in self._client.zrange(zset, 0, -1)]
        if not members:
            return 0
        pipe = self._client.pipeline(transaction=False)
        for m in members:
            pipe.exists(m)
        freed = 0
        for member, alive in zip(members, pipe.execute(), strict=True):
            if not alive:
                freed += self.release(tenant, member)
        return freed
