"""Preemptions in vLLM's real scheduler: save points taken back within a step, and the admission gate.

    python benchmarks/bench_vllm_withdrawal.py [--blocks 30,60,120] [--seeds 1,2,3,4]
                                               [--admission adaptive,default]
                                               [--workload decode|chat-docs]

vLLM allocates the whole batch before the worker runs it, so every save slot of the batch
is held at once (hybridcache.pending_saves). This runs the scheduler-level harness of
``tests/adapters`` (a hand-built tiny Qwen3-Next cache layout, a simulated worker that
checks every block, no model forward) over 8 sessions of 3 turns with 100-300-token
answers (``decode``; ``chat-docs``: the scheduler tests' 4 chats of 4 turns on a shared
system prompt and 3 questions on one document, short answers), in pools of ``--blocks`` blocks, and prints per pool the preemptions, the cached
tokens found, the tokens computed (prefill and decode, a preempted request's recomputation
included: the work the cache did not save) and the scheduler steps, summed over ``--seeds``:

- ``vllm``: vLLM's own manager at its default, and at its strongest setting
  (``prefix_match_unit`` 16, ``prefix_cache_retention_interval`` None);
- ours with each ``--admission`` (``default`` is the library's default rules; ``adaptive``
  the self-tuning policy), with save points taken back within a step (``withdraw``) and
  without (``keep``: the adapter's ``withdraws_saves`` switched off in this process only),
  each with the adapter's admission gate counting the pages running prefills still owe
  (``reserves_prefills``, the default) and with vLLM's plain gate (``vLLM gate``).

Outputs must be identical across all runs (the script asserts it). Counts, not time: no
rounds to alternate.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "adapters"))

import vllm_sched_harness as h  # noqa: E402


def sessions(seed: int, workload: str = "decode") -> dict[str, list[h.Turn]]:
    if workload == "chat-docs":
        return h.chats_and_document(seed, chats=4, turns=4, first=(40, 13), later=(30, 7),
                                    answers=(20, 24), questions=3)
    return h.decoding_sessions(seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="30,60,120")
    ap.add_argument("--seeds", default="1,2,3,4")
    ap.add_argument("--admission", default="adaptive,default")
    ap.add_argument("--workload", choices=("decode", "chat-docs"), default="decode")
    args = ap.parse_args()
    from vllm.v1.core.sched.scheduler import Scheduler

    from hybridcache.adapters.vllm import HybridCacheScheduler
    from hybridcache.adapters.vllm.manager import HybridKVCacheManager

    model_dir = h.write_config_dir(Path(tempfile.mkdtemp()) / "model")
    seeds = [int(s) for s in args.seeds.split(",")]
    names = {"default": h.DEFAULT_ADMISSION, "adaptive": "adaptive"}
    print(f"{'blocks':>6} {'setting':<34} {'preempted':>9} {'cached':>7} {'computed':>8} {'steps':>6} "
          f"{'taken back':>10}")
    for blocks in (int(b) for b in args.blocks.split(",")):
        runs: list[tuple[str, dict]] = [
            ("vllm default", {}), ("vllm unit 16, retention None", {"prefix_match_unit": 16, "retention": None})]
        for adm in args.admission.split(","):
            for allow, reserve in ((True, True), (False, True), (True, False), (False, False)):
                label = f"{'withdraw' if allow else 'keep'}{'' if reserve else ', vLLM gate'}"
                runs.append((f"{adm} {label}",
                             {"additional_config": {"hybridcache": {"admission": names.get(adm, adm)}},
                              "allow": allow, "reserve": reserve}))
        outputs = None
        for name, kw in runs:
            kw = dict(kw)
            allow = kw.pop("allow", None)
            reserve = kw.pop("reserve", None)
            cls = Scheduler if allow is None else HybridCacheScheduler
            if allow is not None:
                HybridKVCacheManager.withdraws_saves = allow
                HybridKVCacheManager.reserves_prefills = reserve
            tot = [0, 0, 0, 0, 0]
            outs = {}
            for seed in seeds:
                sched = h.make_scheduler(model_dir, cls, num_blocks=blocks, **kw)
                steps = h.record_steps(sched)
                res = h.drive(sched, sessions(seed, args.workload))
                tot[4] += sum(n for _, n in steps)
                outs.update({f"{seed}:{rid}": out for rid, out in res.outputs.items()})
                tot[0] += res.preemptions
                tot[1] += sum(res.hits.values())
                tot[2] += res.steps
                if allow is not None:
                    tot[3] += sched.kv_cache_manager.stats_counters.saves_withdrawn
                    sched.kv_cache_manager.port.check_invariants()
            assert outputs is None or outs == outputs, f"{name}: outputs differ"
            outputs = outs
            print(f"{blocks:>6} {name:<34} {tot[0]:>9} {tot[1]:>7} {tot[4]:>8} {tot[2]:>6} {tot[3]:>10}",
                  flush=True)
    HybridKVCacheManager.withdraws_saves = True
    HybridKVCacheManager.reserves_prefills = True


if __name__ == "__main__":
    main()
