"""``vllm-native-best``: vLLM's real ``Scheduler`` at its strongest setting, same requests.

vLLM 0.32's strongest documented prefix-caching setting for hybrid models is
``prefix_match_unit`` equal to our hash unit (hashes, hits and the prompt checkpoint
inside the inflated ``align`` block) with ``prefix_cache_retention_interval=None`` (every
state kept). Its chunk-split rules live in the scheduler, not in ``KVCacheManager``: a
prefill chunk ends at the prompt's last hash-aligned boundary (``mamba_partial_cache_hit``)
so that ``MambaManager`` registers that sub-block state, a chunk that starts mid-block stops
at the next block boundary, and a partial hit's attention page and state are copied on
write (``kv_cache_block_copies``). Rather than re-implementing them, this module drives
vLLM's own ``Scheduler`` with simulated model outputs: the trace's output tokens are the
sampled tokens, one per decode step.

The scheduler is built as vLLM's engine builds it, from a config-only model directory (the
scheduler reads the model config for limits only) and the :class:`KVCacheConfig` of
:func:`hybridcache.sim.vllm_native.build_kv_cache_config` for the spec, with the hash block
and retention settings above. Requests run one at a time, as in ``vllm-native``. The hit
of a request is the number of prompt tokens the scheduler found computed when it first
scheduled the request.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridcache.sim.policies import vllm_align_block
from hybridcache.sim.replay import RunResult, Tally
from hybridcache.sim.traces import Trace, TraceRequest
from hybridcache.sim.vllm_native import (
    NativeUnavailable,
    build_kv_cache_config,
    check_available,
    serve_each,
)
from hybridcache.spec import ModelSpec

#: Tokens the scheduler may run per step (vLLM's default for chunked prefill on CPU is
#: larger; any value at least one block long gives the same hits).
MAX_BATCHED_TOKENS = 8192


def _config_dir(path: Path, max_model_len: int) -> Path:
    """A config-only hybrid checkpoint: the scheduler reads limits from it, never weights."""
    cfg = {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "linear_num_key_heads": 1, "linear_num_value_heads": 1, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64, "max_position_embeddings": max_model_len,
        "torch_dtype": "bfloat16", "eos_token_id": 0,
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def build_scheduler(spec: ModelSpec, capacity: int, unit: int, model_dir: Path,
                    retention: int | None = None) -> Any:
    """vLLM's ``Scheduler`` over ``spec``'s ``align``-mode pool at hash unit ``unit``."""
    import vllm.v1.kv_cache_interface as kci
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from hybridcache.sim.vllm_native import _vllm

    block = vllm_align_block(spec)
    if block % unit:
        raise NativeUnavailable(f"vllm-native-best: block {block} is not a multiple of unit {unit}")
    max_len = spec.max_model_len
    model_config = ModelConfig(model=str(_config_dir(model_dir, max_len)), dtype="bfloat16",
                               seed=0, skip_tokenizer_init=True, max_model_len=max_len)
    cache = CacheConfig(block_size=block, enable_prefix_caching=True, mamba_cache_mode="align",
                        prefix_match_unit=unit, prefix_cache_retention_interval=retention)
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=max(MAX_BATCHED_TOKENS, block),
            max_model_len=max_len, enable_chunked_prefill=True, async_scheduling=False,
            is_encoder_decoder=False,
        ),
        cache_config=cache,
    )
    kvc = build_kv_cache_config(_vllm(), spec, capacity, block)
    kvc.prefix_cache_retention_interval = retention
    kvc.hash_block_size = unit
    kvc.cache_hit_alignment_tokens = unit if any(
        isinstance(g.kv_cache_spec, kci.MambaSpec) for g in kvc.kv_cache_groups) else block
    vllm_config.cache_config.num_gpu_blocks = kvc.num_blocks
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kvc,
                     structured_output_manager=StructuredOutputManager(vllm_config),
                     block_size=block, hash_block_size=unit, log_stats=False)


def _outputs(out: Any, req: Any, tokens: list[int]) -> Any:
    """The model's sampled token for ``req`` when its scheduled chunk reaches its end."""
    from vllm.v1.outputs import ModelRunnerOutput

    rid = req.request_id
    ids = [rid] if rid in out.num_scheduled_tokens else []
    sampled = [[tokens[len(req.output_token_ids)]] if req.num_computed_tokens >= req.num_tokens
               else [] for _ in ids]
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=sampled)


def run_request(sched: Any, hasher: Any, rid: str, prompt: list[int], outputs: list[int],
                tenant: str | None, max_steps: int = 1_000_000) -> int | None:
    """Serve one request to completion; the prompt tokens found cached when it started.

    Returns None for a request vLLM cannot serve at this capacity (a step that schedules
    nothing while it is the only request: its prompt needs more blocks than the pool holds),
    after aborting it: the replay counts it as prompt tokens served without a hit, as
    :func:`hybridcache.sim.replay.replay` counts a request the manager refuses.
    """
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    outputs = outputs or [2]
    sp = SamplingParams(max_tokens=len(outputs), ignore_eos=True, temperature=0.0)
    req = Request(rid, prompt, sp, None, cache_salt=tenant, block_hasher=hasher)
    sched.add_request(req)
    hit = None
    for _ in range(max_steps):
        out = sched.schedule()
        if not out.num_scheduled_tokens:
            sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            return None
        if hit is None and out.scheduled_new_reqs:
            hit = req.num_computed_tokens - out.num_scheduled_tokens[rid]
        sched.update_from_output(out, _outputs(out, req, outputs))
        if req.is_finished():
            return hit or 0
    raise NativeUnavailable(f"vllm-native-best: request {rid} did not finish in {max_steps} steps")


def replay_native_best(
    trace: Trace,
    spec: ModelSpec,
    capacity: int,
    unit: int = 16,
    progress: Callable[[int], None] | None = None,
) -> RunResult:
    """Replay a token trace through vLLM's ``Scheduler`` at its strongest setting."""
    check_available(trace)
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vllm-native-best-") as tmp:
        sched = build_scheduler(spec, capacity, unit, Path(tmp))
    init_none_hash(sha256)
    hasher = get_request_block_hasher(unit, sha256)
    tally = Tally(spec)

    def serve(i: int, r: TraceRequest) -> None:
        assert r.input_ids is not None
        prompt = r.input_ids.tolist()
        outs = r.output_ids.tolist() if r.output_ids is not None else [2] * max(1, r.output_length)
        hit = run_request(sched, hasher, str(i), prompt, outs, r.tenant)
        if hit is None:
            tally.rejected += 1
            hit = 0
        tally.add(r.tenant or "", len(prompt), hit, hit)

    serve_each(trace.requests, serve, progress)
    res = tally.result("vllm-native-best", capacity, snapshots=-1, evictions=-1)
    res.wall_s = time.perf_counter() - t0
    res.settings = {"hash_unit": unit, "engine": "vllm Scheduler",
                    "prefix_match_unit": unit, "prefix_cache_retention_interval": None}
    return res
