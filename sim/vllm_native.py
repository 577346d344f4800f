"""``vllm-native``: vLLM's own ``KVCacheManager`` replaying the same requests.

This measures how close the ``vllm-align`` emulation comes to the real thing. The driver
does what vLLM's scheduler does for one request at a time in ``align`` mode:

- the KV cache config mirrors vLLM's for the model: the attention block inflated to
  :func:`~hybridcache.sim.policies.vllm_align_block`, state pages padded to the attention
  page, layers split into groups of equal size (vLLM's ``group_size`` rule), a block pool
  of ``capacity / (page * group_size)`` blocks, and retention interval 0 (vLLM's default:
  keep only reachable states);
- ``get_computed_blocks`` gives the hit and the shared-prefix junction; prefill runs in
  chunks that stop at the junction and at the last block boundary before the prompt end
  (``Scheduler._mamba_block_aligned_split``), with ``new_step_starts()`` between steps
  (else the Mamba manager refuses blocks cached in the same step);
- known output tokens are appended (their KV blocks are cached, as vLLM does), then the
  request is freed.

Only token traces are replayed (vLLM hashes tokens). vLLM is imported lazily; everything
else in the simulator works without it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from hybridcache.errors import HybridCacheError
from hybridcache.sim.policies import vllm_align_block
from hybridcache.sim.replay import RunResult, Tally
from hybridcache.sim.traces import Trace, TraceRequest
from hybridcache.spec import AttentionKind, ModelSpec


class NativeUnavailable(HybridCacheError):
    """vllm-native cannot run here (vLLM missing, or a trace it cannot replay)."""


def unavailable_reason(trace: Trace | None = None) -> str | None:
    """Why ``vllm-native`` cannot replay ``trace`` here, or ``None`` if it can."""
    if trace is not None and trace.block_tokens:
        return "vllm-native replays token traces only (this trace has block ids, not tokens)"
    try:
        _vllm()
    except Exception as e:  # ImportError, or vLLM failing at import time
        return f"vllm-native needs vLLM importable ({type(e).__name__}: {e})"
    return None


def check_available(trace: Trace) -> None:
    reason = unavailable_reason(trace)
    if reason:
        raise NativeUnavailable(reason)


def _vllm() -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        MLAAttentionSpec,
    )
    from vllm.v1.request import Request

    return dict(
        torch=torch, SamplingParams=SamplingParams, sha256=sha256, KVCacheManager=KVCacheManager,
        get_request_block_hasher=get_request_block_hasher, init_none_hash=init_none_hash,
        FullAttentionSpec=FullAttentionSpec, KVCacheConfig=KVCacheConfig,
        KVCacheGroupSpec=KVCacheGroupSpec, MambaSpec=MambaSpec, MLAAttentionSpec=MLAAttentionSpec,
        Request=Request,
    )


def _group_layers(buckets: list[tuple[Any, int]]) -> list[tuple[Any, int]]:
    """vLLM's split of layer types into groups of equal size (``kv_cache_utils``)."""
    counts = [n for _, n in buckets]
    size = min(counts)
    if max(counts) < size * 1.5:
        size = max(counts)
    groups = []
    for spec, n in buckets:
        groups += [(spec, size)] * -(-n // size)
    return groups


def build_kv_cache_config(v: dict[str, Any], spec: ModelSpec, capacity: int, block: int) -> Any:
    """vLLM ``KVCacheConfig`` of ``spec`` in ``align`` mode within ``capacity`` bytes."""
    torch = v["torch"]
    dt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    buckets: list[tuple[Any, int]] = []
    attn_page = 0
    for g in spec.attention_groups:
        if g.kind is AttentionKind.SLIDING:
            raise NativeUnavailable("vllm-native: sliding-window groups are not modelled")
        cls = v["MLAAttentionSpec"] if g.kind is AttentionKind.MLA else v["FullAttentionSpec"]
        kw = dict(block_size=block, num_kv_heads=g.num_kv_heads, head_size=g.head_dim, dtype=dt[g.dtype])
        if g.kind is AttentionKind.MLA:
            kw["cache_dtype_str"] = "auto"
        s = cls(**kw)
        attn_page = max(attn_page, s.page_size_bytes)
        buckets.append((s, g.num_layers))
    for g in spec.state_groups:
        s = v["MambaSpec"](
            block_size=block,
            shapes=tuple(t.shape for t in g.tensors),
            dtypes=tuple(dt[t.dtype] for t in g.tensors),
            page_size_padded=attn_page,
            mamba_cache_mode="align",
        )
        if s.page_size_bytes < s.state_content_size_bytes:
            raise NativeUnavailable("vllm-native: state page larger than the attention page")
        buckets.append((s, g.num_layers))
    groups = _group_layers(buckets)
    group_size = groups[0][1]
    num_blocks = capacity // (attn_page * group_size)
    if num_blocks < 2:
        raise NativeUnavailable(f"vllm-native: capacity {capacity} B holds fewer than 2 blocks")
    specs = [v["KVCacheGroupSpec"]([f"g{i}.l{j}" for j in range(n)], s) for i, (s, n) in enumerate(groups)]
    return v["KVCacheConfig"](num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=specs,
                              prefix_cache_retention_interval=0)


def replay_native(
    trace: Trace,
    spec: ModelSpec,
    capacity: int,
    block: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> RunResult:
    """Replay a token trace through vLLM's ``KVCacheManager`` (see module docstring).

    ``block`` below vLLM's inflated block is a hash unit inside it: vLLM's strongest
    setting, replayed through its real ``Scheduler``
    (:func:`hybridcache.sim.vllm_native_best.replay_native_best`).
    """
    check_available(trace)
    if block is not None and block < vllm_align_block(spec):
        from hybridcache.sim.vllm_native_best import replay_native_best

        return replay_native_best(trace, spec, capacity, block, progress)
    t0 = time.perf_counter()
    v = _vllm()
    block = block or vllm_align_block(spec)
    v["init_none_hash"](v["sha256"])
    hasher = v["get_request_block_hasher"](block, v["sha256"])
    mgr = v["KVCacheManager"](
        build_kv_cache_config(v, spec, capacity, block),
        max_model_len=spec.max_model_len, scheduler_block_size=block, hash_block_size=block,
        enable_caching=True,
    )
    tally = Tally(spec)
    serve_each(trace.requests, lambda i, r: _one(v, mgr, hasher, tally, str(i), r, block), progress)
    res = tally.result("vllm-native", capacity, snapshots=-1, evictions=-1)
    res.wall_s = time.perf_counter() - t0
    return res


def serve_each(
    requests: Sequence[TraceRequest],
    serve: Callable[[int, TraceRequest], None],
    progress: Callable[[int], None] | None,
) -> None:
    """``serve(i, request)`` for each request in order, telling ``progress`` the count served
    in steps of about 1 % of them (the vLLM-native replays share it)."""
    step = max(1, len(requests) // 100)
    for i, r in enumerate(requests):
        serve(i, r)
        if progress is not None and (i + 1) % step == 0:
            progress(step)
    if progress is not None and len(requests) % step:
        progress(len(requests) % step)


def fine_manager(v: dict[str, Any], spec: ModelSpec, capacity: int, unit: int) -> tuple[Any, Any, int]:
    """vLLM's ``KVCacheManager`` hashing at ``unit`` inside the ``align`` block, retention
    ``None`` (its strongest setting), and the request hasher; for manager-level timing
    (``benchmarks/bench_manager.py``; hit rates come from the real scheduler in
    :mod:`hybridcache.sim.vllm_native_best`)."""
    block = vllm_align_block(spec)
    kvc = build_kv_cache_config(v, spec, capacity, block)
    kvc.prefix_cache_retention_interval = None
    kvc.hash_block_size = unit
    kvc.cache_hit_alignment_tokens = unit
    v["init_none_hash"](v["sha256"])
    mgr = v["KVCacheManager"](kvc, max_model_len=spec.max_model_len, scheduler_block_size=block,
                              hash_block_size=unit, enable_caching=True)
    return mgr, v["get_request_block_hasher"](unit, v["sha256"]), block


def _one(v: dict[str, Any], mgr: Any, hasher: Any, tally: Tally, rid: str, r: Any, block: int,
         unit: int | None = None) -> None:
    assert r.input_ids is not None
    prompt = r.input_ids.tolist()
    n_out = max(1, r.output_length)
    req = v["Request"](rid, prompt, v["SamplingParams"](max_tokens=n_out), None,
                       block_hasher=hasher, cache_salt=r.tenant)
    mgr.new_step_starts()
    blocks, hit, junction = mgr.get_computed_blocks(req)
    req.shared_prefix_boundary = junction
    n = len(prompt)
    start, first = hit, True
    while start < n:
        end = _chunk_end(start, n, junction, block, unit)
        out = mgr.allocate_slots(req, end - start, hit if first else 0, blocks if first else None)
        if unit is not None:
            # The scheduler hands the copies to the worker and, once they have run, gives
            # the blocks the copies read back to the pool (``_free_cow_retained_blocks``).
            _, retained = mgr.take_kv_cache_block_copies()
            mgr.block_pool.free_blocks(retained)
        if out is None:  # does not fit even after evicting everything evictable
            if not first:
                mgr.free(req)
            tally.rejected += 1
            tally.add(r.tenant or "", n, 0, 0)
            return
        req.num_computed_tokens = end
        start, first = end, False
        mgr.new_step_starts()
    if r.output_ids is not None and len(r.output_ids) > 1:
        # Decode: the sampled tokens enter the request; all but the last are computed.
        req.append_output_token_ids(r.output_ids.tolist())
        mgr.allocate_slots(req, len(r.output_ids) - 1)
        req.num_computed_tokens = req.num_tokens - 1
    tally.add(r.tenant or "", n, hit, hit)
    mgr.free(req)


def _chunk_end(start: int, n: int, junction: int, block: int, unit: int | None = None) -> int:
    """End of the next prefill chunk: vLLM's mandatory stops strictly inside [start, n).

    With a hash ``unit`` inside the block (``mamba_partial_cache_hit``), also the prompt's
    last unit boundary and, for a chunk starting mid-block, the next block boundary.
    """
    last_cache = (n - 1) // block * block
    junction_stop = start + (junction - start) // block * block if junction > start else 0
    stops = [last_cache, junction_stop]
    if unit is not None:
        tail = (n - 1) // unit * unit
        stops += [tail if tail > last_cache else 0,
                  (start // block + 1) * block if start % block else 0]
    return min((s for s in stops if start < s < n), default=n)
