"""Hit rate and FLOPs of hybridcache-adaptive against every other policy: the tables of
``docs/results.md`` ("Simulator / Adaptive policy").

    python benchmarks/sweep_adaptive.py mooncake [--trace PATH] [--json OUT]
    python benchmarks/sweep_adaptive.py generated [--kinds chat,agent,docs,mixed,agentic]
                                        [--seeds 0,1] [--requests 200] [--tenants 2]
                                        [--max-model-len N] [--shapes 1001,1002] [--json OUT]
                                        [--capacities 1GiB,2GiB,...] [--peers EARLIER_JSON]

For each trace and capacity: the adaptive policy's token hit rate and FLOPs saved, the
fixed ``hybridcache`` policy's, the best other policy (``kv-only`` excluded: it is the bound)
and the gap; a cell is *behind* when the adaptive policy is more than 0.002 below the best
other (issue 16's target). Prints a Markdown table.

``--tenants`` and ``--max-model-len`` hold the policy to settings it was not developed on
(every sweep before 2026-12-06 used two tenants): the generator's tenant count, and a
preset served past its own ``max_model_len`` (nemotron-h-8b serves 8,192 tokens, which
generated agent, docs and agentic requests pass; ``sweep`` refuses such a request before any
replay), as the preset ``NAME@N``.

``--peers FILE`` measures a change to our code against peers swept before: it replays only
``hybridcache`` and ``hybridcache-adaptive`` (what a change to the library moves; the fixed
policy is among the "best other" policies, so it is replayed too) and takes every other
policy's figures from FILE, an earlier run's ``--json``, whose rows carry every policy's
figures (``policies``) and the trace they were measured on (``facts``: model, request count,
prompt tokens). Every cell must be in FILE, on the same trace, or the run stops before
any replay, naming the cell. A full sweep with ``vllm-native-best`` takes 13-14 min per 150
cells on one core, this about 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from hybridcache.presets import get_preset, preset_names, register_preset
from hybridcache.sim.generate import generate
from hybridcache.sim.runner import sweep
from hybridcache.sim.shapes import Shape
from hybridcache.sim.sizes import parse_sizes
from hybridcache.sim.traces import Trace, read_trace
from hybridcache.sim.vllm_native import NativeUnavailable

#: ``vllm-native-best`` is vLLM's own manager at its strongest setting (prefix_match_unit 16,
#: retention None, its own chunk splits; needs vLLM installed): the peer at its strongest
#: belongs among the "best other" policies, beside ``vllm-align`` (its default's emulation).
POLICIES = ["hybridcache", "hybridcache-adaptive", "vllm-align", "vllm-native-best", "sglang", "sglang-extra",
            "marconi", "kv-only"]
#: Our policies: the ones ``--peers`` replays (a change to the library moves both).
OURS = ("hybridcache", "hybridcache-adaptive")
MOONCAKE = "/work/shared/traces/mooncake_synthetic_trace.jsonl"
TOLERANCE = 0.002


def figures(doc: dict, cap: int) -> dict[str, dict[str, float]]:
    """Every policy's figures in ``doc`` at capacity ``cap``: hit rate, FLOPs saved, seconds."""
    return {r["policy"]: {"hit": r["token_hit_rate"], "flops": r["prefill_flops_saved_frac"],
                          "seconds": r["wall_s"] + r["tune_s"]}
            for r in doc["results"] if r["capacity_bytes"] == cap}


def facts(trace: Trace, model: str) -> dict[str, object]:
    """What identifies the trace a row was measured on, for ``--peers`` to check."""
    return {"model": model, "requests": len(trace.requests),
            "prompt_tokens": sum(r.input_length for r in trace.requests)}


def cells(doc: dict, label: str, peers: dict | None = None, fact: dict | None = None) -> list[dict]:
    """One row per capacity of a sweep document; with ``peers`` (:func:`load_peers`), the
    policies not in ``doc`` are taken from the earlier run's row for the same cell."""
    out = []
    for cap in sorted({r["capacity_bytes"] for r in doc["results"]}):
        row = figures(doc, cap)
        if peers is not None:
            row = {**peers[(label, cap / 2**30)]["policies"], **row}
        others = {p: r for p, r in row.items() if p not in ("hybridcache-adaptive", "kv-only")}
        best = max(others, key=lambda p: others[p]["hit"])
        a, f = row["hybridcache-adaptive"], row["hybridcache"]
        out.append({
            "trace": label, "capacity_gib": cap / 2**30,
            "adaptive": a["hit"], "adaptive_flops": a["flops"],
            "fixed": f["hit"], "best_other": best,
            "best_other_rate": others[best]["hit"],
            "best_other_flops": others[best]["flops"],
            "kv_only": row["kv-only"]["hit"],
            "gap": a["hit"] - others[best]["hit"],
            "time_ratio": a["seconds"] / max(f["seconds"], 1e-9),
            "policies": row, "facts": fact,
        })
    return out


def load_peers(path: str) -> dict[tuple[str, float], dict]:
    """The rows of an earlier ``--json``, keyed by trace label and capacity (GiB)."""
    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--peers {path}: cannot read a sweep's JSON ({e})") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and {"trace", "capacity_gib", "policies", "facts"} <= r.keys()
                                             for r in rows):
        raise SystemExit(f"--peers {path}: not the rows of sweep_adaptive.py --json with every policy's "
                         "figures (a file written before 2026-12-08 has none)")
    return {(r["trace"], r["capacity_gib"]): r for r in rows}


