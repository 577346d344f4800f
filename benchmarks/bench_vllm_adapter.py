"""CPU time of vLLM's real scheduler with ``HybridCacheScheduler``, and the share spent in
the adapter's KV cache manager (its methods vLLM calls, core and port calls included).

    python benchmarks/bench_vllm_adapter.py [--rounds 5]

A multi-turn chat and shared-document workload (24 sessions of 6 turns, 24 questions; the
scheduler-level harness of ``tests/adapters``: a hand-built tiny Qwen3-Next cache layout,
no model forward) runs to the end ``--rounds`` times; each round prints the process CPU
seconds of the whole run and of the adapter's methods. Process time, not wall time: on a
shared machine wall time swings by 2x between runs. To compare two commits, run this in
alternating processes with each tree first on ``PYTHONPATH`` (an old commit exported with
``git archive``, with ``hybridcache/adapters`` linked to its ``adapters/``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

#: The adapter's methods vLLM's scheduler calls (timed at the outermost call only).
VLLM_CALLS = (
    "get_computed_blocks", "allocate_slots", "new_step_starts", "free", "next_save_boundary",
    "take_kv_cache_block_copies", "take_new_block_ids", "cache_blocks", "get_block_ids",
    "get_blocks", "num_free_blocks", "take_events", "record_prefix_cache_stats",
    "estimate_cached_tokens", "record_blocks_for_zeroing", "remove_skipped_blocks",
)


def _timed(cls: type, spent: list[float]) -> None:
    """Wrap ``cls``'s scheduler-facing methods so that their CPU time adds up in ``spent``."""
    depth = [0]

    def wrap(f):  # noqa: ANN001, ANN202 - any method
        @functools.wraps(f)
        def g(*a, **k):  # noqa: ANN002, ANN003, ANN202
            if depth[0]:
                return f(*a, **k)
            depth[0] += 1
            t = time.process_time()
            try:
                return f(*a, **k)
            finally:
                spent[0] += time.process_time() - t
                depth[0] -= 1
        return g

    for name in VLLM_CALLS:
        setattr(cls, name, wrap(getattr(cls, name)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # the harness in tests/
    from hybridcache.adapters.vllm import manager as adapter
    from hybridcache.adapters.vllm.scheduler import HybridCacheScheduler
    from tests.adapters import vllm_sched_harness as h

    spent = [0.0]
    _timed(adapter.HybridKVCacheManager, spent)
    model_dir = h.write_config_dir(Path(tempfile.mkdtemp()))
    total, inside = [], []
    for r in range(args.rounds):
        sessions = h.chats_and_document(r, chats=24, turns=6, first=(40, 30), later=(30, 20),
                                        answers=(30, 20), questions=24)
        sched = h.make_scheduler(model_dir, HybridCacheScheduler, 400, max_batched=256)
        gc.collect()
        spent[0] = 0.0
        t0 = time.process_time()
        res = h.run_sessions(sched, sessions, lambda out, live: h.model_output(out, live),
                             max_steps=20000)
        total.append(time.process_time() - t0)
        inside.append(spent[0])
        hit = sched.kv_cache_manager.stats()["served_token_hit_rate"]
    print(f"{adapter.__file__}: {res.steps} steps, served token hit rate {hit:.4f}")
    print("whole run, CPU s:", " ".join(f"{t:.3f}" for t in total),
          f"(median {statistics.median(total):.3f})")
    print("adapter,   CPU s:", " ".join(f"{t:.3f}" for t in inside),
          f"(median {statistics.median(inside):.3f})")


if __name__ == "__main__":
    main()
