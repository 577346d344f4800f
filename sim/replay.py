"""Replay a trace through one :class:`~hybridcache.manager.HybridCacheManager`.

Every request goes through the same calls an engine makes: ``add_request`` (match),
``allocate`` for the uncached prompt plus the output, ``append_tokens`` for known output
tokens (so that the next turn can hit them), ``commit`` and ``free``. Requests run one at a
time in file order: the simulator measures what a cache keeps, not scheduling.

Block-level (Mooncake) traces carry 512-token block ids instead of tokens. When the hash unit
equals the trace's block, each block id becomes one unit digest directly (salted with the
tenant, so tenants never share); any other unit replays *virtual tokens* (every token of
block ``b`` has id ``b``), so equal blocks give equal token runs and ordinary chained hashing
finds exactly the sharing the trace records, at any unit (vLLM's inflated blocks included).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import xxhash

from hybridcache.errors import OutOfSpaceError
from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.port import EnginePort
from hybridcache.sim.traces import Trace, TraceRequest
from hybridcache.spec import ModelSpec

Progress = Callable[[int], None]


@dataclass
class RunResult:
    """Outcome of one policy at one capacity (the JSON ``results`` entries)."""

    policy: str
    capacity_bytes: int
    token_hit_rate: float
    request_hit_rate: float
    kv_hit_state_miss_tokens: int
    prefill_flops_saved_frac: float
    snapshots_stored: int
    evictions: int
    per_tenant: dict[str, float]
    hit_tokens: int = 0
    prompt_tokens: int = 0
    requests: int = 0
    rejected_requests: int = 0
    wall_s: float = 0.0
    #: Seconds of tuning replays beyond ``wall_s`` (Marconi's losing alpha candidates).
    tune_s: float = 0.0
    settings: dict[str, object] = field(default_factory=dict)

    def as_json(self) -> dict[str, object]:
        """The fields the issue's JSON schema names, plus the extras after them."""
        return {
            "policy": self.policy,
            "capacity_bytes": self.capacity_bytes,
            "token_hit_rate": self.token_hit_rate,
            "request_hit_rate": self.request_hit_rate,
            "kv_hit_state_miss_tokens": self.kv_hit_state_miss_tokens,
            "prefill_flops_saved_frac": self.prefill_flops_saved_frac,
            "snapshots_stored": self.snapshots_stored,
            "evictions": self.evictions,
            "per_tenant": dict(self.per_tenant),
            "hit_tokens": self.hit_tokens,
            "prompt_tokens": self.prompt_tokens,
            "requests": self.requests,
            "rejected_requests": self.rejected_requests,
            "wall_s": round(self.wall_s, 3),
            "tune_s": round(self.tune_s, 3),
            "settings": dict(self.settings),
        }


class Tally:
    """Per-tenant and total counters kept by the replay (independent of the manager).

    The replay keeps its own counts so that requests the cache cannot hold at all (rejected
    with :class:`OutOfSpaceError`) still count as prompt tokens served without a hit.
    """

    def __init__(self, spec: ModelSpec) -> None:
        self.flops = spec.flops.prefill_flops
        self.prompt: dict[str, int] = {}
        self.hit: dict[str, int] = {}
        self.requests = self.hit_requests = self.rejected = 0
        self.kv_state_miss = 0
        self.flops_total = self.flops_saved = 0.0

    def add(self, tenant: str, prompt: int, hit: int, kv_hit: int) -> None:
        self.prompt[tenant] = self.prompt.get(tenant, 0) + prompt
        self.hit[tenant] = self.hit.get(tenant, 0) + hit
        self.requests += 1
        self.hit_requests += hit > 0
        self.kv_state_miss += kv_hit - hit
        self.flops_total += self.flops(0, prompt)
        self.flops_saved += self.flops(0, hit)

    def result(self, policy: str, capacity: int, snapshots: int, evictions: int) -> RunResult:
        prompt, hit = sum(self.prompt.values()), sum(self.hit.values())
        return RunResult(
            policy=policy,
            capacity_bytes=capacity,
            token_hit_rate=hit / prompt if prompt else 0.0,
            request_hit_rate=self.hit_requests / self.requests if self.requests else 0.0,
            kv_hit_state_miss_tokens=self.kv_state_miss,
            prefill_flops_saved_frac=self.flops_saved / self.flops_total if self.flops_total else 0.0,
            snapshots_stored=snapshots,
            evictions=evictions,
            per_tenant={t: self.hit[t] / p if p else 0.0 for t, p in sorted(self.prompt.items())},
            hit_tokens=hit,
            prompt_tokens=prompt,
            requests=self.requests,
            rejected_requests=self.rejected,
        )