def check_peers(peers: dict, label: str, fact: dict, capacities: list[int]) -> None:
    """Every capacity of ``label`` is in ``peers``, measured on the same trace; else stop."""
    for cap in capacities:
        row = peers.get((label, cap / 2**30))
        if row is None:
            raise SystemExit(f"--peers: no row for {label} at {cap / 2**30:g} GiB")
        if "kv-only" not in row["policies"]:
            raise SystemExit(f"--peers: {label} at {cap / 2**30:g} GiB has no kv-only figures (the bound every row reports)")
        if row["facts"] != fact:
            raise SystemExit(f"--peers: {label} at {cap / 2**30:g} GiB was measured on another trace "
                             f"({row['facts']} against {fact})")


def sweep_available(trace: Trace, model: str, capacities: list[int], policies: list[str] | None = None) -> dict:
    """``sweep`` over ``policies`` (:data:`POLICIES`), leaving out vLLM's own manager where it
    cannot model the trace (said on stderr): it replays token traces only, and at its
    strongest setting it needs a hash unit that divides its state block. ``sweep`` checks
    that before any replay."""
    policies = POLICIES if policies is None else policies
    try:
        return sweep(trace, model, policies, capacities, progress=False)
    except NativeUnavailable as e:
        native = [p for p in policies if p.startswith("vllm-native")]
        print(f"{trace.path}: {', '.join(native)} left out ({e})", file=sys.stderr)
        return sweep(trace, model, [p for p in policies if p not in native], capacities, progress=False)


def model_with_max_len(model: str, max_model_len: int | None) -> str:
    """``model``, or ``model@N``: the preset with ``max_model_len`` N, registered once."""
    if max_model_len is None:
        return model
    if max_model_len < 1:
        raise SystemExit(f"--max-model-len must be positive, got {max_model_len}")
    name = f"{model}@{max_model_len}"
    if name not in preset_names():
        spec = dataclasses.replace(get_preset(model), max_model_len=max_model_len)
        register_preset(name, lambda: spec)
    return name


def markdown(rows: list[dict]) -> str:
    lines = ["| trace | GiB | adaptive hit / FLOPs | fixed `hybridcache` | best other (hit / FLOPs) | kv-only "
             "| adaptive - best other | adaptive / fixed replay time |",
             "|---|---:|---|---:|---|---:|---:|---:|"]
    for r in rows:
        mark = " **behind**" if r["gap"] < -TOLERANCE else ""
        lines.append(
            f"| {r['trace']} | {r['capacity_gib']:.0f} | {r['adaptive']:.3f} / {r['adaptive_flops']:.3f} "
            f"| {r['fixed']:.3f} | {r['best_other']} {r['best_other_rate']:.3f} / {r['best_other_flops']:.3f} "
            f"| {r['kv_only']:.3f} | {r['gap']:+.3f}{mark} | {r['time_ratio']:.1f}x |")
    behind = sum(r["gap"] < -TOLERANCE for r in rows)
    lines.append(f"\n{behind} of {len(rows)} cells behind the best other policy by more than {TOLERANCE}.")
    return "\n".join(lines)


def capacity_list(text: str) -> list[int]:
    """``--capacities``: :func:`~hybridcache.sim.sizes.parse_sizes` (``hybridcache-sim``'s
    ``--capacity``), its error as argparse's."""
    try:
        return parse_sizes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def planned_traces(args: argparse.Namespace) -> Iterator[tuple[str, Trace, list[int]]]:
    """The run's traces, each with its row label and capacities, in the order swept."""
    if args.what == "mooncake":
        yield "mooncake", read_trace(args.trace), [g << 30 for g in (8, 32, 128, 256)]
        return
    shapes = [("", None)] if args.shapes is None else [(f"~s{s}", Shape.draw(int(s))) for s in args.shapes.split(",")]
    for suffix, shape in shapes:
        for kind in args.kinds.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                reqs = generate(kind, args.requests, seed=seed, tenants=args.tenants, shape=shape)
                label = f"{kind}:{seed}{suffix}"
                yield label, Trace(f"<{label}>", "tokens", reqs), args.capacities


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("mooncake", "generated"))
    p.add_argument("--trace", default=MOONCAKE)
    p.add_argument("--model", default="kimi-linear-48b")
    p.add_argument("--kinds", default="chat,agent,docs,mixed,agentic")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--tenants", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--shapes", default=None,
                   help="comma-separated shape seeds: each kind and seed also generated at the shape "
                        "drawn from each (hybridcache.sim.shapes: held-out lengths, counts and rates); "
                        "default: the kinds as built only")
    p.add_argument("--capacities", type=capacity_list, default=[g << 30 for g in (1, 2, 4, 8, 16)],
                   help="sizes, comma-separated, for generated traces (default 1GiB,2GiB,4GiB,8GiB,16GiB)")
    p.add_argument("--json", default=None)
    p.add_argument("--peers", default=None,
                   help="an earlier run's --json: replay only our two policies, take the others from it")
    args = p.parse_args(argv)
    model = model_with_max_len(args.model, args.max_model_len)
    traces = [(label, trace, caps, facts(trace, model)) for label, trace, caps in planned_traces(args)]
    peers = None
    if args.peers is not None:
        peers = load_peers(args.peers)
        for label, _, caps, fact in traces:  # every cell checked before the first replay
            check_peers(peers, label, fact, caps)
    rows: list[dict] = []
    for label, trace, caps, fact in traces:
        doc = sweep_available(trace, model, caps, None if peers is None else list(OURS))
        rows += cells(doc, label, peers, fact)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(markdown(rows))


if __name__ == "__main__":
    main()
