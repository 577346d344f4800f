"""The adaptive policy after a change of workload, with and without its change detector:
the table of ``docs/results.md`` ("A change of workload").

    python benchmarks/sweep_shift.py [--seeds 3,4] [--gib 2] [--first 150] [--second 300]
                                     [--kinds chat,agent,docs,mixed,agentic]

For every ordered pair of generated kinds: ``--first`` requests of one kind, then
``--second`` of the other under other tenants (a new workload, nothing to reuse from the
old one); the token hit rate over the requests after the change, with the detection off
(``hybridcache.adaptive.SHIFT_DETECTION``) and on, where it signalled, and the switches.
Model `kimi-linear-48b`, as in the other sweeps. Deterministic (seeded traces, accounting-only
managers).
"""

from __future__ import annotations

import argparse
import statistics

import hybridcache.adaptive as adaptive
from hybridcache.config import CacheConfig
from hybridcache.presets import get_preset
from hybridcache.sim.generate import KINDS, generate_change
from hybridcache.sim.replay import Replay
from hybridcache.sim.traces import Trace


def after_change(trace: Trace, at: int, capacity: int, detect: bool) -> tuple[float, Replay]:
    """Token hit rate of the adaptive policy over the requests from ``at`` on."""
    adaptive.SHIFT_DETECTION = detect
    try:
        run = Replay(trace, get_preset("kimi-linear-48b"), capacity,
                     CacheConfig(hash_unit=16, admission="adaptive"))
        run.advance(at)
        hit, prompt = run.hit_tokens, sum(run.tally.prompt.values())
        run.advance()
    finally:
        adaptive.SHIFT_DETECTION = True
    return (run.hit_tokens - hit) / (sum(run.tally.prompt.values()) - prompt), run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="3,4")
    ap.add_argument("--gib", type=int, default=2)
    ap.add_argument("--first", type=int, default=150)
    ap.add_argument("--second", type=int, default=300)
    ap.add_argument("--kinds", default=",".join(KINDS))
    args = ap.parse_args()
    cap = args.gib << 30
    kinds = args.kinds.split(",")
    print("| seed | first | second | off | on | detected at | switches (on) |")
    print("|---|---|---|---:|---:|---|---|")
    deltas = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for first in kinds:
            for second in kinds:
                if first == second:
                    continue
                reqs = generate_change(first, second, (args.first, args.second), seed=seed)
                trace = Trace(f"<{first}->{second}:{seed}>", "tokens", reqs)
                off, _ = after_change(trace, args.first, cap, detect=False)
                on, run = after_change(trace, args.first, cap, detect=True)
                deltas.append(on - off)
                print(f"| {seed} | {first} | {second} | {off:.4f} | {on:.4f} | {run.mgr.shifts} | "
                      f"{run.mgr.switches[1:]} |", flush=True)
    print(f"\nmean change {statistics.mean(deltas):+.4f}; up {sum(d > 0.001 for d in deltas)}, "
          f"down {sum(d < -0.001 for d in deltas)}, of {len(deltas)}")


if __name__ == "__main__":
    main()