class BlockDigests:
    """Unit digests of a block-level trace at the trace's own resolution, computed once.

    A block id is already prefix-chained, so the digest of unit ``i`` is the id salted with
    the tenant: no chaining needed, and it can be shared by every policy of a sweep.
    """

    def __init__(self, trace: Trace) -> None:
        self._cache: list[list[bytes] | None] = [None] * len(trace.requests)
        self._trace = trace

    def get(self, i: int) -> list[bytes]:
        d = self._cache[i]
        if d is None:
            r = self._trace.requests[i]
            assert r.block_ids is not None
            salt = b"hc-block/" + (r.tenant or "").encode() + b"/"
            full = r.input_length // self._trace.block_tokens
            fn = xxhash.xxh3_128_digest
            d = [fn(salt + int(b).to_bytes(4, "little")) for b in r.block_ids[:full].tolist()]
            self._cache[i] = d
        return d


def virtual_tokens(r: TraceRequest, block_tokens: int) -> np.ndarray:
    """Token ids of a block-level request: every token of block ``b`` is ``b``."""
    assert r.block_ids is not None
    return np.repeat(r.block_ids, block_tokens)[: r.input_length]


def uses_block_digests(trace: Trace, hash_unit: int) -> bool:
    return trace.block_tokens > 0 and hash_unit == trace.block_tokens


class Replay:
    """A replay in progress: a fresh manager, its tally and the next request to serve.

    Incremental (:meth:`advance` to any request index) so that Marconi's tuning can stop a
    candidate at the end of its window, compare candidates, and continue the winner to the
    end of the trace instead of replaying the window again: the manager is deterministic,
    so the continued run is the run a fresh replay with the winning setting would give.
    """

    def __init__(
        self,
        trace: Trace,
        spec: ModelSpec,
        capacity_bytes: int,
        config: CacheConfig,
        digests: BlockDigests | None = None,
    ) -> None:
        self.trace, self.capacity = trace, capacity_bytes
        self.mgr = HybridCacheManager(spec, capacity_bytes, config)
        #: The engine port's read-only request view (the replay reads no manager internals).
        self.port = EnginePort(self.mgr, record_events=False)
        self.tally = Tally(spec)
        self.digests: BlockDigests | None = None
        if uses_block_digests(trace, config.hash_unit):
            self.digests = digests if digests is not None else BlockDigests(trace)
        self.next = 0
        self.wall_s = 0.0

    def advance(self, stop: int | None = None, progress: Progress | None = None) -> None:
        """Serve requests ``next .. stop-1`` (to the end of the trace when ``stop`` is None).

        ``progress`` is called with request counts in steps of about 1 % of the trace.
        """
        t0 = time.perf_counter()
        reqs = self.trace.requests
        stop = len(reqs) if stop is None else min(stop, len(reqs))
        mgr, port, tally, trace, digests = self.mgr, self.port, self.tally, self.trace, self.digests
        step = max(1, len(reqs) // 100)
        done = 0
        for i in range(self.next, stop):
            _one(mgr, port, tally, trace, i, reqs[i], digests)
            done += 1
            if progress is not None and done == step:
                progress(done)
                done = 0
        if progress is not None and done:
            progress(done)
        self.next = max(self.next, stop)
        self.wall_s += time.perf_counter() - t0

    @property
    def evictions(self) -> int:
        """Entries (KV units and snapshots) evicted so far."""
        m = self.mgr.sync_metrics()
        return m.evictions_kv + m.evictions_state

    @property
    def hit_tokens(self) -> int:
        return sum(self.tally.hit.values())

    def result(self, policy: str) -> RunResult:
        """The outcome of the requests served so far."""
        res = self.tally.result(policy, self.capacity, self.mgr.metrics.snapshots_saved, self.evictions)
        res.wall_s = self.wall_s
        return res


def replay(
    trace: Trace,
    spec: ModelSpec,
    capacity_bytes: int,
    config: CacheConfig,
    policy: str,
    *,
    limit: int | None = None,
    digests: BlockDigests | None = None,
    progress: Progress | None = None,
) -> RunResult:
    """Replay ``trace`` (its first ``limit`` requests) through a fresh manager."""
    run = Replay(trace, spec, capacity_bytes, config, digests)
    run.advance(limit, progress)
    return run.result(policy)


def _one(
    mgr: HybridCacheManager,
    port: EnginePort,
    tally: Tally,
    trace: Trace,
    i: int,
    r: TraceRequest,
    digests: BlockDigests | None,
) -> None:
    rid = str(i)
    tenant = r.tenant
    if digests is not None:
        match = mgr.add_request(rid, r.input_length, tenant=tenant, digests=digests.get(i))
    elif r.input_ids is not None:
        match = mgr.add_request(rid, r.input_ids, tenant=tenant)
    else:
        match = mgr.add_request(rid, virtual_tokens(r, trace.block_tokens), tenant=tenant)
    total = r.input_length + r.output_length
    try:
        alloc = mgr.allocate(rid, total - match.hit_tokens)
    except OutOfSpaceError:
        mgr.free(rid, finished=False)
        tally.rejected += 1
        tally.add(tenant or "", r.input_length, 0, 0)
        return
    if r.output_ids is not None and len(r.output_ids):
        mgr.append_tokens(rid, r.output_ids)
    mgr.commit(rid, total)
    req = port.request(rid)
    assert req is not None
    tally.add(tenant or "", r.input_length, alloc.hit_tokens, req.kv_hit_tokens)
    mgr.free(rid)
