"""Speculative decoding with prefix caching in a real vLLM on CPU (n-gram drafter, 3 tokens).

For the tiny Qwen3-Next (Gated DeltaNet) and the tiny KDA model, the multi-turn workload
with repeated phrases (so the n-gram drafter proposes) runs three times in fresh
processes: caching off without speculative decoding, ``HybridCacheScheduler`` without and
with speculative decoding. vLLM's CPU build needs the plug-in's overrides of the fused
Mamba copy kernels for the last one (``adapters/vllm/cpu_kernels.py``). Checks: outputs
with speculative decoding and caching equal caching off without it; drafts were both
accepted and rejected; cached tokens with speculative decoding >= 0.95x without, counted
on block boundaries (the scheduler turns sub-block tails off under speculative decoding,
``spec_decode.sub_block_unit``; a hit without drafts is its tail's block-level base).
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


def _block_total(run: dict) -> int:
    """Cached tokens rounded down to vLLM's block: what block-level hits alone give."""
    b = run["block_size"]
    return sum(r["num_cached_tokens"] // b * b for r in run["requests"])


def _check(model, d, label: str) -> None:
    off = kimi.serve(model, d / "off.json", "off", repeat=True)
    plain = kimi.serve(model, d / "plain.json", "ours", repeat=True)
    spec = kimi.serve(model, d / "spec.json", "ours", spec_tokens=3, repeat=True)
    st = spec["hybridcache"]
    print(f"\n{label}: cached tokens without spec decode {_total(plain)} (on block boundaries "
          f"{_block_total(plain)}), with {_total(spec)}; "
          f"drafts {st['draft_tokens']}, accepted {st['accepted_drafts']}, "
          f"rejected saves {st['rejected_saves']}; sub-block tail hits without "
          f"{plain['hybridcache'].get('tail_hits')}, with {st.get('tail_hits')}")
    for a, b in zip(off["requests"], spec["requests"]):
        assert a["name"] == b["name"] and a["output"] == b["output"], (label, a["name"])
    assert 0 < st["accepted_drafts"] < st["draft_tokens"]
    assert st["saves_dropped"] == 0 and st["column_slots"] == 0
    assert st.get("tail_hits") is None  # tails off with drafts
    assert _total(spec) >= 0.95 * _block_total(plain) > 0


def test_specdec_kda_matches_caching_off(tmp_path):
    _check(kimi.build_tiny_kimi(tmp_path / "model"), tmp_path, "KDA")


def test_specdec_qwen3_next_matches_caching_off(tiny_qwen3_next, tmp_path):
    _check(tiny_qwen3_next, tmp_path, "Qwen3-Next")
