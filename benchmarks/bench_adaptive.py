"""Added manager time per request of the adaptive policy, against the fixed one, in one run.

    python benchmarks/bench_adaptive.py [--requests 2000] [--kind chat] [--tenants 2]
                                        [--capacity 64GiB] [--repeat 3]

The request loop of ``benchmarks/bench_manager.py`` (match + allocate + append + commit +
free per request, hashing included) over a generated stream, once with
``HybridCacheManager``'s defaults and once with ``CacheConfig(admission="adaptive")``.
Rounds alternate the order (a shared machine drifts 10-20 % within minutes); the ratio is
the median of per-round ratios. Target of issue 16: <= 1.15.

Beside the headline ratio (against the library's default setting) it times a third manager,
fixed at the adaptive one's starting candidate (the simulator's ``hybridcache`` policy: the
default plus interval checkpoints), so that what the adaptation machinery adds is told
apart from what the candidate's own checkpoints cost. Per round it prints the sampling
rate, the shadows' work as a fraction of the live work (units handled: the budget's
currency) and whether the shadows were still exploring (outside the budget, see
``hybridcache.adaptive``): while they explore the shadows cost about ``candidates x rate``.
Each ratio comes twice: by the wall clock per request (``serve_requests``' timing) and by
this process's CPU time over the loop, which other jobs on a shared machine do not inflate.
The CPU time is also split (``adaptive_stats()["shadow_seconds"]``): the shadow replays'
part and the rest (the live cache with its spare checkpoints, the sampling step), each over
the fixed manager's CPU time, so that a change is measured where it acts.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import hybridcache.adaptive as adaptive_module
from hybridcache.adaptive import candidate_settings
from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.presets import get_preset
from hybridcache.sim.generate import KINDS, generate
from hybridcache.sim.sizes import parse_size

try:
    from benchmarks.bench_manager import serve_requests
except ImportError:  # run as a script (the documented command): benchmarks/ is on sys.path
    from bench_manager import serve_requests


def run(spec, capacity, reqs, config: CacheConfig) -> tuple[float, float, HybridCacheManager, float]:
    """Mean seconds per request, token hit rate, the manager, and the CPU seconds of the
    whole loop (this process's: on a shared machine the wall clock also counts the time
    other jobs held the core, the CPU clock does not)."""
    m = HybridCacheManager(spec, capacity, config)
    cpu = time.process_time()
    times, hit, prompt = serve_requests(m, reqs)
    cpu = time.process_time() - cpu
    return sum(times) / max(len(times), 1), hit / max(prompt, 1), m, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--kind", default="chat", choices=KINDS)
    ap.add_argument("--tenants", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="kimi-linear-48b")
    ap.add_argument("--capacity", default="64GiB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--racing", choices=("on", "off"), default="on",
                    help="retire candidates that cannot win (hybridcache.adaptive.RETIRE); off: replay all")
    args = ap.parse_args()
    adaptive_module.RETIRE = args.racing == "on"
    spec, cap = get_preset(args.model), parse_size(args.capacity)
    reqs = generate(args.kind, args.requests, seed=args.seed, tenants=args.tenants)
    fixed, adaptive = CacheConfig(hash_unit=16), CacheConfig(hash_unit=16, admission="adaptive")
    first = candidate_settings(spec, 16)[0]
    start = CacheConfig(hash_unit=16, admission=first.admission, min_seen=first.min_seen)
    run(spec, cap, reqs[:200], fixed)  # untimed warm-up
    run(spec, cap, reqs[:200], adaptive)
    ratios, machinery, cpu_ratios, cpu_machinery, shadow_part, live_part = [], [], [], [], [], []
    for k in range(max(1, args.repeat)):
        order = [("fixed", fixed), ("start", start), ("adaptive", adaptive)]
        out = {}
        for name, cfg in order if k % 2 == 0 else order[::-1]:
            gc.collect()
            out[name] = run(spec, cap, reqs, cfg)
        f, s0, a = out["fixed"], out["start"], out["adaptive"]
        ratios.append(a[0] / f[0])
        machinery.append(a[0] / s0[0])
        cpu_ratios.append(a[3] / f[3])
        cpu_machinery.append(a[3] / s0[3])
        st = a[2].adaptive_stats()
        shadow_part.append(st["shadow_seconds"] / f[3])
        live_part.append((a[3] - st["shadow_seconds"]) / f[3])
        phase = "exploring" if st["exploring"] else "budgeted"
        print(f"round {k}: fixed {f[0] * 1e6:.0f} us/request (hit {f[1]:.3f}), start setting {s0[0] * 1e6:.0f}, "
              f"adaptive {a[0] * 1e6:.0f} (hit {a[1]:.3f}, rate {a[2].rate:.3f}, shadow work "
              f"{st['overhead_units']:.3f} of live, {phase}, {st['retirements']} retired): {ratios[-1]:.2f}x, {machinery[-1]:.2f}x of start "
              f"(CPU time {cpu_ratios[-1]:.2f}x, {cpu_machinery[-1]:.2f}x; of the fixed one's CPU time: "
              f"shadow replays {shadow_part[-1]:.3f}, the rest {live_part[-1]:.3f})")
    print(f"{args.kind}, {args.tenants} tenants, {args.requests} requests, {args.model}, {args.capacity}: "
          f"adaptive / fixed time per request, median of {len(ratios)} rounds: {statistics.median(ratios):.2f}x "
          f"(adaptive / its starting setting fixed: {statistics.median(machinery):.2f}x); CPU time: "
          f"{statistics.median(cpu_ratios):.2f}x ({statistics.median(cpu_machinery):.2f}x); split of the CPU time "
          f"against the fixed one's: shadow replays {statistics.median(shadow_part):.3f}, the live cache and "
          f"its sampling {statistics.median(live_part):.3f}")


if __name__ == "__main__":
    main()
