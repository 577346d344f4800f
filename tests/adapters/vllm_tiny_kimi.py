"""Build a tiny, randomly initialised Kimi-Linear-style checkpoint (KDA + GQA attention).

Nothing is downloaded: the tokenizer is the byte-level BPE of :mod:`vllm_tiny_model`
(trained here), the weights are random (seeded), and ``config.json`` is a Kimi Linear
config (``model_type="kimi_linear"``) whose architecture is hybridcache's
``HybridcacheKimiGQAForCausalLM`` (:mod:`hybridcache.adapters.vllm.kda_model`): vLLM's
``KimiK3DeltaAttention`` layers (full-rank gate, as Kimi K3) next to GQA full attention,
because vLLM's CPU build turns prefix caching off for MLA models on CPUs without AMX.

Sizes: 4 layers (KDA, attention, KDA, attention; Kimi Linear's 3:1 ratio would need 8 and
double the start-up), hidden 128, one KDA head of dim 64 (a small state keeps vLLM's
``align``-mode attention block a few hundred tokens, as for the tiny Qwen3-Next).
"""

from __future__ import annotations

import json
from pathlib import Path

KDA_HEAD_DIM = 64


def kimi_config(*, head_dim: int = KDA_HEAD_DIM, lower_bound: float | None = -5.0) -> dict:
    """The ``config.json`` of the tiny model."""
    linear = {
        "kda_layers": [1, 3],
        "full_attn_layers": [2, 4],
        "head_dim": head_dim,
        "num_heads": 1,
        "short_conv_kernel_size": 4,
        "use_full_rank_gate": True,
    }
    if lower_bound is not None:
        linear["gate_lower_bound"] = lower_bound
    return {
        "architectures": ["HybridcacheKimiGQAForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "linear_attn_config": linear,
        "tie_word_embeddings": False,
        "eos_token_id": 0,
        "pad_token_id": 1,
        "bos_token_id": 0,
        "torch_dtype": "bfloat16",
    }


def build_tiny_kimi(out_dir: Path, *, seed: int = 0) -> Path:
    """Write config, tokenizer and random bf16 weights of the tiny KDA model to ``out_dir``."""
    from types import SimpleNamespace

    import torch
    from safetensors.torch import save_file
    from vllm_tiny_model import train_tokenizer

    from hybridcache.adapters.vllm.kda_model import checkpoint_shapes

    out_dir.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out_dir)
    cfg = kimi_config()
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    gen = {"eos_token_id": 0, "pad_token_id": 1, "bos_token_id": 0}
    (out_dir / "generation_config.json").write_text(json.dumps(gen))
    shapes = checkpoint_shapes(SimpleNamespace(**cfg))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(shapes.items()):
        if name.endswith(("norm.weight", "layernorm.weight")):
            t = torch.ones(shape)
        elif name.endswith("A_log"):
            t = torch.rand(shape, generator=g) * 2 - 1
        elif name.endswith("dt_bias"):
            t = torch.randn(shape, generator=g) * 0.5
        elif name.endswith("conv1d.weight"):
            t = torch.randn(shape, generator=g) * 0.5
        else:  # projections and embeddings: ~ N(0, 1/fan_in)
            t = torch.randn(shape, generator=g) / shape[-1] ** 0.5
        tensors[name] = t.to(torch.bfloat16).contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir




# --------------------------------------------------------------------------- serving
# ``python vllm_tiny_kimi.py MODEL OUT.json --mode {off,native,native16,ours}`` runs the
# multi-turn workload below in a fresh process (vLLM keeps process-wide state) and writes
# per-request results; :func:`serve` wraps it for the tests.

SYSTEM_LEN = 300
USER_LENS = (200, 225, 60)
DOC_LEN = 600
QUESTION_LEN = 30
MAX_TOKENS = 16
SCHEDULER = "hybridcache.adapters.vllm.HybridCacheScheduler"
MODES = ("off", "native", "native16", "ours")


def _tokens(rng, n: int) -> list[int]:
    return [rng.randrange(2, 512) for _ in range(n)]


ECHO = 32  # with ``repeat``: tokens of the previous prompt's end that a new turn repeats


