"""Capacity sweeps: every policy at every capacity over one trace, with a progress bar.

The sweep builds each policy's settings once (:mod:`hybridcache.sim.policies`), tunes
Marconi's alpha on a window of the trace at each capacity, replays, and assembles the JSON
document of the issue (``trace``, ``model``, ``requests``, ``prompt_tokens``, ``results``).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import sys
from collections.abc import Hashable, Iterable, Sequence, Sized
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from typing import Any

from tqdm import tqdm

from hybridcache.errors import CapacityError, ConfigError, InvalidRequestError
from hybridcache.presets import get_preset
from hybridcache.sim.policies import MARCONI_ALPHAS, PolicySetup, build_policy
from hybridcache.sim.replay import BlockDigests, Replay, RunResult
from hybridcache.sim.sizes import format_bytes
from hybridcache.sim.traces import Trace, TraceFormatError, block_count_problem, length_problem
from hybridcache.spec import ModelSpec
from hybridcache.validation import integer_at_least

#: Marconi tunes alpha once the cache has filled: each candidate replays the trace up to
#: TUNE_AFTER_FILL times the requests that filled it (at least TUNE_MIN_REQUESTS, at most
#: TUNE_FRACTION of the trace).
TUNE_AFTER_FILL = 2
TUNE_FRACTION = 0.15
TUNE_MIN_REQUESTS = 50


def default_unit(trace: Trace) -> int:
    """The trace's own resolution: its block for Mooncake (finer hashing finds no more
    sharing in a block-level trace), 16 tokens for token traces."""
    return trace.block_tokens or 16


def tune_window(requests: int, filled: int | None) -> int:
    """Requests each alpha candidate replays, given the request count that first filled
    the cache (``None``: not within the longest window).

    Candidates differ only in what they evict, so the window must run past the first
    eviction; ``TUNE_AFTER_FILL`` fills' worth of requests lets roughly the whole cache be
    replaced once by each candidate's choices (Marconi tunes once the cache first fills,
    on a replay of the requests seen). The cap bounds the tuning cost on caches that fill
    late; there the window evicts nothing and every candidate would tie.
    """
    low = min(TUNE_MIN_REQUESTS, requests)
    cap = max(int(requests * TUNE_FRACTION), low)
    if filled is None:
        return cap
    return min(cap, max(low, TUNE_AFTER_FILL * filled))


def tune_marconi(
    trace: Trace, setup: PolicySetup, capacity: int, digests: BlockDigests | None
) -> tuple[float, Replay, float]:
    """Marconi's alpha: the best token hit rate of the candidates over the tuning window.

    Returns the alpha, the winning candidate's replay stopped at the end of the window (the
    caller continues it rather than replaying the window again) and the seconds spent on
    the other candidates. Alpha only ranks eviction victims, so every candidate replays the
    requests before the first eviction identically (the first candidate finds where that
    is) and, when the window evicts nothing, the whole window: the first candidate then
    wins the tie, as it would after replaying all of them.
    """
    def candidate(alpha: float) -> Replay:
        cfg = dataclasses.replace(setup.config, marconi_alpha=alpha)
        return Replay(trace, setup.spec, capacity, cfg, digests)

    best = candidate(MARCONI_ALPHAS[0])
    n = tune_window(len(trace.requests), None)
    while best.next < n and best.evictions == 0:
        best.advance(best.next + 1)
    if best.evictions == 0:
        return MARCONI_ALPHAS[0], best, 0.0
    n = tune_window(len(trace.requests), best.next)
    best.advance(n)
    best_alpha, extra = MARCONI_ALPHAS[0], 0.0
    for alpha in MARCONI_ALPHAS[1:]:
        run = candidate(alpha)
        run.advance(n)
        # Same prompts in every window: compare hit tokens; ties keep the earlier alpha.
        if run.hit_tokens > best.hit_tokens:
            extra += best.wall_s
            best, best_alpha = run, alpha
        else:
            extra += run.wall_s
    return best_alpha, best, extra


def run_one(
    trace: Trace,
    setup: PolicySetup,
    capacity: int,
    digests: BlockDigests | None = None,
    bar: tqdm | None = None,
) -> RunResult:
    """One policy at one capacity (tuning Marconi first when the policy asks for it)."""
    if setup.native:
        from hybridcache.sim.vllm_native import replay_native

        res = replay_native(trace, setup.spec, capacity, setup.config.hash_unit,
                            progress=bar.update if bar else None)
        res.settings = res.settings or {"hash_unit": setup.config.hash_unit,
                                        "engine": "vllm KVCacheManager"}
        return res
    settings = setup.describe()
    tune_s = 0.0
    if setup.tune_marconi:
        alpha, run, tune_s = tune_marconi(trace, setup, capacity, digests)
        settings["marconi_alpha"] = alpha
        settings["marconi_tune_requests"] = run.next
        if bar is not None:
            bar.update(run.next)
    else:
        run = Replay(trace, setup.spec, capacity, setup.config, digests)
    run.advance(None, bar.update if bar else None)
    res = run.result(setup.name)
    res.settings = settings
    res.tune_s = tune_s
    return res


def sweep(
    trace: Trace,
    model: str,
    policies: Sequence[str],
    capacities: Sequence[int],
    hash_unit: int | None = None,
    progress: bool = True,
) -> dict[str, object]:
    """Replay every policy at every capacity; returns the JSON document of the issue.

    A capacity too small for one snapshot of the model raises :class:`CapacityError` naming
    it, an empty request or one longer than the model serves :class:`InvalidRequestError`,
    a request whose ids contradict its lengths :class:`TraceFormatError` (each naming the
    request), before any replay starts. So does a policy or capacity named twice, none, or
    a lone name or size in place of a list (:class:`ConfigError`): results are keyed by
    policy and capacity, so a second one would replay the same cell again and list it twice
    (the command line drops repeats itself).
    """
    spec = get_preset(model)
    if hash_unit is not None:
        unit = integer_at_least(hash_unit, 1)  # a NumPy integer as well, as an int
        if unit is None:
            raise ConfigError(f"hash_unit must be an int >= 1, got {hash_unit!r}")
        hash_unit = unit
    policies, capacities = _listed("policies", policies), _listed("capacities", capacities)
    _check_requests(trace, spec)
    unit = default_unit(trace) if hash_unit is None else hash_unit
    outputs_known = trace.block_tokens == 0
    setups = [build_policy(p, spec, unit, outputs_known) for p in policies]
    for s in setups:
        _check_native(s, trace)
        for cap in capacities:
            _check_capacity(s, cap)
    digests = BlockDigests(trace) if trace.block_tokens else None
    total = len(setups) * len(capacities) * len(trace.requests)
    results: dict[tuple[str, int], dict[str, object]] = {}
    native = [s for s in setups if s.native]
    with ExitStack() as stack:
        bar = stack.enter_context(tqdm(total=total, desc="replay", unit="req", file=sys.stderr,
                                       disable=not progress, dynamic_ncols=True, leave=False))
        futures = {}
        if native:
            # vLLM takes ~10-20 s to import: replay it in a second process meanwhile.
            pool = stack.enter_context(ProcessPoolExecutor(1, mp_context=_mp_context()))
            futures = {(s.name, cap): pool.submit(_run_native, trace, s, cap)
                       for s in native for cap in capacities}
        for s in setups:
            for cap in capacities:
                if s.native:
                    continue
                bar.set_postfix_str(f"{s.name} @ {format_bytes(cap)}")
                results[(s.name, cap)] = run_one(trace, s, cap, digests, bar).as_json()
        for key, fut in futures.items():
            bar.set_postfix_str(f"{key[0]} @ {format_bytes(key[1])}")
            results[key] = fut.result()
            bar.update(len(trace.requests))
    return {
        "trace": trace.path,
        "model": model,
        "requests": len(trace.requests),
        "prompt_tokens": trace.prompt_tokens,
        "skipped_lines": trace.skipped,
        "hash_unit": unit,
        "results": [results[(s.name, cap)] for s in setups for cap in capacities],
    }


def _listed(what: str, items: Iterable[Any]) -> list[Any]:
    """``items`` as a list (:func:`sweep` walks the capacities once per policy, so a
    generator would serve only the first), refusing a lone name or size (a string would be
    read letter by letter), an empty list, and an item named twice."""
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise ConfigError(f"{what} must be a list, got {type(items).__name__} {items!r} (write [{items!r}])")
    out = list(items)
    if not out:
        raise ConfigError(f"sweep needs at least one of {what}, got none")
    seen: set[object] = set()
    for item in out:
        if not isinstance(item, Hashable):
            raise ConfigError(f"{what} must list names or sizes, got {item!r}")
        if item in seen:
            raise ConfigError(f"{what} name {item!r} twice: each is replayed once per sweep")
        seen.add(item)
    return out


def _mp_context() -> mp.context.BaseContext:
    """``fork`` where it exists (the worker inherits what is already imported), else spawn."""
    return mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")


def _run_native(trace: Trace, setup: PolicySetup, capacity: int) -> dict[str, object]:
    """Worker-process entry of a vllm-native replay (module-level so that it pickles)."""
    return run_one(trace, setup, capacity).as_json()


def _check_capacity(setup: PolicySetup, capacity: int) -> None:
    """Fail before any replay if ``capacity`` cannot hold the policy's arena: a manager
    (accounting only, ~1 ms) is built and its layout read through the engine port."""
    from hybridcache.manager import HybridCacheManager
    from hybridcache.port import EnginePort

    try:
        _ = EnginePort(HybridCacheManager(setup.spec, capacity, setup.config), record_events=False).layout
    except CapacityError as e:
        raise CapacityError(f"policy {setup.name}: {e}") from None


def _check_requests(trace: Trace, spec: ModelSpec) -> None:
    """Fail before any replay on a request the replay cannot serve. ``read_trace`` refuses
    such a line of a file; a trace built in code (``generate``'s requests, an engine's log)
    is not read, and without this a bad request stopped the sweep midway, inside a replay
    (nemotron-h-8b serves 8,192 tokens, generated agent sessions grow past that), or
    replayed what its fields contradict. Checked: an empty prompt; the ids the trace's
    format replays (``input_ids`` of ``input_length`` tokens and ``output_ids`` of
    ``output_length``, or ``block_ids`` of ``ceil(input_length / block_tokens)`` blocks);
    prompt and output (which the replay appends) within the model's ``max_model_len``. The
    length and block-count checks are the reader's own (:func:`length_problem`,
    :func:`block_count_problem`), so a file's line and a request built in code read alike."""
    limit, block = spec.max_model_len, trace.block_tokens
    for i, r in enumerate(trace.requests):
        where = f"{trace.path}: " + (f"line {r.line}" if r.line else f"request {i}")
        if r.input_length < 1:
            raise InvalidRequestError(f"{where}: empty prompt (input_length {r.input_length})")
        if block:
            problem = block_count_problem(r.input_length, None if r.block_ids is None else len(r.block_ids), block)
            if problem:
                raise TraceFormatError(f"{where}: {problem}")
        else:
            _check_ids(where, "input", r.input_ids, r.input_length, required=True)
            _check_ids(where, "output", r.output_ids, r.output_length, required=False)
        problem = length_problem(r.input_length, r.output_length, limit)
        if problem:
            raise InvalidRequestError(f"{where}: {problem} ({spec.name!r}'s max_model_len)")


def _check_ids(where: str, field: str, ids: Sized | None, length: int, *, required: bool) -> None:
    if ids is None:
        if required:
            raise TraceFormatError(f"{where}: a token trace's request needs {field}_ids")
        return
    n = len(ids)
    if n != length:
        raise TraceFormatError(f"{where}: {n:,} {field}_ids but {field}_length {length:,}")


def _check_native(setup: PolicySetup, trace: Trace) -> None:
    if not setup.native:
        return
    from hybridcache.sim.vllm_native import check_available

    check_available(trace)
