"""The adaptive policy's added manager work, counted in instructions (no clock noise).

    python benchmarks/count_instructions.py [--requests 2000] [--kind chat] [--capacity 64GiB]
                                            [--model kimi-linear-48b] [--jobs 2]
                                            [--settings fixed,adaptive]

``bench_adaptive.py`` times the request loop of ``bench_manager.py``; on a shared machine
its per-round ratios spread widely (adaptive / fixed: an interquartile range of 1.02-1.30
over 15 alternating rounds, 2026-12-04), more than most changes to the adaptive machinery
move them. This script runs the same loop
(``serve_requests``) under valgrind's callgrind, which counts the instructions the process
executes: the count repeats to within 0.5 % (``PYTHONHASHSEED=0``), whatever else runs.
Instructions are not time (a cache miss costs more than an add), but the ratio of two counts
of the same Python code tracks the ratio of its CPU times (1.198x here against
``bench_adaptive.py --repeat 5``'s 1.18x in CPU time on the same commit).

Each setting runs twice in a fresh interpreter: building its manager and serving the
requests, and building it only; the difference is the loop's count (imports, the generated
trace and the constructor cancel). Settings, each over the library's default
(``CacheConfig(hash_unit=16)``, ``fixed``):

- ``start``: the adaptive policy's starting candidate as a fixed setting;
- ``spares``: a fixed manager running the adaptive manager's live admission, taken from a
  built one: the starting candidate's rules plus the live cache's spares, checkpoints in
  free room (``spare-interval``) and a sibling's resume point (``spare-suffix-start``, which
  tracks where matches stop on every request; it was counted in the sampling step until
  2026-12-06, about a third of that step's figure);
- ``no-replays``: the adaptive manager with its shadows never fed (the sampling step, the
  chain keys, the change detector, the spares): the probe process replaces
  ``AdaptiveManager._observe`` with a no-op, a measurement switch the library does not have;
- ``adaptive``: ``CacheConfig(admission="adaptive")``.

So the adaptive / fixed ratio splits into the start setting, the spares, the sampling step
(no-replays - spares) and the shadow replays (adaptive - no-replays). Needs ``valgrind`` on
the PATH; each run takes 20-60 s (callgrind runs Python about 50x slower).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

SETTINGS = ("fixed", "start", "spares", "no-replays", "adaptive")


def probe(setting: str, mode: str, args: argparse.Namespace) -> None:
    """One measured run (in the child process): build the setting's manager, and in mode
    ``serve`` serve the requests through it. A first manager is built and dropped before,
    so that lazy imports and first calls fall outside the difference of the two modes."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_manager import serve_requests

    import hybridcache.adaptive as adaptive_module
    from hybridcache.adaptive import candidate_settings
    from hybridcache.manager import CacheConfig, HybridCacheManager
    from hybridcache.presets import get_preset
    from hybridcache.sim.generate import generate
    from hybridcache.sim.sizes import parse_size

    spec, cap = get_preset(args.model), parse_size(args.capacity)
    reqs = generate(args.kind, args.requests, seed=args.seed, tenants=args.tenants)
    first = candidate_settings(spec, 16)[0]
    config = {
        "fixed": CacheConfig(hash_unit=16),
        "start": CacheConfig(hash_unit=16, admission=first.admission, min_seen=first.min_seen),
        "spares": CacheConfig(hash_unit=16, admission=first.admission, min_seen=first.min_seen),
        "no-replays": CacheConfig(hash_unit=16, admission="adaptive"),
        "adaptive": CacheConfig(hash_unit=16, admission="adaptive"),
    }[setting]
    if setting == "no-replays":
        adaptive_module.AdaptiveManager._observe = lambda self, *a: None  # type: ignore[method-assign]
    HybridCacheManager(spec, cap, config)
    manager = HybridCacheManager(spec, cap, config)
    if setting == "spares":
        # What the adaptive manager runs live (hybridcache.adaptive, ``_use``), read off a
        # built one rather than spelled again here, so the split follows it.
        manager.admission = HybridCacheManager(spec, cap, CacheConfig(hash_unit=16, admission="adaptive")).admission
    if mode == "serve":
        serve_requests(manager, reqs)


def count(setting: str, mode: str, argv: list[str]) -> int:
    """Instructions of one child run (callgrind's ``Collected`` total)."""
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
           os.path.abspath(__file__), "--probe", setting, mode, *argv]
    env = dict(os.environ, PYTHONHASHSEED="0")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    found = re.search(r"Collected\s*:\s*(\d+)", out.stderr)
    if out.returncode or not found:
        raise RuntimeError(f"callgrind run of {setting} ({mode}) failed:\n{out.stderr[-2000:]}")
    return int(found.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--kind", default="chat")
    ap.add_argument("--tenants", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="kimi-linear-48b")
    ap.add_argument("--capacity", default="64GiB")
    ap.add_argument("--jobs", type=int, default=2, help="callgrind runs at a time")
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help="comma-separated subset of the settings (fixed is always run): at 20,000 "
                         "requests the whole split takes about 30 min on 2 cores, fixed,adaptive 12")
    ap.add_argument("--probe", nargs=2, metavar=("SETTING", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        probe(args.probe[0], args.probe[1], args)
        return
    if shutil.which("valgrind") is None:
        sys.exit("count_instructions.py needs valgrind (callgrind) on the PATH")
    argv = [f"--requests={args.requests}", f"--kind={args.kind}", f"--tenants={args.tenants}",
            f"--seed={args.seed}", f"--model={args.model}", f"--capacity={args.capacity}"]
    wanted = {"fixed", *args.settings.split(",")}
    unknown = wanted - set(SETTINGS)
    if unknown:
        sys.exit(f"unknown settings {sorted(unknown)}; known: {', '.join(SETTINGS)}")
    settings = [s for s in SETTINGS if s in wanted]
    runs = [(s, m) for s in settings for m in ("serve", "ctor")]
    with ThreadPoolExecutor(max(1, args.jobs)) as ex:
        got = dict(zip(runs, ex.map(lambda r: count(r[0], r[1], argv), runs)))
    loop = {s: got[(s, "serve")] - got[(s, "ctor")] for s in settings}
    base = loop["fixed"]
    print(f"{args.kind}, {args.tenants} tenants, {args.requests} requests, {args.model}, {args.capacity}: "
          f"instructions of the request loop (serve - build), per request and over the default's")
    for s in settings:
        print(f"  {s:11s} {loop[s] / args.requests / 1000:8.1f}k  {loop[s] / base:.3f}x")
    if len(settings) == len(SETTINGS):
        print(f"adaptive / fixed {loop['adaptive'] / base:.3f}x = 1 + start {loop['start'] / base - 1:+.3f} "
              f"+ spares {(loop['spares'] - loop['start']) / base:+.3f} + sampling step "
              f"{(loop['no-replays'] - loop['spares']) / base:+.3f} + shadow replays "
              f"{(loop['adaptive'] - loop['no-replays']) / base:+.3f}")


if __name__ == "__main__":
    main()
