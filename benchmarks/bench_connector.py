"""Save and load time per block of ``HybridCacheConnector``'s worker side, beside a torch copy.

One block = every full-attention layer's KV page of the block plus, for a hybrid entry,
every recurrent layer's state page, as the connector stores it (one entry per block). The
default sizes are the tiny Qwen3-Next of the end-to-end test (block 256 tokens: 2 attention
layers x 2 x 256 x 128 bf16 = 128 KiB each, 2 GDN layers x 67,840 B of state); ``--scale``
multiplies the layer counts (e.g. ``--scale 12`` for 24 attention + 24 GDN layers).

Measured over ``--reps`` (best and median: on a shared machine the median carries other
processes' stalls, the best is the cost of the code; each rep saves ``--blocks`` hybrid blocks under new keys
and loads them back into other blocks, like a request restored in a new engine):

* ``torch copy``: gather the blocks out of the cache tensors and scatter them back
  (``index_select`` + ``index_copy_``): the floor any connector pays on CPU;
* ``HostTier``: ``WorkerSide.save`` (gather + put, HostTier copies) and ``WorkerSide.load``
  (``get_many`` + checks + scatter);
* ``RedisTier``: save, then ``flush()`` (background writer), and load (two round trips,
  checksums) against a redis-server this script starts (persistence off).

Run: ``python -m benchmarks.bench_connector [--blocks 8] [--reps 7] [--scale 1]`` (from the
repository root: it imports ``benchmarks.bench_tiers``).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch

from benchmarks.bench_tiers import SECRET, start_redis
from hybridcache.adapters.vllm.connector_plan import KIND_HYBRID, JobKey, LoadJob, SaveJob
from hybridcache.adapters.vllm.connector_worker import BlockIO, WorkerSide
from hybridcache.tiers import HostTier, RedisTier, Tier

FP = "bench-connector"


def make_cache(attn: int, state: int, block: int, num_blocks: int) -> tuple[BlockIO, dict]:
    caches = {}
    for i in range(attn):
        caches[f"attn.{i}"] = torch.randn(num_blocks, 2, block, 128).bfloat16()
    for i in range(state):
        caches[f"gdn.{i}"] = torch.randint(-128, 127, (num_blocks, 1, 1, 67840), dtype=torch.int8)
    io = BlockIO({1: [f"attn.{i}" for i in range(attn)], 0: [f"gdn.{i}" for i in range(state)]},
                 num_blocks)
    io.register(caches)
    return io, caches


def run_tier(side: WorkerSide, tier: Tier, n: int, rep: int) -> tuple[float, float]:
    src, dst = list(range(1, n + 1)), list(range(n + 1, 2 * n + 1))
    keys = [JobKey("bench", KIND_HYBRID, f"{rep}-{i}".encode()) for i in range(n)]
    jobs = [SaveJob("r", i, keys[i], {1: src[i]}, {0: src[i]}) for i in range(n)]
    t0 = time.perf_counter()
    side.save(jobs)
    tier.flush(timeout_s=60)
    t1 = time.perf_counter()
    ok = side.load(LoadJob("r", 0, keys, {1: dst}, {0: dst[-1]}))
    t2 = time.perf_counter()
    assert ok, side.stats.failure_reasons
    for k in keys:
        tier.delete(k.entry_key(FP))
    tier.flush(timeout_s=60)
    return t1 - t0, t2 - t1


def run_copy(io: BlockIO, n: int) -> tuple[float, float]:
    src, dst = list(range(1, n + 1)), list(range(n + 1, 2 * n + 1))
    t0 = time.perf_counter()
    kv, st = io.gather(1, src), io.gather(0, src)
    t1 = time.perf_counter()
    io.scatter(1, dst, kv)
    io.scatter(0, dst, st)
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--scale", type=int, default=1)
    ap.add_argument("--block-tokens", type=int, default=256)
    a = ap.parse_args()
    io, caches = make_cache(2 * a.scale, 2 * a.scale, a.block_tokens, 2 * a.blocks + 2)
    kv_bytes = sum(t[0].nbytes for name, t in caches.items() if name.startswith("attn."))
    st_bytes = sum(t[0].nbytes for name, t in caches.items() if name.startswith("gdn."))
    print(f"block: {kv_bytes / 2**10:.0f} KiB KV + {st_bytes / 2**10:.0f} KiB state "
          f"({2 * a.scale} attention + {2 * a.scale} GDN layers); {a.blocks} blocks per rep")
    workdir = tempfile.mkdtemp(prefix="bench-connector-")
    proc = None
    try:
        proc, port = start_redis(workdir)
        tiers = {"HostTier": HostTier(4 << 30),
                 "RedisTier": RedisTier(f"redis://127.0.0.1:{port}", secret=SECRET)}
        rows = {"torch copy": [run_copy(io, a.blocks) for _ in range(a.reps)]}
        for name, tier in tiers.items():
            side = WorkerSide(tier, FP, io, [1], [0], None)
            rows[name] = [run_tier(side, tier, a.blocks, r) for r in range(a.reps)]
        print(f"{'ms per block':12s} {'save best':>10s} {'median':>8s} {'load best':>10s} "
              f"{'median':>8s} {'MB/s save':>10s} {'MB/s load':>10s} (best)")
        mb = (kv_bytes + st_bytes) / 1e6
        for name, times in rows.items():
            sv = [t[0] * 1e3 / a.blocks for t in times]
            ld = [t[1] * 1e3 / a.blocks for t in times]
            print(f"{name:12s} {min(sv):10.3f} {statistics.median(sv):8.3f} {min(ld):10.3f} "
                  f"{statistics.median(ld):8.3f} {mb / min(sv) * 1e3:10.0f} "
                  f"{mb / min(ld) * 1e3:10.0f}")
        for tier in tiers.values():
            tier.close()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
