"""``python -m hybridcache.adapters.reference.check``: cached outputs must equal uncached ones.

Runs one random workload (:mod:`.workload`) through the reference model twice, over the
same arena size:

- **cached**: the manager's default admission policy, so requests hit snapshots and KV pages
  of earlier ones (copy plans, save points inside prefill chunks, turn-end snapshots,
  evictions under a small capacity, optionally speculative decoding with roll-back);
- **uncached**: admission ``none`` and a tenant per request, so nothing is ever reused,
  and plain one-token decoding.

Every generated token and the logits it was sampled from are compared. Prints one JSON line
``{"requests", "tokens_compared", "hit_tokens", "prompt_tokens", "max_abs_diff",
"mismatched_tokens"}`` and exits 1 on any mismatched token or ``max_abs_diff`` > 1e-5.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace

import torch

from hybridcache.kernels.storage import ArenaStorage
from hybridcache.manager import CacheConfig, HybridCacheManager

from .config import ReferenceConfig, model_spec
from .model import ReferenceModel
from .runner import RequestResult, Runner, RunnerConfig, RunStats
from .workload import WorkloadShape, make_workload

TOLERANCE = 1e-5
#: 64 snapshots or ~3k tokens of KV of the default model: the default workload's distinct
#: prefixes need more, so entries are evicted while shared prefixes still hit.
DEFAULT_CAPACITY = 3 << 19


@dataclass(frozen=True)
class CheckOptions:
    """Everything one check run depends on (all deterministic)."""

    seed: int = 0
    requests: int = 24
    capacity: int = DEFAULT_CAPACITY
    spec_decode: bool = False
    kda: str = "chunked"
    prefill_chunk: int = 64
    hash_unit: int = 16
    max_live: int = 4
    admission: str = "last-token+turn-end+seen-branch"
    eviction: str = "value"
    model: ReferenceConfig = ReferenceConfig()
    shape: WorkloadShape = WorkloadShape()
    mutation: str | None = None


@dataclass
class CheckReport:
    """Outcome of :func:`run_check`; :meth:`summary` is the JSON line."""

    requests: int
    tokens_compared: int
    hit_tokens: int
    prompt_tokens: int
    max_abs_diff: float
    mismatched_tokens: int
    cached: RunStats
    uncached: RunStats
    manager_stats: dict[str, object]

    @property
    def ok(self) -> bool:
        return self.mismatched_tokens == 0 and self.max_abs_diff <= TOLERANCE

    def summary(self) -> dict[str, object]:
        return {
            "requests": self.requests,
            "tokens_compared": self.tokens_compared,
            "hit_tokens": self.hit_tokens,
            "prompt_tokens": self.prompt_tokens,
            "max_abs_diff": self.max_abs_diff,
            "mismatched_tokens": self.mismatched_tokens,
        }


def serve(opts: CheckOptions, *, caching: bool) -> tuple[dict[str, RequestResult], Runner]:
    """Serve the workload of ``opts`` once, with caching on or off."""
    cfg = replace(opts.model, seed=opts.seed)
    spec = model_spec(cfg)
    cache_cfg = CacheConfig(
        hash_unit=opts.hash_unit,
        admission=opts.admission if caching else "none",
        eviction=opts.eviction,
    )
    manager = HybridCacheManager(spec, opts.capacity, cache_cfg)
    storage = ArenaStorage(manager.layout, spec)
    model = ReferenceModel(cfg, kda_mode=opts.kda)
    run_cfg = RunnerConfig(
        prefill_chunk=opts.prefill_chunk,
        max_live=opts.max_live,
        spec_decode=opts.spec_decode and caching,
        tenant_per_request=not caching,
        mutation=opts.mutation if caching else None,
    )
    runner = Runner(model, manager, storage, run_cfg)
    sessions = make_workload(opts.seed, opts.requests, cfg.vocab_size, opts.shape)
    return runner.serve(sessions), runner


def compare(
    cached: dict[str, RequestResult], reference: dict[str, RequestResult]
) -> tuple[int, int, float]:
    """``(tokens_compared, mismatched_tokens, max_abs_diff)`` of two runs, per request id.

    A token counts as mismatched where the ids differ, and every token one run has and the
    other lacks (a missing request counts all its tokens).
    """
    compared = mismatched = 0
    worst = 0.0
    for rid, ref in reference.items():
        compared += len(ref.tokens)
        got = cached.get(rid)
        if got is None:
            mismatched += len(ref.tokens)
            continue
        n = min(len(ref.tokens), len(got.tokens))
        mismatched += sum(a != b for a, b in zip(ref.tokens[:n], got.tokens[:n]))
        mismatched += abs(len(ref.tokens) - len(got.tokens))
        if n:
            diff = (ref.logits[:n] - got.logits[:n]).abs().max().item()
            worst = max(worst, float(diff))
    mismatched += sum(len(r.tokens) for rid, r in cached.items() if rid not in reference)
    return compared, mismatched, worst


def run_check(opts: CheckOptions) -> CheckReport:
    """Serve with and without caching and compare (see module docstring)."""
    cached, runner = serve(opts, caching=True)
    reference, base = serve(opts, caching=False)
    if base.stats.hit_tokens:
        raise AssertionError("the uncached run reused cached tokens; the baseline is broken")
    compared, mismatched, worst = compare(cached, reference)
    return CheckReport(
        requests=len(reference),
        tokens_compared=compared,
        hit_tokens=runner.stats.hit_tokens,
        prompt_tokens=runner.stats.prompt_tokens,
        max_abs_diff=worst,
        mismatched_tokens=mismatched,
        cached=runner.stats,
        uncached=base.stats,
        manager_stats=runner.manager.stats(),
    )


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m hybridcache.adapters.reference.check",
        description="Serve a random workload with and without prefix caching; outputs must match.",
    )
    ap.add_argument("--seed", type=int, default=0, help="workload and weight seed")
    ap.add_argument("--requests", type=int, default=24, help="turns to serve")
    ap.add_argument("--capacity", type=int, default=DEFAULT_CAPACITY, help="arena bytes")
    ap.add_argument("--spec-decode", action="store_true", help="n-gram speculative decoding")
    ap.add_argument("--kda", choices=("chunked", "recurrent"), default="chunked")
    ap.add_argument("--prefill-chunk", type=int, default=64, help="tokens per prefill step")
    ap.add_argument("--hash-unit", type=int, default=16, help="tokens per hash unit / page")
    ap.add_argument("--max-live", type=int, default=4, help="concurrent requests")
    ap.add_argument("--admission", default=CheckOptions.admission, help="admission rules")
    ap.add_argument("--eviction", default="value", choices=("value", "lru", "marconi"))
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (the model is tiny: more threads only add overhead)",
    )
    ap.add_argument("--verbose", action="store_true", help="run details on stderr")
    return ap


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 = outputs match)."""
    a = _parser().parse_args(argv)
    torch.set_num_threads(a.threads)
    opts = CheckOptions(
        seed=a.seed,
        requests=a.requests,
        capacity=a.capacity,
        spec_decode=a.spec_decode,
        kda=a.kda,
        prefill_chunk=a.prefill_chunk,
        hash_unit=a.hash_unit,
        max_live=a.max_live,
        admission=a.admission,
        eviction=a.eviction,
    )
    report = run_check(opts)
    print(json.dumps(report.summary()), flush=True)
    if a.verbose:
        detail = {
            "cached": vars(report.cached),
            "uncached": vars(report.uncached),
            "manager": report.manager_stats,
        }
        print(json.dumps(detail, default=str), file=sys.stderr)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
