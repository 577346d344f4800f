"""Drive vLLM's real ``Scheduler`` without a model: fake outputs and a simulated worker.

vLLM's scheduler tests feed ``update_from_output`` with made-up sampled tokens. This
harness does that and, in addition, simulates what vLLM's worker does with the blocks the
scheduler hands out, so that a wrong block mapping fails loudly instead of only skewing
hit counts:

- attention blocks: each written position records the token it holds; before a step
  "reads" a request's KV, every position ``< end`` of its block table must hold the
  request's token at that position (a shared or stale page would not);
- Mamba/GDN blocks in ``align`` mode (``preprocess_mamba``): the running state lives in
  column ``(seq_len - 1) // block_size``; when a step moves to a new column the previous
  column's block is copied into the new one; the step then requires the state it starts
  from to be *exactly* the state after ``start`` tokens of this request (a digest of the
  prefix), and writes the state after ``end`` tokens;
- zeroing of new attention blocks and the scheduler's block copies are applied.

Sampled tokens are a deterministic function of the request's tokens so far, so a request
produces the same output whatever was cached (as a real model would).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridcache.config import CacheConfig

BLOCK = 64
NUM_LAYERS = 4


def write_config_dir(path: Path) -> Path:
    """A config-only Qwen3-Next checkpoint directory (no weights: the scheduler needs none)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": NUM_LAYERS,
        "layer_types": ["linear_attention", "full_attention"] * (NUM_LAYERS // 2),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 1,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "torch_dtype": "bfloat16",
        "eos_token_id": 0,
    }
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def make_scheduler(model_dir: Path, scheduler_cls: type, num_blocks: int, *, max_num_seqs: int = 8,
                   max_batched: int = 1024, additional_config: dict | None = None,
                   mamba_cache_mode: str = "align", mamba_groups: int = 1,
                   long_prefill_token_threshold: int = 0,
                   kv_transfer_config: Any = None, prefix_match_unit: int | None = None,
                   retention: int | None | str = "default", kv_events_config: Any = None) -> Any:
    """A scheduler over a hand-built hybrid ``KVCacheConfig``.

    ``prefix_match_unit`` hashes at that unit inside the block (vLLM's fine-grained hits;
    our sub-block tails); ``retention`` is vLLM's ``prefix_cache_retention_interval``
    (``None``: keep every state; its strongest setting with ``prefix_match_unit``).

    ``mamba_groups`` GDN groups (vLLM splits many recurrent layers into several groups of
    one block table each) and one attention group. ``kv_transfer_config`` (a vLLM
    ``KVTransferConfig``) configures a KV connector.
    """
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(model=str(model_dir), dtype="bfloat16", seed=0,
                               skip_tokenizer_init=True, max_model_len=8192)
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched, max_model_len=8192,
            enable_chunked_prefill=True, async_scheduling=False, is_encoder_decoder=False,
            long_prefill_token_threshold=long_prefill_token_threshold,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True,
                                 mamba_cache_mode=mamba_cache_mode,
                                 prefix_match_unit=prefix_match_unit,
                                 **({} if retention == "default"
                                    else {"prefix_cache_retention_interval": retention})),
        additional_config=additional_config or {},
        kv_transfer_config=kv_transfer_config,
        kv_events_config=kv_events_config,
    )
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 130), (1, 128, 128)),
                      dtypes=(torch.bfloat16, torch.float32), mamba_cache_mode=mamba_cache_mode,
                      mamba_type=MambaAttentionBackendEnum.GDN_ATTN)
    attn = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"layers.{2 * g}.linear_attn"], mamba) for g in range(mamba_groups)
        ] + [KVCacheGroupSpec(["layers.1.self_attn", "layers.3.self_attn"], attn)],
        # As vLLM's engine builds it: sparse Mamba retention (the CacheConfig default 0),
        # hashing at the block size.
        prefix_cache_retention_interval=vllm_config.cache_config.prefix_cache_retention_interval,
        hash_block_size=prefix_match_unit or BLOCK,
        cache_hit_alignment_tokens=prefix_match_unit or BLOCK,
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
        hash_block_size=prefix_match_unit or BLOCK,
        log_stats=True,
    )


