"""Manager speed and hit rate: hybridcache vs vLLM's own KVCacheManager, same requests, one run.

    python benchmarks/bench_manager.py [--requests 2000] [--model kimi-linear-48b] [--capacity 64GiB]
                                       [--repeat 3]

A multi-turn chat stream with shared system prompts (token ids, from the simulator's
generator) goes through vLLM's ``KVCacheManager`` on the hybrid config vLLM builds for the
model in ``align`` mode (attention block inflated to the state page, chunks cut at block
boundaries; see ``hybridcache.sim.vllm_native``), at its default (hash unit = block) and at
its strongest setting (``prefix_match_unit`` 16 = our unit, retention ``None``; chunks also
end at the prompt's last 16-token boundary, partial hits copy on write), and through
``HybridCacheManager`` with its defaults. For each, per request: match + allocate + commit + free (hashing included, as
vLLM's Request hashes on construction). Prints the median and p90 time per request, the
token hit rate, and the ratios against both vLLM settings. Targets: ours <= 0.5x vLLM's
time at its default and <= 0.25x at equal granularity, with a hit rate >= vLLM's strongest.
Timings on a shared machine drift by 10-20 % within minutes, so every manager runs once per
round and the ratio is the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from hybridcache.errors import OutOfSpaceError
from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.presets import get_preset
from hybridcache.sim.generate import generate
from hybridcache.sim.policies import vllm_align_block
from hybridcache.sim.sizes import parse_size


def run_ours(spec, capacity, reqs, unit: int = 16) -> tuple[list[float], int, int]:
    return serve_requests(HybridCacheManager(spec, capacity, CacheConfig(hash_unit=unit)), reqs)


def serve_requests(m: HybridCacheManager, reqs, refused: list[int] | None = None) -> tuple[list[float], int, int]:
    """Each request through ``m`` (match + allocate + append + commit + free): seconds per
    served request, hit tokens and prompt tokens of the served ones. Shared with
    ``bench_adaptive.py`` so both time the same loop. A request the cache cannot hold
    (``OutOfSpaceError``) is left out of the three; its index goes to ``refused`` if given
    (a hit rate over every request counts it as a miss, as the simulator does)."""
    times: list[float] = []
    hit = prompt = 0
    for i, r in enumerate(reqs):
        t0 = time.perf_counter()
        rid = str(i)
        res = m.add_request(rid, r.input_ids, tenant=r.tenant)
        try:
            m.allocate(rid, r.input_length + r.output_length - res.hit_tokens)
        except OutOfSpaceError:
            m.free(rid, finished=False)
            if refused is not None:
                refused.append(i)
            continue
        if r.output_ids is not None and len(r.output_ids):
            m.append_tokens(rid, r.output_ids)
        m.commit(rid, r.input_length + r.output_length)
        m.free(rid)
        times.append(time.perf_counter() - t0)
        hit += res.hit_tokens
        prompt += r.input_length
    return times, hit, prompt


def run_native(spec, capacity, reqs, unit: int | None = None):
    """vLLM's ``KVCacheManager``: at its default (hash unit = block) or, with ``unit``, at
    ``prefix_match_unit=unit`` and retention ``None`` (its strongest setting)."""
    try:
        from hybridcache.sim import vllm_native as vn
        from hybridcache.sim.replay import Tally

        v = vn._vllm()
    except Exception as exc:  # noqa: BLE001 - vLLM missing or failing to import
        print(f"(vLLM not importable: {type(exc).__name__}: {exc}; native column skipped)")
        return None
    block = vllm_align_block(spec)
    if unit is not None:
        mgr, hasher, block = vn.fine_manager(v, spec, capacity, unit)
    else:
        v["init_none_hash"](v["sha256"])
        hasher = v["get_request_block_hasher"](block, v["sha256"])
        mgr = v["KVCacheManager"](
            vn.build_kv_cache_config(v, spec, capacity, block), max_model_len=spec.max_model_len,
            scheduler_block_size=block, hash_block_size=block, enable_caching=True,
        )
    tally = Tally(spec)
    times: list[float] = []
    for i, r in enumerate(reqs):
        t0 = time.perf_counter()
        vn._one(v, mgr, hasher, tally, str(i), r, block, unit)
        times.append(time.perf_counter() - t0)
    res = tally.result("vllm-native", capacity, snapshots=-1, evictions=-1)
    return times, res.token_hit_rate, block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--model", default="kimi-linear-48b")
    ap.add_argument("--capacity", default="64GiB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--units", default="16,64,128", help="hash units to run ours with")
    ap.add_argument("--vllm-unit", type=int, default=16,
                    help="vLLM's prefix_match_unit for its strongest setting (0: skip it)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="rounds; each runs every manager once, in alternating order")
    args = ap.parse_args()
    spec = get_preset(args.model)
    cap = parse_size(args.capacity)
    reqs = generate("chat", args.requests, seed=args.seed, tenants=2)
    units = [int(u) for u in args.units.split(",")]
    jobs: list = [("ours", u, f"hybridcache (hash unit {u})") for u in units]
    block = vllm_align_block(spec)
    jobs.append(("vllm", None, f"vllm KVCacheManager (align, block {block})"))
    if args.vllm_unit:
        jobs.append(("vllm", args.vllm_unit,
                     f"vllm KVCacheManager (unit {args.vllm_unit}, retention None)"))
    times, rates = run_rounds(spec, cap, reqs, jobs, args.repeat)
    report(args, reqs, jobs, times, rates)


def run_rounds(spec, cap, reqs, jobs, repeat):
    """Every job once per round, in alternating order; times and hit rates per job name."""
    times: dict[str, list[list[float]]] = {}
    rates: dict[str, float] = {}
    warm = reqs[:200]  # untimed: the first run in a process pays for cold caches
    for kind, unit, _ in jobs:
        run_ours(spec, cap, warm, unit) if kind == "ours" else run_native(spec, cap, warm, unit)
    for rnd in range(repeat):
        # Alternate the order so that a machine that speeds up or slows down during the
        # run favours neither side; ratios are taken within a round.
        for kind, unit, name in (jobs if rnd % 2 == 0 else jobs[::-1]):
            gc.collect()  # each run starts without the previous one's garbage to trace
            if kind == "ours":
                t, hit, prompt = run_ours(spec, cap, reqs, unit)
                times.setdefault(name, []).append(t)
                rates[name] = hit / prompt
                continue
            native = run_native(spec, cap, reqs, unit)
            if native is not None:
                times.setdefault(name, []).append(native[0])
                rates[name] = native[1]
    return times, rates


def report(args, reqs, jobs, times, rates) -> None:
    print(f"{len(reqs)} requests ({sum(r.input_length for r in reqs):,} prompt tokens), "
          f"{args.model}, {args.capacity}, {args.repeat} round(s); per round: median us per request")
    print(f"{'manager':<52}{'median us':>11}{'p90 us':>9}{'hit rate':>10}   rounds")
    med = {name: [statistics.median(t) for t in ts] for name, ts in times.items()}
    for name, ts in times.items():
        q = statistics.quantiles([x for t in ts for x in t], n=10)
        per = " ".join(f"{m * 1e6:.0f}" for m in med[name])
        print(f"{name:<52}{statistics.median(med[name]) * 1e6:>11.0f}{q[8] * 1e6:>9.0f}"
              f"{rates[name]:>10.3f}   {per}")
    peers = [name for kind, _, name in jobs if kind == "vllm" and name in med]
    for _, _, name in (j for j in jobs if j[0] == "ours"):
        for peer in peers:
            ratios = [a / b for a, b in zip(med[name], med[peer])]
            print(f"{name} / {peer} median time: {statistics.median(ratios):.2f}x "
                  f"(rounds: {' '.join(f'{r:.2f}' for r in ratios)}); "
                  f"hit rate {rates[name]:.3f} vs {rates[peer]:.3f}")


if __name__ == "__main__":
    main()
