"""Speculative decoding with prefix caching in a real vLLM on CPU (n-gram drafter, 3 tokens).

For the tiny Qwen3-Next (Gated DeltaNet) and the tiny KDA model, the multi-turn workload
with repeated phrases (so the n-gram drafter proposes) runs in fresh processes: caching
off without speculative decoding, ``HybridCacheScheduler`` without and with speculative
decoding (sub-block tails on in both, the default 16-token unit). vLLM's CPU build needs
the plug-in's overrides of the fused Mamba copy kernels for the last one
(``adapters/vllm/cpu_kernels.py``). Checks: outputs with speculative decoding and caching
equal caching off without it; drafts were both accepted and rejected; tails were hit with
drafts; cached tokens with speculative decoding >= 0.95x the same run without. The same
holds for the scheduler in its GPU mode (``vllm_specdec_schedulers.CurrentColumnOnly``:
after a step with drafts, tails only at the step's first state), run here on CPU.

Mutation (Qwen3-Next, where the workload hits a tail made inside a step with drafts): the
worker's forwards stop writing every state column's conv window
(``vllm_specdec_schedulers.ConvWindowsNotSpread``) while the scheduler still makes tails at any
accepted boundary; an output must then differ from caching off (the bug this fixes:
sessionA-turn2, a tail hit at 752, moved at its second output token).
"""

from __future__ import annotations

import pytest

try:
    import hybridcache.adapters.vllm  # noqa: F401
except ImportError as exc:
    pytest.skip(f"vLLM adapter not importable: {exc}", allow_module_level=True)

import vllm_tiny_kimi as kimi  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def _total(run: dict) -> int:
    return sum(r["num_cached_tokens"] for r in run["requests"])


def _mid_block_hits(run: dict) -> int:
    b = run["block_size"]
    return sum(1 for r in run["requests"] if r["num_cached_tokens"] % b)


def _same(a: dict, b: dict) -> list[str]:
    """Names of the requests whose greedy outputs differ."""
    return [x["name"] for x, y in zip(a["requests"], b["requests"])
            if x["name"] != y["name"] or x["output"] != y["output"]]


def _check(model, d, label: str) -> tuple[dict, dict]:
    off = kimi.serve(model, d / "off.json", "off", repeat=True)
    plain = kimi.serve(model, d / "plain.json", "ours", repeat=True)
    spec = kimi.serve(model, d / "spec.json", "ours", spec_tokens=3, repeat=True)
    st = spec["hybridcache"]
    print(f"\n{label}: cached tokens without spec decode {_total(plain)}, with {_total(spec)} "
          f"({_total(spec) / max(_total(plain), 1):.3f}x); drafts {st['draft_tokens']}, "
          f"accepted {st['accepted_drafts']}, rejected saves {st['rejected_saves']}; "
          f"sub-block tail hits without {plain['hybridcache'].get('tail_hits')}, "
          f"with {st.get('tail_hits')}")
    assert _same(off, spec) == [], label
    assert 0 < st["accepted_drafts"] < st["draft_tokens"]
    assert st["saves_dropped"] == 0 and st["column_slots"] == 0
    assert st["tail_hits"] > 0 and _mid_block_hits(spec) > 0  # tails on with drafts
    assert _total(spec) >= 0.95 * _total(plain) > 0
    gpu_mode = kimi.serve(model, d / "cur.json", "ours", spec_tokens=3, repeat=True,
                          scheduler_cls="vllm_specdec_schedulers.CurrentColumnOnly")
    print(f"{label}: cached tokens in the GPU mode {_total(gpu_mode)} "
          f"({_total(gpu_mode) / max(_total(plain), 1):.3f}x)")
    assert _same(off, gpu_mode) == [], label
    assert _total(gpu_mode) >= 0.95 * _total(plain)
    return off, spec


def test_specdec_kda_matches_caching_off(tmp_path):
    _check(kimi.build_tiny_kimi(tmp_path / "model"), tmp_path, "KDA")


def test_specdec_qwen3_next_matches_caching_off(tiny_qwen3_next, tmp_path):
    off, spec = _check(tiny_qwen3_next, tmp_path, "Qwen3-Next")
    mutant = kimi.serve(tiny_qwen3_next, tmp_path / "mutant.json", "ours", spec_tokens=3,
                        repeat=True, scheduler_cls="vllm_specdec_schedulers.ConvWindowsNotSpread")
    assert _total(mutant) == _total(spec)  # the same hits ...
    assert _same(off, mutant) != []  # ... from tails with stale conv windows