def engine_kwargs(model: str, mode: str, spec_tokens: int = 0,
                  scheduler_cls: str = SCHEDULER) -> dict:
    """``LLM(...)`` arguments of one mode (``native16``: vLLM's strongest documented
    setting, ``prefix_match_unit=16`` and ``prefix_cache_retention_interval=None``;
    ``scheduler_cls`` replaces ours in mode ``ours``: the mutation tests)."""
    kw: dict = dict(model=model, dtype="bfloat16", enforce_eager=True, max_num_seqs=4,
                    async_scheduling=False, seed=0, enable_prefix_caching=mode != "off",
                    gpu_memory_utilization=0.25)  # of host memory on CPU: a shared machine
    if mode != "off":
        kw["mamba_cache_mode"] = "align"
    if mode == "native16":
        kw.update(prefix_match_unit=16, prefix_cache_retention_interval=None)
    if mode == "ours":
        kw["scheduler_cls"] = scheduler_cls
    if spec_tokens:
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": spec_tokens,
                                    "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    return kw


def _workload(generate, repeat: bool) -> None:
    """Two sessions sharing a system prompt (three turns each, history grows with the
    answers), then a shared document asked three questions (one, then two at once).

    With ``repeat`` a later turn ends with the last ``ECHO`` tokens of the session's
    previous prompt, which the history follows with the model's answer: an n-gram drafter
    then proposes that answer, and a small model continues much like it did (measured on
    the tiny models: several drafts accepted per turn), so drafts are both accepted and
    rejected."""
    import random

    rng = random.Random(1234)
    system = _tokens(rng, SYSTEM_LEN)
    history = {"A": list(system), "B": list(system)}
    last_prompt: dict[str, list[int]] = {}
    for turn, n in enumerate(USER_LENS):
        batch = []
        for s in history:
            new = _tokens(rng, n + (7 if s == "B" else 0))
            if repeat and s in last_prompt:
                new = new[:-ECHO] + last_prompt[s][-ECHO:]
            history[s] += new
            last_prompt[s] = list(history[s])
            batch.append((f"session{s}-turn{turn}", list(history[s])))
        for (name, ids), out in zip(batch, generate(batch)):
            history[name[7]] = ids + out
    doc = _tokens(rng, DOC_LEN)
    generate([("doc-q0", doc + _tokens(rng, QUESTION_LEN))])
    generate([(f"doc-q{i}", doc + _tokens(rng, QUESTION_LEN + i)) for i in (1, 2)])


def kda_layers_of(llm) -> dict:
    """``{layer name: layer}`` of the KDA layers in an in-process engine."""
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    ctx = runner.vllm_config.compilation_config.static_forward_context
    return {k: v for k, v in ctx.items() if type(v).__name__.endswith("DeltaAttention")}