def prefix_digest(tokens: list[int]) -> str:
    return hashlib.sha256(repr(tokens).encode()).hexdigest()[:16]


def fake_token(tokens: list[int]) -> int:
    """The 'model': next token is a function of the whole sequence so far."""
    return 2 + int(prefix_digest(tokens), 16) % 500


def mirror_tables(out: Any, tables: dict[str, list[list[int]]], state_col: dict[str, int]) -> set[str]:
    """Apply a scheduler output's block tables as vLLM's worker does (new, resumed and
    extended requests); returns the requests whose table is new (their state column too)."""
    fresh = set()
    for nr in out.scheduled_new_reqs:
        tables[nr.req_id] = [list(t) for t in nr.block_ids]
        state_col.pop(nr.req_id, None)
        fresh.add(nr.req_id)
    cached = out.scheduled_cached_reqs
    for i, rid in enumerate(cached.req_ids):
        new = cached.new_block_ids[i]
        if rid in cached.resumed_req_ids:
            tables[rid] = [list(t) for t in new]
            state_col.pop(rid, None)
            fresh.add(rid)
        elif new is not None:
            for t, extra in zip(tables[rid], new):
                t.extend(extra)
    return fresh


@dataclass
class SimWorker:
    """Worker-side view of blocks (see module docstring); raises AssertionError on misuse."""

    block_size: int
    mamba_groups: list[int]
    attn_groups: list[int]
    kv: dict[tuple[int, int], int] = field(default_factory=dict)  # (block, pos) -> token
    state: dict[int, tuple[int, str]] = field(default_factory=dict)  # block -> (n, digest)
    tables: dict[str, list[list[int]]] = field(default_factory=dict)
    state_col: dict[str, int] = field(default_factory=dict)
    steps: int = 0

    def apply(self, out: Any, requests: dict[str, Any]) -> None:
        self.steps += 1
        self.apply_block_ops(out)
        mirror_tables(out, self.tables, self.state_col)
        self._check_disjoint(out, requests)
        self._run_all(out, requests)

    def apply_block_ops(self, out: Any) -> None:
        """What vLLM's worker does to blocks before the step's tables (``_update_states``):
        forget finished / preempted requests, zero new blocks, then run the scheduler's
        ``kv_cache_block_copies`` (whole blocks, in order)."""
        for rid in list(out.finished_req_ids) + list(out.preempted_req_ids or ()):
            self.tables.pop(rid, None)
            self.state_col.pop(rid, None)
        for b in out.new_block_ids_to_zero or ():
            for pos in range(self.block_size):
                self.kv.pop((b, pos), None)
            self.state.pop(b, None)
        for c in out.kv_cache_block_copies or ():
            self._copy(c.src_block_id, c.dst_block_id)

    def _check_disjoint(self, out: Any, requests: dict[str, Any]) -> None:
        """Blocks written this step: a running state block is nobody's KV page, nor shared."""
        pages: set[int] = set()
        states: dict[int, str] = {}
        bs = self.block_size
        for rid in out.num_scheduled_tokens:
            table = self.tables[rid]
            end = requests[rid].num_computed_tokens
            for g in self.attn_groups:
                pages.update(b for b in table[g][: -(-end // bs)])
            for g in self.mamba_groups:
                b = table[g][(end - 1) // bs]
                assert b != 0, f"{rid}: running state in the null block"
                assert b not in states, f"{rid} and {states.get(b)} compute in block {b}"
                states[b] = rid
        both = pages & set(states)
        assert not both, f"blocks {sorted(both)} are both KV pages and running states"

    def _copy(self, src: int, dst: int) -> None:
        for pos in range(self.block_size):
            if (src, pos) in self.kv:
                self.kv[(dst, pos)] = self.kv[(src, pos)]
            else:
                self.kv.pop((dst, pos), None)
        if src in self.state:
            self.state[dst] = self.state[src]
        else:
            self.state.pop(dst, None)

    def _write_state(self, block: int, value: tuple[int, str]) -> None:
        # One block of memory: writing a state clobbers any KV the block held (vLLM's GPU
        # layouts share a block's bytes between groups; assume the worst).
        for pos in range(self.block_size):
            self.kv.pop((block, pos), None)
        self.state[block] = value

    def _run_all(self, out: Any, requests: dict[str, Any]) -> None:
        """One step as the worker orders it: state copies, then the forward pass."""
        bs = self.block_size
        spans = {}
        for rid, n in out.num_scheduled_tokens.items():
            req = requests[rid]
            start = req.num_computed_tokens - n  # the scheduler already advanced it
            spans[rid] = (start, start + n, list(req.all_token_ids))
        for rid, (start, end, _) in spans.items():  # preprocess_mamba
            curr = (end - 1) // bs
            prev = self.state_col.get(rid, (start - 1) // bs if start else -1)
            for g in self.mamba_groups:
                col = self.tables[rid][g]
                assert len(col) > curr, f"{rid}: state column {curr} missing"
                if prev != -1 and prev != curr:
                    assert col[prev] != 0, f"{rid}: copy from the null block (column {prev})"
                    self._copy(col[prev], col[curr])
            self.state_col[rid] = curr
        for rid, (start, end, tokens) in spans.items():  # KV writes of the forward pass
            for g in self.attn_groups:
                for pos in range(start, end):
                    b = self.tables[rid][g][pos // bs]
                    self.state.pop(b, None)
                    self.kv[(b, pos % bs)] = tokens[pos]
        for rid, (start, end, tokens) in spans.items():  # attention reads, state update
            table = self.tables[rid]
            for g in self.attn_groups:
                for pos in range(end):
                    got = self.kv.get((table[g][pos // bs], pos % bs))
                    assert got == tokens[pos], f"{rid}: KV at {pos} holds {got}, not {tokens[pos]}"
            for g in self.mamba_groups:
                block = table[g][(end - 1) // bs]
                want = (start, prefix_digest(tokens[:start]))
                if start:
                    got = self.state.get(block)
                    assert got == want, f"{rid}: starts from state {got}, needs {want}"
                self._write_state(block, (end, prefix_digest(tokens[:end])))


def model_output(out: Any, requests: dict[str, Any]) -> Any:
    """Sampled tokens for requests whose scheduled chunk reaches the end of their tokens."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = requests[rid]
        done_prefill = req.num_computed_tokens >= req.num_tokens
        sampled.append([fake_token(list(req.all_token_ids))] if done_prefill else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


@dataclass
class Turn:
    """One request of a session: new tokens after the history, and tokens to generate."""

    new_tokens: list[int]
    max_tokens: int


def tokens(rng: random.Random, n: int) -> list[int]:
    """``n`` token ids in ``[2, 500)`` drawn from ``rng``."""
    return [rng.randrange(2, 500) for _ in range(n)]


def decoding_sessions(seed: int) -> dict[str, list[Turn]]:
    """8 sessions of 3 turns, 60-200 new tokens a turn and 100-300-token answers: many
    requests decode at once, so a step ends on block boundaries for several of them
    together, and a tight pool preempts."""
    rng = random.Random(seed)
    return {f"s{i}": [Turn(tokens(rng, rng.randint(60, 200)), rng.randint(100, 300))
                      for _ in range(3)] for i in range(8)}


def record_steps(scheduler: Any) -> list[tuple[set[str], int]]:
    """Record each step of ``scheduler`` from now on: the ids it scheduled and the tokens
    (a preempted request's recomputation included). The list fills as the scheduler runs."""
    steps: list[tuple[set[str], int]] = []
    schedule = scheduler.schedule

    def recorded() -> Any:
        out = schedule()
        steps.append((set(out.num_scheduled_tokens), out.total_num_scheduled_tokens))
        return out

    scheduler.schedule = recorded
    return steps


def chats_and_document(seed: int, *, chats: int, turns: int, first: tuple[int, int],
                       later: tuple[int, int], answers: tuple[int, int],
                       questions: int) -> dict[str, list[Turn]]:
    """``chats`` sessions ``s0, s1, ...`` of ``turns`` turns on one 150-token system prompt,
    then ``questions`` one-turn requests ``d0, d1, ...`` on one 300-token document.

    Chat ``i``'s first user turn has ``first[0] + first[1] * i`` tokens after the system
    prompt, its turn ``k + 1`` has ``later[0] + later[1] * k``; the first turn generates
    ``answers[0]`` tokens, later turns ``answers[1]``. Question ``i`` is the document plus
    ``10 + i`` tokens and generates 8.
    """
    rng = random.Random(seed)
    system = tokens(rng, 150)
    sessions = {
        f"s{i}": [Turn(system + tokens(rng, first[0] + first[1] * i), answers[0])]
        + [Turn(tokens(rng, later[0] + later[1] * k), answers[1]) for k in range(turns - 1)]
        for i in range(chats)
    }
    doc = tokens(rng, 300)
    for i in range(questions):
        sessions[f"d{i}"] = [Turn(doc + tokens(rng, 10 + i), 8)]
    return sessions


DEFAULT_ADMISSION = CacheConfig().admission  # the library's default rules


def random_stream(seed: int) -> tuple[dict[str, list[Turn]], dict]:
    """Random sessions around a shared prefix whose length straddles block boundaries, and
    ``make_scheduler`` keywords (pool size, token budget, admission and eviction)."""
    rng = random.Random(seed)
    b = BLOCK
    shared = tokens(rng, rng.choice([b - 1, b, b + 1, 2 * b, 150, 3 * b + 5]))
    sessions = {}
    for i in range(rng.randint(2, 7)):
        first = (shared if rng.random() < 0.7 else []) + tokens(rng, rng.randint(1, 200))
        turns = [Turn(first, rng.randint(1, 70))]
        turns += [Turn(tokens(rng, rng.randint(1, 150)), rng.randint(1, 70))
                  for _ in range(rng.randint(0, 3))]
        sessions[f"s{i}"] = turns
    kw = dict(
        num_blocks=rng.choice([24, 40, 80, 400]),
        max_batched=rng.choice([64, 100, 1024]),
        additional_config={"hybridcache": {
            "admission": rng.choice([DEFAULT_ADMISSION, DEFAULT_ADMISSION + "+interval:128",
                                     "last-token", "chunk-end+turn-end"]),
            "eviction": rng.choice(["value", "lru", "marconi"]),
        }},
    )
    return sessions, kw


def assert_native_clean(sched: Any) -> None:
    """vLLM's manager: every block but the null block is free again."""
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == sched.kv_cache_config.num_blocks - 1


def assert_ours_clean(sched: Any) -> None:
    """Every page / slot still in use belongs to a cached entry (or is the null page)."""
    mgr = sched.kv_cache_manager
    assert mgr.num_tracked == 0 and not mgr.manager.requests
    nodes = list(mgr.manager.index.nodes.values())
    pages = sum(len(n.pages) for n in nodes if n.pages is not None)
    snaps = sum(1 for n in nodes if n.snap >= 0)
    arena = mgr.manager.arena
    tails = list(mgr.tails.lru) if mgr.tails is not None else []  # sub-block tails' copies
    assert arena.pages_in_use == 1 + pages + sum(len(t.pages) for t in tails)
    assert arena.slots_in_use == snaps + len(tails)
    if mgr.tails is not None:
        # Copies of the last step may still be listed (run, awaiting the next step).
        assert all(p.emitted for p in mgr.tails.pending) and not mgr.tails.hashers
    assert mgr.stats_counters.saves_dropped == 0
    # Every page and slot owned once: by an entry, or by the adapter through its port (the
    # null page, tails' copies), which also recounts the index and arena.
    mgr.port.check_invariants()


@dataclass
class DriveResult:
    """Per request: tokens found cached when first scheduled; outputs; step count."""

    hits: dict[str, int]
    outputs: dict[str, list[int]]
    prompt_lens: dict[str, int]
    preemptions: int
    steps: int
    worker: SimWorker | None = None


def run_sessions(scheduler: Any, sessions: dict[str, list[Turn]],
                 step: Callable[[Any, dict[str, Any]], Any], *,
                 salts: dict[str, str | None] | None = None, max_steps: int,
                 extra_args: dict[str, Any] | None = None) -> DriveResult:
    """Run every session's turns (the next turn's prompt is the whole history) to the end.

    All sessions start together; a session submits its next turn when the previous one
    finishes. ``step(out, live)`` plays the worker for one ``SchedulerOutput`` and returns
    the ``ModelRunnerOutput`` handed to ``update_from_output``. ``salts`` gives a session's
    ``cache_salt``; ``extra_args`` are every request's ``SamplingParams.extra_args``.
    """
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(scheduler.hash_block_size, sha256)
    salts = salts or {}
    history = {s: [] for s in sessions}
    nxt = dict.fromkeys(sessions, 0)
    live: dict[str, Any] = {}
    res = DriveResult({}, {}, {}, 0, 0)

    def submit(s: str) -> None:
        turn = sessions[s][nxt[s]]
        rid = f"{s}/{nxt[s]}"
        history[s] = history[s] + turn.new_tokens
        sp = SamplingParams(max_tokens=turn.max_tokens, ignore_eos=True, temperature=0.0,
                            extra_args=extra_args)
        req = Request(rid, list(history[s]), sp, None, cache_salt=salts.get(s),
                      block_hasher=hasher)
        live[rid] = req
        res.prompt_lens[rid] = len(history[s])
        scheduler.add_request(req)

    for s in sessions:
        submit(s)
    for _ in range(max_steps):
        if not live:
            break
        out = scheduler.schedule()
        res.preemptions += len(out.preempted_req_ids or ())
        for nr in out.scheduled_new_reqs:
            n = out.num_scheduled_tokens[nr.req_id]
            res.hits.setdefault(nr.req_id, live[nr.req_id].num_computed_tokens - n)
        scheduler.update_from_output(out, step(out, live))
        for rid, req in list(live.items()):
            if req.is_finished():
                del live[rid]
                s, k = rid.split("/")
                res.outputs[rid] = list(req.output_token_ids)
                history[s] = list(req.all_token_ids)
                nxt[s] = int(k) + 1
                if nxt[s] < len(sessions[s]):
                    submit(s)
        res.steps += 1
    assert not live, f"requests still running after {max_steps} steps: {sorted(live)}"
    return res


def drive(scheduler: Any, sessions: dict[str, list[Turn]], *, max_steps: int = 20000,
          worker: SimWorker | None = None, extra_args: dict[str, Any] | None = None) -> DriveResult:
    """:func:`run_sessions` with every step going through :class:`SimWorker` (so a wrong
    block fails here) and :func:`model_output`; pass the previous result's ``worker`` to
    drive the same scheduler again.
    """
    kvc = scheduler.kv_cache_config
    mamba = [i for i, g in enumerate(kvc.kv_cache_groups) if "linear" in g.layer_names[0]]
    attn = [i for i in range(len(kvc.kv_cache_groups)) if i not in mamba]
    worker = worker or SimWorker(scheduler.block_size, mamba, attn)

    def step(out: Any, live: dict[str, Any]) -> Any:
        worker.apply(out, live)
        return model_output(out, live)

    res = run_sessions(scheduler, sessions, step, max_steps=max_steps, extra_args=extra_args)
    res.worker = worker
    return res
