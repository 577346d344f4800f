"""Serve a multi-turn workload with vLLM (native or with hybridcache) and dump the results.

Run as a script in a fresh process (vLLM keeps process-wide state)::

    python vllm_e2e_workload.py MODEL_DIR OUT.json [--scheduler-cls QUALNAME]
        [--additional-config JSON] [--kv-transfer-config JSON]

The workload (token ids drawn from a seeded RNG, so both runs see the same prompts):

1. two chat sessions sharing one system prompt; each turn's prompt is the whole history
   (system prompt, earlier user turns and the model's answers) plus a new user turn;
   the two sessions run side by side, turn by turn;
2. a shared document with one question, then two more questions on it in one batch;
3. with ``--workload late``: two more sessions on the system prompt, started one after the
   other once the first ones are done, and a fourth question on the document.

Output JSON: ``{"requests": [{"name", "prompt_len", "num_cached_tokens", "output",
"logprobs"}],
"block_size", "hybridcache": stats or null, "connector": HybridCacheConnector counters or
null, "startup_s", "total_s"}``.

For the tests, :func:`serve` runs this script in a fresh process and returns that JSON,
and :func:`check_same_greedy` compares two runs' outputs (see ``test_vllm_e2e.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

SYSTEM_LEN = 300
USER_LENS = (200, 225, 60)
DOC_LEN = 600
QUESTION_LEN = 30
LATE_USER_LENS = (190, 150)
MAX_TOKENS = 24

#: Logprobs recorded per position: a random tiny model's next-token distribution is nearly
#: flat (logprobs near -5.6 over a 280-token vocabulary), so three tokens can tie within one
#: bf16 step (seen on an AMX CPU: the cached run picked the third of the other's top two).
TOP_LOGPROBS = 5
TOL = 0.02  # logprob tolerance of check_same_greedy (at least; see close())
SCHEDULER = "hybridcache.adapters.vllm.HybridCacheScheduler"


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 512) for _ in range(n)]


def sessions(generate, rng: random.Random, system: list[int], names: str,
             user_lens: tuple[int, ...]) -> None:
    """Chat sessions ``names`` side by side on ``system``; each turn's prompt is the whole
    history plus a new user turn (session ``i`` adds ``7 * i`` tokens to each turn)."""
    history = {s: list(system) for s in names}
    for turn, n in enumerate(user_lens):
        batch = []
        for i, s in enumerate(names):
            history[s] += _tokens(rng, n + 7 * i)
            batch.append((f"session{s}-turn{turn}", list(history[s])))
        for (name, ids), out in zip(batch, generate(batch)):
            history[name[7]] = ids + out


def run(model: str, scheduler_cls: str | None, additional: dict | None, dtype: str,
        kv_transfer: dict | None = None, engine: dict | None = None,
        workload: str = "base") -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    t0 = time.time()
    kw: dict = dict(
        model=model,
        dtype=dtype,
        enforce_eager=True,
        enable_prefix_caching=True,
        max_num_seqs=4,
        async_scheduling=False,
        seed=0,
    )
    if scheduler_cls:
        kw["scheduler_cls"] = scheduler_cls
    if additional:
        kw["additional_config"] = additional
    if kv_transfer:
        kw["kv_transfer_config"] = kv_transfer
    kw.update(engine or {})
    llm = LLM(**kw)
    startup = time.time() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_LOGPROBS)
    rng = random.Random(1234)
    results: list[dict] = []

    def generate(named: list[tuple[str, list[int]]]) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": ids} for _, ids in named], sp, use_tqdm=False)
        got = []
        for (name, ids), o in zip(named, outs):
            out = list(o.outputs[0].token_ids)
            # Per position, the logprobs of the top tokens and of the chosen one (to tell
            # a numerical near-tie from a real divergence).
            lps = [
                {str(k): v.logprob for k, v in cand.items()}
                for cand in (o.outputs[0].logprobs or [])
            ]
            results.append(
                dict(name=name, prompt_len=len(ids), num_cached_tokens=o.num_cached_tokens or 0,
                     output=out, logprobs=lps)
            )
            got.append(out)
        return got

    system = _tokens(rng, SYSTEM_LEN)
    sessions(generate, rng, system, "AB", USER_LENS)
    doc = _tokens(rng, DOC_LEN)
    generate([("doc-q0", doc + _tokens(rng, QUESTION_LEN))])
    generate([(f"doc-q{i}", doc + _tokens(rng, QUESTION_LEN + i)) for i in (1, 2)])
    if workload == "late":
        # Users who come later: two more sessions on the same system prompt, one after
        # the other, and a third question on the document.
        sessions(generate, rng, system, "C", LATE_USER_LENS)
        sessions(generate, rng, system, "D", LATE_USER_LENS)
        generate([("doc-q3", doc + _tokens(rng, QUESTION_LEN + 3))])

    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    stats = sched.hybridcache_stats() if hasattr(sched, "hybridcache_stats") else None
    return dict(
        requests=results,
        block_size=sched.block_size,
        hybridcache=stats,
        connector=_connector_stats(sched),
        startup_s=startup,
        total_s=time.time() - t0,
    )


def _connector_stats(sched) -> dict | None:
    """Both roles' counters of a HybridCacheConnector (one process: the worker's connector
    is vLLM's process-wide KV transfer group); waits for queued saves to reach the tier."""
    if not hasattr(sched.connector, "scheduler_stats"):
        return None
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group()
    worker.tier.flush(timeout_s=30)
    return dict(scheduler=sched.connector.scheduler_stats(), worker=worker.worker_stats())