def _state_at(layers: dict, block: int, width: int) -> dict:
    """Conv (first ``width - 1`` columns) and recurrent state of ``block`` per KDA layer."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    out = {}
    for name, layer in layers.items():
        conv, rec = layer.kv_cache[0], layer.kv_cache[1]
        c = conv[block] if is_conv_state_dim_first() else conv[block].transpose(0, 1)
        out[name] = (c[:, : width - 1].float().clone(), rec[block].float().clone())
    return out


def hit_snapshot_states(llm, prompts: dict[str, tuple[list[int], int]]) -> dict:
    """States of the snapshots our scheduler restored at each prompt's hit boundary.

    A hit on a block boundary reads the manager's snapshot: a probe request hashes the
    prompt (no allocation) and the index names the snapshot of the boundary's unit. A hit
    inside a block (a sub-block tail, :mod:`hybridcache.adapters.vllm.fine`) reads the
    tail whose last unit ends at the boundary. Either way the slot's vLLM blocks are read
    from the KDA layers."""
    from hybridcache.hashing import TokenHasher

    km = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
    mgr, layers, out = km.manager, kda_layers_of(llm), {}
    width = kimi_config()["linear_attn_config"]["short_conv_kernel_size"]
    for name, (ids, boundary) in prompts.items():
        if boundary % km.block_size:
            tails = km.tails
            cfg = mgr.config
            hasher = TokenHasher(tails.unit, cfg.hash_algo, cfg.hash_seed)
            hasher.extend(list(ids[:boundary]))
            slot = tails.by_key[hasher.digests[boundary // tails.unit - 1]].slot
        else:
            mgr.add_request("probe", ids)
            try:
                digest = mgr.requests["probe"].hasher.digests[boundary // km.block_size - 1]
                slot = mgr.index.handles[digest].snap
            finally:
                mgr.free("probe", finished=False)
        (block,) = {km._state_blocks(slot, j) for j in range(len(km.mamba_ids))}
        out[name] = _state_at(layers, block, width)
    return out


def no_cache_states(llm, prefixes: dict[str, list[int]]) -> dict:
    """State after each prefix in a caching-off engine: run the prefix alone, step until it
    is computed, read its (only) state block."""
    from vllm import SamplingParams

    engine, out = llm.llm_engine, {}
    sched = engine.engine_core.engine_core.scheduler
    layers = kda_layers_of(llm)
    width = kimi_config()["linear_attn_config"]["short_conv_kernel_size"]
    for name, ids in prefixes.items():
        rid = f"capture-{name}"
        engine.add_request(rid, {"prompt_token_ids": ids}, SamplingParams(max_tokens=2))
        # The engine may add a suffix to the request id.
        key = next((k for k in sched.requests if k.startswith(rid)), None)
        while key is None or sched.requests[key].num_computed_tokens < len(ids):
            engine.step()
            key = next((k for k in sched.requests if k.startswith(rid)), None)
        rid = key
        groups = sched.kv_cache_config.kv_cache_groups
        ids_by_group = sched.kv_cache_manager.get_block_ids(rid)
        blocks = {ids_by_group[g][0] for g, grp in enumerate(groups)
                  if type(grp.kv_cache_spec).__name__ == "MambaSpec"}
        (block,) = blocks
        out[name] = _state_at(layers, block, width)
        while engine.has_unfinished_requests():
            engine.step()
    return out


def run(model: str, mode: str, spec_tokens: int, repeat: bool, probe: str | None,
        hits_from: str | None = None, scheduler_cls: str = SCHEDULER) -> dict:
    """Serve the workload in this process; ``probe`` saves KDA states (see :func:`serve`)."""
    import os
    import time

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(**engine_kwargs(model, mode, spec_tokens, scheduler_cls))
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    results: list[dict] = []

    def generate(named):
        outs = llm.generate([{"prompt_token_ids": ids} for _, ids in named], sp, use_tqdm=False)
        for (name, ids), o in zip(named, outs):
            lps = [{str(k): v.logprob for k, v in c.items()} for c in (o.outputs[0].logprobs or [])]
            results.append(dict(name=name, prompt=ids, num_cached_tokens=o.num_cached_tokens or 0,
                                output=list(o.outputs[0].token_ids), logprobs=lps))
        return [list(o.outputs[0].token_ids) for o in outs]

    _workload(generate, repeat)
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    res = dict(requests=results, block_size=sched.block_size, total_s=time.time() - t0,
               hybridcache=sched.hybridcache_stats() if hasattr(sched, "hybridcache_stats") else None)
    if probe and mode == "ours":
        import torch

        hits = {r["name"]: (r["prompt"], r["num_cached_tokens"]) for r in results
                if r["num_cached_tokens"] > 0}
        torch.save(hit_snapshot_states(llm, hits), probe)
    if probe and mode == "off" and hits_from:
        import torch

        other = json.loads(Path(hits_from).read_text())["requests"]
        prefixes = {r["name"]: r["prompt"][: r["num_cached_tokens"]] for r in other
                    if r["num_cached_tokens"] > 0}
        torch.save(no_cache_states(llm, prefixes), probe)
    return res


def serve(model: Path, out: Path, mode: str, *, spec_tokens: int = 0, repeat: bool = False,
          probe: Path | None = None, hits_from: Path | None = None,
          scheduler_cls: str = SCHEDULER) -> dict:
    """Run :func:`run` in a fresh process; returns its JSON (also written to ``out``).

    ``probe``: save KDA states there (``ours``: the snapshots at every hit boundary;
    ``off`` with ``hits_from``, another run's JSON: after the workload, the no-cache
    states at that run's hit boundaries)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, str(Path(__file__).resolve()), str(model), str(out), "--mode", mode,
           "--spec-tokens", str(spec_tokens)]
    cmd += ["--repeat"] if repeat else []
    cmd += ["--probe", str(probe)] if probe else []
    cmd += ["--hits-from", str(hits_from)] if hits_from else []
    cmd += ["--scheduler-cls", scheduler_cls]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return json.loads(out.read_text())


def _main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--mode", choices=MODES, default="ours")
    ap.add_argument("--spec-tokens", type=int, default=0)
    ap.add_argument("--repeat", action="store_true")
    ap.add_argument("--probe", default=None)
    ap.add_argument("--hits-from", default=None)
    ap.add_argument("--scheduler-cls", default=SCHEDULER)
    a = ap.parse_args()
    res = run(a.model, a.mode, a.spec_tokens, a.repeat, a.probe, a.hits_from, a.scheduler_cls)
    Path(a.out).write_text(json.dumps(res))


if __name__ == "__main__":  # pragma: no cover - python vllm_tiny_kimi.py MODEL OUT [opts]
    import sys as _sys

    _sys.path.insert(0, str(Path(__file__).parent))
    if len(_sys.argv) == 2:
        print(build_tiny_kimi(Path(_sys.argv[1])))
    else:
        _main()
