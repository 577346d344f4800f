"""How much one arena block of capacity moves each policy's hit rate: the noise floor under
``sweep_adaptive.py``'s per-cell verdicts.

    python benchmarks/capacity_jitter.py [--kinds chat,agent,docs,mixed,agentic] [--seeds 5,6]
                                         [--capacities 1,2,4] [--blocks 1] [--json OUT]

Every policy of ``sweep_adaptive.py`` (vLLM's own manager at its strongest setting
included) replays each generated trace at ``C - k``, ``C`` and ``C + k`` arena blocks of
the model (``k = --blocks``). One block is a state slot: 41 MiB for Kimi Linear 48B, 4 % of
1 GiB. Why: at 1-2 GiB a cache holds 24-49 states, and which entries a step keeps decides
what later requests find, so a hit rate there is partly the history of a few evictions.
If one block more or less moves a fixed policy by more than the 0.002 tolerance, a cell's
"behind" verdict at that capacity says as much about that history as about the policy.

Prints, per capacity and policy, the median and 90th percentile of the swing
``|hit(C + k) - hit(C - k)|`` and how many cells *lose* more than the tolerance when a
block is added (a policy whose hit rate falls with more memory is following its history);
then, for ``hybridcache-adaptive``, how many cells are behind the best other policy at
each of the three capacities, in how many the verdict at ``C`` differs from one at
``C - k`` or ``C + k``, and how many are behind on each policy's mean over the three.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.presets import get_preset
from hybridcache.sim.generate import generate
from hybridcache.sim.traces import Trace

try:
    from benchmarks.sweep_adaptive import TOLERANCE, sweep_available
except ImportError:  # run as a script (the documented command): benchmarks/ is on sys.path
    from sweep_adaptive import TOLERANCE, sweep_available

ADAPTIVE = "hybridcache-adaptive"
LEFT_OUT = ("kv-only",)  # the bound, not a peer


def block_bytes(model: str, capacity: int) -> int:
    """Bytes of one arena block of ``model``'s layout at ``capacity``."""
    return HybridCacheManager(get_preset(model), capacity, CacheConfig(hash_unit=16)).layout.block_bytes


def one_cell(trace: Trace, label: str, model: str, gib: int, k: int) -> dict:
    """Hit rates of every policy at ``gib`` GiB and ``k`` blocks either side."""
    c = gib << 30
    b = block_bytes(model, c)
    caps = [c - k * b, c, c + k * b]
    doc = sweep_available(trace, model, caps)
    rates: dict[str, list[float]] = {}
    for r in doc["results"]:
        if r["policy"] not in LEFT_OUT:
            rates.setdefault(r["policy"], [0.0, 0.0, 0.0])[caps.index(r["capacity_bytes"])] = r["token_hit_rate"]
    return {"cell": f"{label}@{gib}", "gib": gib, "block_mib": b / 2**20, "rates": rates}


def behind(rates: dict[str, list[float]], i: int | None) -> bool:
    """Whether the adaptive policy is behind the best other at capacity index ``i``
    (``None``: on each policy's mean over the three capacities, a verdict the history of
    one capacity moves less)."""
    def at(v: list[float]) -> float:
        return sum(v) / len(v) if i is None else v[i]
    best = max(at(v) for p, v in rates.items() if p != ADAPTIVE)
    return at(rates[ADAPTIVE]) < best - TOLERANCE


def summary(rows: list[dict]) -> str:
    """The Markdown tables described in the module docstring."""
    lines = ["| GiB | policy | cells | median swing | p90 swing | cells losing > tolerance with a block more |",
             "|---:|---|---:|---:|---:|---:|"]
    verdict = ["", "| GiB | cells | behind at C - k / C / C + k | verdict at C differs from C - k or C + k "
               "| behind on the three capacities' mean |", "|---:|---:|---|---:|---:|"]
    for gib in sorted({r["gib"] for r in rows}):
        at = [r for r in rows if r["gib"] == gib]
        for policy in at[0]["rates"]:
            v = [r["rates"][policy] for r in at if policy in r["rates"]]
            swings = sorted(abs(x[2] - x[0]) for x in v)
            losing = sum((x[1] - x[2] > TOLERANCE) or (x[0] - x[1] > TOLERANCE) for x in v)
            p90 = swings[min(len(swings) - 1, int(0.9 * len(swings)))]
            lines.append(f"| {gib} | {policy} | {len(v)} | {statistics.median(swings):.4f} | {p90:.4f} | {losing} |")
        if all(ADAPTIVE in r["rates"] for r in at):
            counts = [sum(behind(r["rates"], i) for r in at) for i in range(3)]
            flips = sum(behind(r["rates"], 1) != behind(r["rates"], 0) or behind(r["rates"], 1) != behind(r["rates"], 2)
                        for r in at)
            mean = sum(behind(r["rates"], None) for r in at)
            verdict.append(f"| {gib} | {len(at)} | {' / '.join(map(str, counts))} | {flips} | {mean} |")
    return "\n".join(lines + verdict)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="kimi-linear-48b")
    p.add_argument("--kinds", default="chat,agent,docs,mixed,agentic")
    p.add_argument("--seeds", default="5,6")
    p.add_argument("--capacities", default="1,2,4", help="GiB, comma-separated")
    p.add_argument("--blocks", type=int, default=1, help="arena blocks either side of each capacity")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.blocks < 1:
        p.error("--blocks must be at least 1")
    rows = []
    for kind in args.kinds.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            label = f"{kind}:{seed}"
            t = Trace(f"<{label}>", "tokens", generate(kind, args.requests, seed=seed, tenants=2))
            for gib in (int(g) for g in args.capacities.split(",")):
                rows.append(one_cell(t, label, args.model, gib, args.blocks))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(summary(rows))


if __name__ == "__main__":
    main()