def serve(model: Path, out: Path, *extra: str, env_extra: dict | None = None) -> dict:
    """Run the workload on ``model`` in a fresh process (``extra``: this script's options,
    ``env_extra``: environment, e.g. ``HYBRIDCACHE_VLLM_COPY_FIX=0``) and return its output
    JSON (also written to ``out``)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false",
               **(env_extra or {}))
    cmd = [sys.executable, str(Path(__file__).resolve()), str(model), str(out), *extra]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return json.loads(out.read_text())


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def bf16_ulp(x: float) -> float:
    """One bfloat16 rounding step at magnitude ``x`` (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(x)) - 7) if x > 0 else 2.0 ** -133


def close(x: float, y: float, tol: float = 0.0) -> bool:
    """``|x - y|`` below ``TOL`` or one bfloat16 rounding step at their magnitude.

    The logits are bf16: at a logprob of -5.55 one bf16 step is 2**-5 = 0.031, wider than
    ``TOL``, and a CPU whose bf16 matrix kernels block by the batch shape (AMX) moves values
    by that step when a run resumes from a different cached prefix (measured: 0.027 on
    sessionA-turn1, the same on the commit before any change of ours). A state or a page
    taken from the wrong prefix moves logprobs by far more, from the first token on.
    """
    return abs(x - y) < max(TOL, bf16_ulp(max(abs(x), abs(y))), tol)


def worst_deviation(ref: dict, run: dict) -> float:
    """Largest logprob difference from ``ref`` at ``ref``'s chosen tokens, up to and at each
    request's first divergence: how far a run's rounding moved it (``test_vllm_fine_e2e``
    measures vLLM's own prefix caching against caching off this way)."""
    worst = 0.0
    for a, b in zip(ref["requests"], run["requests"]):
        d = first_divergence(a["output"], b["output"])
        for i in range(len(a["output"]) if d is None else d + 1):
            tok = str(a["output"][i])
            if tok in b["logprobs"][i]:
                worst = max(worst, abs(a["logprobs"][i][tok] - b["logprobs"][i][tok]))
    return worst


def check_same_greedy(native: dict, ours: dict, tol: float = 0.0) -> list[str]:
    """Assert identity up to bf16 near-ties (``test_vllm_e2e.py``'s module docstring): the
    same tokens, or a first divergence where both runs' two competing tokens are within
    ``TOL`` of each other and of the other run's, every logprob before it within ``TOL``.
    ``tol`` widens the tolerance (a measured bound on rounding, see :func:`worst_deviation`).
    Returns the near-tie notes."""
    notes = []
    for a, b in zip(native["requests"], ours["requests"]):
        assert a["name"] == b["name"] and len(a["output"]) == len(b["output"])
        d = first_divergence(a["output"], b["output"])
        upto = len(a["output"]) if d is None else d
        for i in range(upto):
            tok = str(a["output"][i])
            assert close(a["logprobs"][i][tok], b["logprobs"][i][tok], tol), (a["name"], i)
        if d is None:
            continue
        tn, to = str(a["output"][d]), str(b["output"][d])
        la, lb = a["logprobs"][d], b["logprobs"][d]
        assert to in la and tn in lb, f"{a['name']}@{d}: tokens not among each other's top {TOP_LOGPROBS}"
        assert close(la[tn], la[to], tol) and close(lb[tn], lb[to], tol), (a["name"], d, la, lb)
        assert close(la[tn], lb[tn], tol) and close(la[to], lb[to], tol), (a["name"], d, la, lb)
        notes.append(f"{a['name']}: near-tie at token {d} ({la[tn]:.4f} vs {la[to]:.4f})")
    return notes


def engine_options(a: argparse.Namespace) -> dict:
    """``LLM`` keyword arguments of the command-line switches for vLLM's own cache settings."""
    kw: dict = {}
    if a.prefix_match_unit is not None:
        kw["prefix_match_unit"] = a.prefix_match_unit
    if a.retention_interval is not None:
        r = a.retention_interval
        kw["prefix_cache_retention_interval"] = None if r.lower() == "none" else int(r)
    if a.no_prefix_caching:
        kw["enable_prefix_caching"] = False
    return kw


#: vLLM at its strongest documented setting (hash unit 16 inside its block, every state kept).
STRONGEST = ("--prefix-match-unit", "16", "--retention-interval", "none")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--scheduler-cls", default=None)
    ap.add_argument("--additional-config", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-transfer-config", default=None)
    ap.add_argument("--prefix-match-unit", type=int, default=None,
                    help="vLLM's hash unit inside its block (its strongest setting: 16)")
    ap.add_argument("--retention-interval", default=None,
                    help="vLLM's prefix_cache_retention_interval: 'none' or an integer")
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="caching off: the reference outputs")
    ap.add_argument("--workload", choices=("base", "late"), default="base",
                    help="late: also sessions and a question arriving after the first ones")
    a = ap.parse_args()
    extra = json.loads(a.additional_config) if a.additional_config else None
    ktc = json.loads(a.kv_transfer_config) if a.kv_transfer_config else None
    res = run(a.model, a.scheduler_cls, extra, a.dtype, ktc, engine_options(a), a.workload)
    with open(a.out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
