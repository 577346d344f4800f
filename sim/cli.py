"""``hybridcache-sim``: replay traces through the cache manager and compare policies.

Subcommands: ``demo`` (built-in workload, every policy, table + JSON + PNG), ``run`` (your
trace), ``generate`` (write a synthetic token trace) and ``presets`` (model presets with
their KV and snapshot sizes). Errors print one line naming what is wrong and exit with 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from hybridcache.errors import HybridCacheError
from hybridcache.presets import get_preset, preset_names
from hybridcache.sim.generate import KINDS, generate
from hybridcache.sim.policies import not_applicable, parse_policies
from hybridcache.sim.report import format_summary, plot, write_json
from hybridcache.sim.runner import sweep
from hybridcache.sim.sizes import format_bytes, parse_sizes
from hybridcache.sim.traces import FORMATS, Trace, read_trace, write_token_trace
from hybridcache.sim.vllm_native import unavailable_reason

DEMO_MODEL = "kimi-linear-48b"
DEMO_CAPACITIES = "1GiB,2GiB,4GiB,8GiB,16GiB"
DEMO_REQUESTS = 120


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridcache-sim", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="built-in mixed workload, every policy, capacity sweep")
    d.add_argument("--out", default=".", help="folder for hybridcache-demo.json/.png")
    d.add_argument("--requests", type=int, default=DEMO_REQUESTS, help="workload size")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--capacity", default=DEMO_CAPACITIES, help="comma-separated sizes")
    d.add_argument("--policy", default="all", help="comma-separated policies or 'all'")
    d.add_argument("--model", default=DEMO_MODEL)
    d.add_argument("--no-progress", action="store_true")

    r = sub.add_parser("run", help="replay a trace file")
    r.add_argument("--trace", required=True)
    r.add_argument("--trace-format", default="auto", choices=FORMATS)
    r.add_argument("--model", required=True, help="a preset name (see 'presets')")
    r.add_argument("--capacity", required=True, help="SIZE[,SIZE...], e.g. 64GiB,512MiB")
    r.add_argument("--policy", default="all", help="NAME[,NAME...] or 'all'")
    r.add_argument("--hash-unit", type=int, default=None,
                   help="tokens per hash unit (default: the trace's block, 16 for tokens)")
    r.add_argument("--json", default=None, help="write the results here")
    r.add_argument("--plot", default=None, help="write a PNG plot here")
    r.add_argument("--skip-bad-lines", action="store_true",
                   help="skip malformed lines (and report how many) instead of failing")
    r.add_argument("--no-progress", action="store_true")

    g = sub.add_parser("generate", help="write a synthetic token-level trace")
    g.add_argument("--kind", required=True, choices=KINDS)
    g.add_argument("--requests", type=int, required=True)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tenants", type=int, default=2)
    g.add_argument("-o", "--output", required=True)

    sub.add_parser("presets", help="list model presets")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        return {"demo": _demo, "run": _run, "generate": _generate, "presets": _presets}[args.cmd](args)
    except (HybridCacheError, ValueError, OSError) as e:
        print(f"hybridcache-sim: error: {e}", file=sys.stderr)
        return 2


def _sweep_and_report(trace: Trace, args: argparse.Namespace, hash_unit: int | None) -> dict:
    policies = parse_policies(args.policy)
    caps = parse_sizes(args.capacity)
    spec = get_preset(args.model)  # fail on a bad name before replaying anything
    if args.policy.strip() == "all":
        for name in list(policies):
            reason = not_applicable(name, spec)
            if reason is None and name.startswith("vllm-native"):
                reason = unavailable_reason(trace)
            if reason:
                policies.remove(name)
                print(f"note: skipping {reason}", file=sys.stderr)
    doc = sweep(trace, args.model, policies, caps, hash_unit=hash_unit, progress=not args.no_progress)
    print(format_summary(doc))
    return doc


def _demo(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reqs = generate("mixed", args.requests, seed=args.seed, tenants=2)
    trace = Trace(f"<demo: mixed, {args.requests} requests, seed {args.seed}>", "tokens", reqs)
    doc = _sweep_and_report(trace, args, None)
    write_json(doc, out / "hybridcache-demo.json")
    plot(doc, out / "hybridcache-demo.png", title=f"{args.model}: synthetic mixed workload")
    print(f"\nwrote {out / 'hybridcache-demo.json'} and {out / 'hybridcache-demo.png'} "
          f"in {time.perf_counter() - t0:.1f} s")
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.hash_unit is not None and args.hash_unit <= 0:
        raise ValueError(f"--hash-unit must be positive, got {args.hash_unit}")
    trace = read_trace(args.trace, args.trace_format, skip_bad_lines=args.skip_bad_lines)
    if trace.skipped:
        print(f"skipped {trace.skipped} malformed line(s) in {args.trace}", file=sys.stderr)
    doc = _sweep_and_report(trace, args, args.hash_unit)
    if args.json:
        write_json(doc, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        plot(doc, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    reqs = generate(args.kind, args.requests, seed=args.seed, tenants=args.tenants)
    write_token_trace(args.output, reqs)
    toks = sum(r.input_length for r in reqs)
    print(f"wrote {len(reqs)} {args.kind} requests ({toks:,} prompt tokens, "
          f"{args.tenants} tenants) to {args.output}")
    return 0


def _presets(args: argparse.Namespace) -> int:
    rows = [get_preset(n).describe() for n in preset_names()]
    w = max(len(str(r["name"])) for r in rows)
    print(f"{'preset':<{w}}  {'KV B/token':>10}  {'snapshot':>10}  {'tokens/snapshot':>15}  layers (attn+state)")
    for r in rows:
        tps = r["tokens_per_snapshot"]
        print(f"{r['name']:<{w}}  {r['kv_bytes_per_token']:>10,}  {format_bytes(int(r['snapshot_bytes'])):>10}  "
              f"{(f'{tps:,.0f}' if tps else '-'):>15}  {r['attention_layers']}+{r['state_layers']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
