"""Store a hybrid model's KV pages and state snapshot in Redis as one entry, and read it back.

Starts nothing: give it the URL of a Redis server you run (``redis-server --port 6379``):

    HYBRIDCACHE_TIER_SECRET=$(python -c "import secrets; print(secrets.token_hex(16))") \\
        python examples/redis_tier.py redis://127.0.0.1:6379

The secret keys tenant names and authenticates entries; every engine that shares the cache
uses the same one (at least 16 bytes). Pieces may be numpy arrays or torch CPU tensors.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from hybridcache import get_preset
from hybridcache.tiers import Entry, EntryKey, RedisTier
from hybridcache.tiers.redis_tier import SECRET_ENV


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url", help="Redis URL, e.g. redis://127.0.0.1:6379 or unix:///path/redis.sock")
    ap.add_argument("--namespace", default="hc-example", help="key prefix in Redis")
    args = ap.parse_args(argv)
    if not os.environ.get(SECRET_ENV):
        print(f"set {SECRET_ENV} to a shared secret of at least 16 characters", file=sys.stderr)
        return 2

    spec = get_preset("kimi-linear-48b")
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((4, 1024), dtype=np.float32)       # stands for KV pages
    state = rng.standard_normal((2, 4096), dtype=np.float32)    # stands for a KDA snapshot
    key = EntryKey(tenant="alice", fingerprint=spec.fingerprint(), prefix_hash=b"\x01" * 16)
    foreign = EntryKey(tenant="bob", fingerprint=spec.fingerprint(), prefix_hash=b"\x01" * 16)

    tier = RedisTier(args.url, namespace=args.namespace)  # secret from the environment
    try:
        if not tier.ping():
            print(f"no Redis server answers at {args.url}", file=sys.stderr)
            return 1
        tier.put(key, Entry({"kv": kv, "state.kda": state}, meta={"tokens": 4096}), ttl_s=600)
        tier.flush(timeout_s=10)  # puts are written in the background
        got = tier.get(key)
        same = got is not None and all(
            np.array_equal(got.pieces[n], a) for n, a in (("kv", kv), ("state.kda", state)))
        print(f"alice's entry read back: {'identical' if same else 'MISSING OR DIFFERENT'}")
        print(f"bob asks for the same prefix: {'miss' if tier.get(foreign) is None else 'HIT'}")
        tier.delete(key)
        s = tier.stats()
        print(f"tier stats: puts {s.puts}, hits {s.hits}, misses {s.misses}, "
              f"bytes in {s.bytes_in:,}, bytes out {s.bytes_out:,}")
        return 0 if same else 1
    finally:
        tier.close()


if __name__ == "__main__":
    raise SystemExit(main())
