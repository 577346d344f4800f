"""hybridcache-sim: replay traces through the cache manager and compare policies.

Subcommands: demo (built-in workload, every policy, table + JSON + PNG), run (your trace),
generate (write a synthetic token trace) and presets (model presets with their KV and
snapshot sizes). Every input is checked before a replay starts; errors print one line naming
what is wrong and exit with 2.
"""

from __future__ import annotations

import argparse
import csv
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

import hybridcache
from hybridcache.errors import HybridCacheError
from hybridcache.presets import get_preset, preset_names
from hybridcache.sim.cli_inputs import (
    ALL,
    PLOT_SUFFIXES,
    VLLM_HINT,
    check_out_dir,
    check_output,
    decimal_notes,
    resolve_model,
    select_policies,
)
from hybridcache.sim.generate import KINDS, generate
from hybridcache.sim.policies import POLICIES
from hybridcache.sim.report import format_summary, plot, write_json
from hybridcache.sim.runner import sweep
from hybridcache.sim.shapes import Shape
from hybridcache.sim.sizes import format_bytes, parse_sizes
from hybridcache.sim.traces import FORMATS, MOONCAKE_BLOCK, Trace, read_trace, write_token_trace

DEMO_MODEL = "kimi-linear-48b"
DEMO_CAPACITIES = "1GiB,2GiB,4GiB,8GiB,16GiB"
DEMO_REQUESTS = 120

