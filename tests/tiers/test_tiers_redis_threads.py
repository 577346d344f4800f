"""8 threads x 1,000 mixed operations on one RedisTier: nothing lost, nothing mixed up.

Each thread owns a tenant (so it can predict exactly what every read must return) and also
hammers a shared tenant whose entries every thread writes: any read there must be either a
miss or exactly the entry derived from the key, never another key's bytes.
"""

from __future__ import annotations

import random
import threading

import pytest
from tiers_testlib import assert_same, entry_for, key

pytestmark = [
    pytest.mark.redis,
    pytest.mark.filterwarnings("ignore:The given buffer is not writable:UserWarning"),
]

THREADS = 8
OPS = 1000
OWN_KEYS = 40
SHARED_KEYS = 20


def _worker(tier, t: int, model: dict, failures: list) -> None:
    rng = random.Random(t)
    own = [key(f"t{t}", i) for i in range(OWN_KEYS)]
    shared = [key("shared", i) for i in range(SHARED_KEYS)]
    try:
        for _ in range(OPS):
            roll = rng.random()
            k = rng.choice(own)
            if roll < 0.30:
                assert tier.put(k, entry_for(k)), "no write may be dropped here"
                model[k] = True
            elif roll < 0.40:
                tier.delete(k)
                model[k] = False
            elif roll < 0.60:
                got = tier.get(k)
                assert (got is not None) == model.get(k, False), f"{k}: lost or resurrected"
                if got is not None:
                    assert_same(got, entry_for(k))
            elif roll < 0.70:
                ks = rng.sample(own, 4)
                assert tier.contains_many(ks) == [model.get(x, False) for x in ks]
            elif roll < 0.85:
                s = rng.choice(shared)
                tier.put(s, entry_for(s))
            else:
                ks = rng.sample(shared, 3)
                for s, got in zip(ks, tier.get_many(ks), strict=True):
                    if got is not None:
                        assert_same(got, entry_for(s))
    except AssertionError as exc:  # reported by the main thread
        failures.append(f"thread {t}: {exc}")


def test_eight_threads_mixed_operations(redis_url, make_tier):
    tier = make_tier(redis_url, max_pending_writes=100_000, chunk_bytes=256)
    models: list[dict] = [{} for _ in range(THREADS)]
    failures: list[str] = []
    threads = [
        threading.Thread(target=_worker, args=(tier, t, models[t], failures))
        for t in range(THREADS)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not failures, failures[:5]
    assert tier.flush(60)
    stats = tier.stats()
    assert stats.dropped_writes == 0 and stats.errors == 0 and stats.corrupt == 0

    # What reached Redis is exactly the final model: read through a second engine.
    reader = make_tier(redis_url)
    for t, model in enumerate(models):
        keys = [key(f"t{t}", i) for i in range(OWN_KEYS)]
        for k, got in zip(keys, reader.get_many(keys), strict=True):
            if model.get(k, False):
                assert_same(got, entry_for(k))
            else:
                assert got is None, f"{k} was deleted but is in Redis"
    shared = [key("shared", i) for i in range(SHARED_KEYS)]
    for s, got in zip(shared, reader.get_many(shared), strict=True):
        if got is not None:
            assert_same(got, entry_for(s))
