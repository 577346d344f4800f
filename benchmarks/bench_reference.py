"""Prefill wall time of the reference model with prefix caching on vs off.

Serves the check's default workload (``hybridcache.adapters.reference.check``) with caching
on and off at several arena sizes and prints, per size, the token hit rate next to the
ratio of prefill wall times (on / off). If a hit saves exactly the prefill it skips, the
time ratio is ``1 - hit rate``; the columns show how close the reference runner gets (the
rest is per-chunk overhead and the snapshot copies, which are counted as prefill time).

Run: ``python benchmarks/bench_reference.py [--repeat 5] [--kda chunked|recurrent] [--json]``.
Timings are the minimum over ``--repeat`` runs (single-threaded torch: the model is tiny),
as wall time and as process CPU time (steadier when other jobs share the machine).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from hybridcache.adapters.reference.check import DEFAULT_CAPACITY, CheckOptions, serve

CAPACITIES = (DEFAULT_CAPACITY // 2, DEFAULT_CAPACITY, DEFAULT_CAPACITY * 2, DEFAULT_CAPACITY * 8)


def measure(opts: CheckOptions, repeat: int) -> dict[str, float]:
    """Hit rate and minimum prefill wall / CPU seconds of ``opts`` with caching on and off."""
    runs: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
    stats = None
    for _ in range(repeat):
        for key, caching in (("on", True), ("off", False)):
            _, runner = serve(opts, caching=caching)
            runs[key].append((runner.stats.prefill_s, runner.stats.prefill_cpu_s))
            if caching:
                stats = runner.stats
    assert stats is not None
    hit = stats.hit_tokens / stats.prompt_tokens
    wall_on, wall_off = (min(w for w, _ in runs[k]) for k in ("on", "off"))
    cpu_on, cpu_off = (min(c for _, c in runs[k]) for k in ("on", "off"))
    return {
        "capacity_mib": opts.capacity / 2**20,
        "hit_rate": hit,
        "ideal_ratio": 1.0 - hit,
        "computed_frac": stats.prefill_tokens / stats.prompt_tokens,
        "wall_on_s": wall_on,
        "wall_off_s": wall_off,
        "wall_ratio": wall_on / wall_off,
        "cpu_on_s": cpu_on,
        "cpu_off_s": cpu_off,
        "cpu_ratio": cpu_on / cpu_off,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--kda", choices=("chunked", "recurrent"), default="chunked")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="one JSON line per capacity")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    base = CheckOptions(seed=a.seed, requests=a.requests, kda=a.kda)
    if not a.json:
        print(
            f"{'capacity':>9} {'hit rate':>8} {'1-hit':>6} {'computed':>8} | "
            f"{'wall on':>7} {'wall off':>8} {'ratio':>6} | {'cpu on':>6} {'cpu off':>7} {'ratio':>6}"
        )
    for cap in CAPACITIES:
        r = measure(replace(base, capacity=cap), a.repeat)
        if a.json:
            print(json.dumps(r))
            continue
        print(
            f"{r['capacity_mib']:>7.2f}Mi {r['hit_rate']:>8.3f} {r['ideal_ratio']:>6.3f} "
            f"{r['computed_frac']:>8.3f} | {r['wall_on_s']:>7.3f} {r['wall_off_s']:>8.3f} "
            f"{r['wall_ratio']:>6.3f} | {r['cpu_on_s']:>6.3f} {r['cpu_off_s']:>7.3f} "
            f"{r['cpu_ratio']:>6.3f}"
        )


if __name__ == "__main__":
    main()