SIZES_HELP = ("sizes: GiB, MiB, KiB, TiB (and G, M, K, T) are binary, powers of 1024; GB, MB, KB, "
              "TB are decimal, powers of 1000, as disk makers count (8GB = 8,000,000,000 bytes = "
              "7.45GiB, and the tool prints a note when you use them); a plain number is bytes")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """The epilog's lists kept as written; an option's default shown when it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
            text += " (default: %(default)s)"
        return text


def _epilog() -> str:
    paragraphs = [
        f"policies: {', '.join(POLICIES)}. all = {', '.join(ALL)}; all-native adds vllm-native and vllm-native-best "
        f"(vLLM's own KVCacheManager, which needs the vllm extra: {VLLM_HINT.split(': ', 1)[1]})",
        f"model presets: {', '.join(preset_names())}; or a Hugging Face config.json (or the "
        "folder holding it)",
        "trace formats, one JSON object per line (.gz files are read too): mooncake = timestamp, "
        "input_length, output_length, hash_ids (block ids); tokens = timestamp, session_id, "
        "input_ids, output_ids or output_length",
        f"generator kinds: {', '.join(KINDS)}",
        SIZES_HELP,
        "docs: docs/simulator.md",
    ]
    return "\n".join(textwrap.fill(x, 88, subsequent_indent="  ") for x in paragraphs)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridcache-sim", description=__doc__, epilog=_epilog(),
                                formatter_class=_Formatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {hybridcache.__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{demo,run,generate,presets}")
    kw = dict(formatter_class=_Formatter, epilog=_epilog())

    d = sub.add_parser("demo", help="built-in mixed workload, every policy, capacity sweep", **kw)
    d.add_argument("--out", default=".", help="folder for hybridcache-demo.json and .png")
    d.add_argument("--requests", type=int, default=DEMO_REQUESTS, help="workload size")
    d.add_argument("--seed", type=int, default=0, help="workload seed")
    d.add_argument("--capacity", default=DEMO_CAPACITIES, help="comma-separated sizes")
    d.add_argument("--policy", default="all", help="comma-separated policies, all or all-native")
    d.add_argument("--model", default=DEMO_MODEL, help="preset name or config.json path")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")

    r = sub.add_parser("run", help="replay a trace file", **kw)
    r.add_argument("--trace", required=True, help="JSON Lines trace (.jsonl or .jsonl.gz)")
    r.add_argument("--trace-format", default="auto", choices=FORMATS, help="auto reads the first line")
    r.add_argument("--model", required=True, help="preset name or config.json path")
    r.add_argument("--capacity", required=True, help="SIZE[,SIZE...], e.g. 64GiB,512MiB")
    r.add_argument("--policy", default="all", help="NAME[,NAME...], all or all-native")
    r.add_argument("--hash-unit", type=int, default=None,
                   help="tokens per hash unit (default: the trace's block, 16 for token traces)")
    r.add_argument("--block-tokens", type=int, default=None,
                   help=f"tokens per hash_ids block of a block trace (default: {MOONCAKE_BLOCK}, "
                        "Mooncake's)")
    r.add_argument("--json", default=None, help="write the results here")
    r.add_argument("--csv", default=None, help="write one row per policy and capacity here")
    r.add_argument("--plot", default=None, help=f"write a plot here ({', '.join(PLOT_SUFFIXES)})")
    r.add_argument("--skip-bad-lines", action="store_true",
                   help="skip malformed lines (and report how many) instead of failing")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")

    g = sub.add_parser("generate", help="write a synthetic token-level trace", **kw)
    g.add_argument("--kind", required=True, choices=KINDS, help="workload kind")
    g.add_argument("--requests", type=int, required=True, help="number of requests")
    g.add_argument("--seed", type=int, default=0, help="generator seed")
    g.add_argument("--tenants", type=int, default=2, help="number of tenants")
    g.add_argument("--shape", type=int, default=None, metavar="SEED",
                   help="scale the kind's lengths, counts and rates by a shape drawn from SEED "
                        "(held-out workloads; default: the kind as built)")
    g.add_argument("-o", "--output", required=True, help="trace file to write")

    sub.add_parser("presets", help="list model presets", **kw)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        return {"demo": _demo, "run": _run, "generate": _generate, "presets": _presets}[args.cmd](args)
    except (HybridCacheError, ValueError, OSError) as e:
        print(f"hybridcache-sim: error: {e}", file=sys.stderr)
        return 2


def _note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr)


def _plan(args: argparse.Namespace, spec_text: str, token_trace: bool) -> tuple[str, list[str], list[int]]:
    """Model name, policies and capacities, all checked (notes printed) before any replay."""
    model, spec = resolve_model(spec_text)
    policies, notes = select_policies(args.policy, spec, token_trace)
    caps = parse_sizes(args.capacity)
    for n in notes + decimal_notes(args.capacity):
        _note(n)
    return model, policies, caps


def _record(doc: dict, args: argparse.Namespace, policies: list[str], caps: list[int]) -> dict:
    """The JSON document with the version and every setting that produced it."""
    settings = {k: v for k, v in vars(args).items() if k not in ("no_progress",)}
    settings.update(policies=policies, capacities_bytes=caps)
    return {"hybridcache_version": hybridcache.__version__, "settings": settings, **doc}


def _demo(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    out = check_out_dir(args.out)
    model, policies, caps = _plan(args, args.model, token_trace=True)
    reqs = generate("mixed", args.requests, seed=args.seed, tenants=2)
    trace = Trace(f"<demo: mixed, {args.requests} requests, seed {args.seed}>", "tokens", reqs)
    doc = sweep(trace, model, policies, caps, progress=not args.no_progress)
    print(format_summary(doc))
    write_json(_record(doc, args, policies, caps), out / "hybridcache-demo.json")
    plot(doc, out / "hybridcache-demo.png", title=f"{model}: synthetic mixed workload")
    print(f"\nwrote {out / 'hybridcache-demo.json'} and {out / 'hybridcache-demo.png'} "
          f"in {time.perf_counter() - t0:.1f} s")
    return 0


def _run(args: argparse.Namespace) -> int:
    for flag in ("hash_unit", "block_tokens"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    outputs = {"json": check_output(args.json, "--json") if args.json else None,
               "csv": check_output(args.csv, "--csv") if args.csv else None,
               "plot": check_output(args.plot, "--plot", PLOT_SUFFIXES) if args.plot else None}
    model, spec = resolve_model(args.model)
    trace = read_trace(args.trace, args.trace_format, skip_bad_lines=args.skip_bad_lines,
                       block_tokens=args.block_tokens, max_tokens=spec.max_model_len)
    if trace.skipped:
        print(f"skipped {trace.skipped} malformed line(s) in {args.trace}", file=sys.stderr)
    model, policies, caps = _plan(args, model, token_trace=trace.block_tokens == 0)
    doc = sweep(trace, model, policies, caps, hash_unit=args.hash_unit, progress=not args.no_progress)
    print(format_summary(doc))
    if outputs["json"]:
        write_json(_record(doc, args, policies, caps), outputs["json"])
        print(f"wrote {outputs['json']}")
    if outputs["csv"]:
        _write_csv(doc, outputs["csv"])
        print(f"wrote {outputs['csv']}")
    if outputs["plot"]:
        plot(doc, outputs["plot"])
        print(f"wrote {outputs['plot']}")
    return 0


CSV_FIELDS = ("policy", "capacity_bytes", "token_hit_rate", "request_hit_rate",
              "prefill_flops_saved_frac", "kv_hit_state_miss_tokens", "snapshots_stored",
              "evictions", "hit_tokens", "prompt_tokens", "requests", "rejected_requests", "wall_s")


def _write_csv(doc: dict, path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(doc["results"])


def _generate(args: argparse.Namespace) -> int:
    out = check_output(args.output, "--output")
    shape = None if args.shape is None else Shape.draw(args.shape)
    reqs = generate(args.kind, args.requests, seed=args.seed, tenants=args.tenants, shape=shape)
    write_token_trace(out, reqs)
    toks = sum(r.input_length for r in reqs)
    shaped = "" if shape is None else f", shape {shape.label()}"
    print(f"wrote {len(reqs)} {args.kind} requests ({toks:,} prompt tokens, "
          f"{args.tenants} tenants{shaped}) to {out}")
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
