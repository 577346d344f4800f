"""Long traces: the adaptive policy against each of its candidates replayed as a fixed policy.

    python benchmarks/long_cells.py [--requests 1000] [--kinds agentic,agent,mixed,docs,chat]
                                    [--seeds 0,1] [--capacities 2,4,8] [--model kimi-linear-48b]
                                    [--json OUT]

``sweep_adaptive.py`` measures 200-request traces against the peers; there the shadows are
still exploring when the trace ends. On a long trace the exploration ends, the overhead
budget's bucket pauses the shadows, and the policy lives with what it decided: issue 16's
convergence target (within 0.005 of the best fixed candidate) is about that regime. Each
cell runs through ``bench_manager.serve_requests`` (the loop of the overhead figures):
every candidate of ``candidate_settings`` as a fixed manager, then
``CacheConfig(admission="adaptive")``. Per cell: the adaptive policy's token hit rate and
prefill FLOPs saved, its starting candidate's, the best candidate's, the gap, the requests
fed to the shadows (and how many after the exploration ended, at which request, with the
overhead bucket's credit at the end over the live work: negative is the exploration's
work not yet paid back, during which the shadows stay paused), the shadows' work over the live
work (units handled) and the switches;
at the end, the cells behind (gap below -0.002) and the means. The peers at these lengths
come from ``sweep_adaptive.py generated --requests N`` (slower: vLLM's scheduler).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_manager import serve_requests  # noqa: E402
from sweep_adaptive import TOLERANCE  # noqa: E402 - the sweep's "behind", here too

from hybridcache.adaptive import candidate_settings, set_weighting  # noqa: E402
from hybridcache.manager import CacheConfig, HybridCacheManager  # noqa: E402
from hybridcache.presets import get_preset  # noqa: E402
from hybridcache.sim.generate import generate  # noqa: E402


def rates(manager: HybridCacheManager, reqs: list) -> tuple[float, float]:
    """Token hit rate and prefill FLOPs saved over every request of ``reqs`` served through
    ``manager`` (the FLOPs from the manager's own counters, which count the requests the
    loop served). A request the cache cannot hold counts as served without a hit, as in the
    simulator (``hybridcache.sim.replay``): before 2026-12-06 it was left out, and a
    falcon-h1-7b agentic cell at 2 GiB read 0.849 over the 349 of 1,000 requests it held
    (0.051 over all of them)."""
    refused: list[int] = []
    _, hit, _ = serve_requests(manager, reqs, refused)
    prompt = sum(r.input_length for r in reqs)
    flops = manager.metrics.prefill_flops + sum(
        manager.spec.flops.prefill_flops(0, reqs[i].input_length) for i in refused)
    return hit / max(1, prompt), manager.metrics.prefill_flops_saved / flops if flops else 0.0


def cell(model: str, kind: str, seed: int, gib: int, n: int) -> dict:
    """One trace and capacity: every candidate fixed, then the adaptive policy."""
    spec, cap = get_preset(model), gib << 30
    reqs = generate(kind, n, seed=seed, tenants=2)
    candidates = candidate_settings(spec, 16)
    fixed: dict[str, tuple[float, float]] = {}
    for c in candidates:
        m = HybridCacheManager(spec, cap, CacheConfig(hash_unit=16, admission=c.admission, min_seen=c.min_seen))
        set_weighting(m, c.weighting)
        fixed[c.name] = rates(m, reqs)
    m = HybridCacheManager(spec, cap, CacheConfig(hash_unit=16, admission="adaptive"))
    hit, flops = rates(m, reqs)
    best = max(fixed, key=lambda name: fixed[name][0])
    start = candidates[0].name
    stats = m.adaptive_stats()
    return {
        "trace": f"{kind}:{seed}", "capacity_gib": gib, "adaptive": hit, "adaptive_flops": flops,
        "start": fixed[start][0], "best": best, "best_rate": fixed[best][0], "best_flops": fixed[best][1],
        "gap": hit - fixed[best][0], "fed": m.sampled,
        "shadow_work": m.shadow_units / max(1, m.live_units), "switches": m.switches[1:],
        "explored_at": stats["explored_at"], "fed_after": stats["fed_since_explored"],
        "credit_over_live": stats["credit"] / max(1, m.live_units),
        "fixed": {name: r[0] for name, r in fixed.items()},
    }


def line(r: dict) -> str:
    mark = " behind" if r["gap"] < -TOLERANCE else ""
    explored = ("still exploring" if r["explored_at"] is None
                else f"{r['fed_after']} after the exploration, which ended at request {r['explored_at']}")
    return (f"{r['trace']}@{r['capacity_gib']} GiB: adaptive {r['adaptive']:.4f} / {r['adaptive_flops']:.4f}, "
            f"start {r['start']:.4f}, best {r['best']} {r['best_rate']:.4f} / {r['best_flops']:.4f}, "
            f"gap {r['gap']:+.4f}{mark}; fed {r['fed']} ({explored}; "
            f"bucket {r['credit_over_live']:+.2f}x the live work), shadow work {r['shadow_work']:.2f}x, "
            f"switches {r['switches']}")


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--kinds", default="agentic,agent,mixed,docs,chat")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--capacities", default="2,4,8", help="GiB, comma-separated")
    p.add_argument("--model", default="kimi-linear-48b")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = []
    for kind in args.kinds.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            for gib in (int(g) for g in args.capacities.split(",")):
                rows.append(cell(args.model, kind, seed, gib, args.requests))
                print(line(rows[-1]), flush=True)
    behind = sum(r["gap"] < -TOLERANCE for r in rows)
    mean = sum(r["adaptive"] for r in rows) / len(rows)
    mean_best = sum(r["best_rate"] for r in rows) / len(rows)
    print(f"{behind} of {len(rows)} cells behind the best fixed candidate by more than {TOLERANCE}; "
          f"mean hit {mean:.4f} (best candidate per cell {mean_best:.4f})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
