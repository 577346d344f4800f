"""hybridcache inside vLLM on a CPU: a tiny hybrid model, a chat, our stats beside vLLM's.

Needs the vllm extra (``pip install 'hybridcache-llm[vllm]'``, x86-64 Linux). Builds its
own tiny random Qwen3-Next (nothing is downloaded), serves two chat sessions that share a
system prompt with hybridcache as vLLM's scheduler, and prints, per request, vLLM's count
of cached prompt tokens, then hybridcache's own metrics. Takes about a minute on 2 cores:

    python examples/vllm_cpu.py [--model-dir DIR]
"""

from __future__ import annotations

import os

# Set before vLLM is imported: the CPU KV cache size (GiB), no engine-core subprocess (so
# that this process can read the scheduler's stats), and no Hugging Face downloads.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import argparse  # noqa: E402
import random  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

SCHEDULER = "hybridcache.adapters.vllm.HybridCacheScheduler"
#: The metrics printed; ``scheduler.hybridcache_stats()`` returns many more.
SHOWN = ("served_token_hit_rate", "token_hit_rate", "request_hit_rate", "prefill_flops_saved_frac", "snapshots_saved",
         "kv_pages_registered", "evictions_kv", "evictions_state", "used_bytes", "block_size")


def chat(llm, rng: random.Random, turns: int = 3) -> list[tuple[str, int, int]]:
    """Two sessions on one system prompt; each turn's prompt is the whole history plus a
    new message. Returns (request, prompt tokens, tokens vLLM reports as cached)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    system = [rng.randrange(2, 512) for _ in range(300)]
    history = {"A": list(system), "B": list(system)}
    rows = []
    for turn in range(turns):
        names = list(history)
        for s in names:
            history[s] += [rng.randrange(2, 512) for _ in range(120)]
        outs = llm.generate([{"prompt_token_ids": history[s]} for s in names], sp, use_tqdm=False)
        for s, o in zip(names, outs):
            rows.append((f"session {s} turn {turn}", len(history[s]), o.num_cached_tokens or 0))
            history[s] += list(o.outputs[0].token_ids)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None, help="where to build the tiny model (default: a temp dir)")
    args = ap.parse_args()

    from vllm import LLM

    from hybridcache.adapters.hf.tiny import build_tiny_qwen3_next

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_qwen3_next(Path(args.model_dir or tmp) / "tiny-qwen3-next")
        llm = LLM(
            model=str(model), dtype="bfloat16", enforce_eager=True, max_num_seqs=4, seed=0,
            enable_prefix_caching=True, mamba_cache_mode="align", async_scheduling=False,
            scheduler_cls=SCHEDULER, additional_config={"hybridcache": {"eviction": "value"}},
        )
        rows = chat(llm, random.Random(1234))
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        print(f"\nvLLM block size {sched.block_size}")
        print(f"{'request':<18} {'prompt':>7} {'cached (vLLM num_cached_tokens)':>32}")
        for name, n, cached in rows:
            print(f"{name:<18} {n:>7} {cached:>32}")
        print(f"total cached prompt tokens (vLLM's count): {sum(r[2] for r in rows):,} "
              f"of {sum(r[1] for r in rows):,}")
        stats = sched.hybridcache_stats()
        print("hybridcache's own metrics (scheduler.hybridcache_stats()):")
        for k in SHOWN:
            v = stats[k]
            print(f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v:,}")


if __name__ == "__main__":
    main()
