"""Simulator throughput: Mooncake requests replayed per minute, per policy and capacity.

The issue's target is >= 200,000 Mooncake requests per minute per policy. Replays run one
after another in this process (best of ``--repeat`` runs each, so that a busy machine's
noise does not hide the replay's own cost); trace reading and digest computation are timed
apart, because a sweep does them once for all its policies.

    python benchmarks/bench_sim.py [--trace PATH] [--capacity 32GiB,256GiB] [--policy ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from hybridcache.presets import get_preset
from hybridcache.sim.policies import build_policy, parse_policies
from hybridcache.sim.replay import BlockDigests
from hybridcache.sim.runner import default_unit, run_one
from hybridcache.sim.sizes import format_bytes, parse_sizes
from hybridcache.sim.traces import read_trace

TARGET_PER_MIN = 200_000
DEFAULT_TRACE = Path(__file__).resolve().parents[1].parent / "shared/traces/mooncake_synthetic_trace.jsonl"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--model", default="kimi-linear-48b")
    p.add_argument("--capacity", default="32GiB,256GiB")
    p.add_argument("--policy", default="hybridcache,vllm-align,sglang,sglang-extra,marconi,kv-only")
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args(argv)
    if not Path(args.trace).exists():
        print(f"trace not found: {args.trace}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    trace = read_trace(args.trace)
    t_read = time.perf_counter() - t0
    t0 = time.perf_counter()
    digests = BlockDigests(trace)
    for i in range(len(trace.requests)):
        digests.get(i)
    t_dig = time.perf_counter() - t0
    n = len(trace.requests)
    print(f"{args.trace}: {n} requests; read {t_read:.2f} s, block digests {t_dig:.2f} s (once per sweep)")
    spec = get_preset(args.model)
    unit = default_unit(trace)
    print(f"{'policy':<14}{'capacity':>10}{'best s':>9}{'req/min':>12}  target {TARGET_PER_MIN:,}")
    worst = float("inf")
    for name in parse_policies(args.policy):
        if name == "vllm-native":
            continue  # replays token traces only
        setup = build_policy(name, spec, unit, outputs_known=False)
        for cap in parse_sizes(args.capacity):
            best = min(_timed(trace, setup, cap, digests) for _ in range(max(1, args.repeat)))
            rate = n / best * 60
            worst = min(worst, rate)
            flag = "" if rate >= TARGET_PER_MIN else "  below target"
            print(f"{name:<14}{format_bytes(cap):>10}{best:>9.2f}{rate:>12,.0f}{flag}")
    print(f"slowest: {worst:,.0f} requests/min")
    return 0


def _timed(trace, setup, cap, digests) -> float:
    t0 = time.perf_counter()
    run_one(trace, setup, cap, digests)
    return time.perf_counter() - t0


if __name__ == "__main__":
    raise SystemExit(main())
