"""End to end in a real vLLM on CPU: sub-block hits against vLLM at its strongest setting.

A tiny random Qwen3-Next with 8 GDN value heads makes vLLM inflate its ``align`` block to
1,152 tokens, so every prompt of the workload (:mod:`vllm_e2e_workload`, ``--workload
late``: two sessions side by side on a shared system prompt, a shared document with three
questions, then two more sessions and a fourth question arriving later) is shorter than
one block. Four engines, each in a fresh process:

- caching off: the reference outputs;
- vLLM at its strongest setting: ``prefix_match_unit=16``, retention interval ``None``,
  with our plug-in's copy fix (``HYBRIDCACHE_VLLM_COPY_FIX`` unset);
- ``HybridCacheScheduler`` with its default sub-block tails (16-token unit);
- the same with the partial-page copy skipped (``vllm_fine_mutant``): must fail the
  output check, so the check can fail.

Greedy identity uses the rule of ``test_vllm_e2e.py`` (identical tokens, or a bf16 near-tie),
with the tolerance widened to how far vLLM's own prefix caching moves logprobs from caching
off on the same run (``worst_deviation``). On a CPU whose bf16 kernels block by batch shape
(AMX) even a request with no hit moves: measured there, vLLM at its strongest 0.074 from
caching off (two requests diverge at their first token), ours 0.059, the mutant 0.113 (six
requests diverge at their first token). Ours must be no farther than vLLM's own caching.
"""

from __future__ import annotations

import pytest

try:
    import hybridcache.adapters.vllm  # noqa: F401
except ImportError as exc:
    pytest.skip(f"vLLM adapter not importable: {exc}", allow_module_level=True)

from vllm_e2e_workload import SCHEDULER, STRONGEST, check_same_greedy, serve, worst_deviation  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

LATE = ("--workload", "late")


def _cached(run: dict) -> list[int]:
    return [r["num_cached_tokens"] for r in run["requests"]]


def test_sub_block_hits_beat_vllm_strongest_with_exact_outputs(tiny_qwen3_next_wide, tmp_path):
    model = tiny_qwen3_next_wide
    off = serve(model, tmp_path / "off.json", *LATE, "--no-prefix-caching")
    best = serve(model, tmp_path / "best.json", *LATE, *STRONGEST)
    if max(r["prompt_len"] for r in off["requests"]) >= best["block_size"]:
        # The check is of hits inside one block; vLLM sized the block by this CPU's kernels
        # (an AVX2-only AMD EPYC, 2026-12-02: 640 tokens, against 1,152 on AVX-512 and AMX).
        pytest.skip(f"vLLM's block here is {best['block_size']} tokens: the workload's prompts do not "
                    "fit in one, which this comparison needs")
    ours = serve(model, tmp_path / "ours.json", *LATE, "--scheduler-cls", SCHEDULER)
    mutant = serve(model, tmp_path / "mutant.json", *LATE,
                   "--scheduler-cls", "vllm_fine_mutant.PartialPageSkipped")
    assert best["block_size"] >= 1024
    assert max(r["prompt_len"] for r in off["requests"]) < best["block_size"]
    total_b, total_o = sum(_cached(best)), sum(_cached(ours))
    print(f"\nblock {best['block_size']}; cached tokens vLLM strongest {total_b}, "
          f"hybridcache {total_o} ({total_o / max(total_b, 1):.2f}x)")
    for rb, ro in zip(best["requests"], ours["requests"]):
        print(f"  {rb['name']:16s} prompt {rb['prompt_len']:4d}  vLLM {rb['num_cached_tokens']:4d}"
              f"  hybridcache {ro['num_cached_tokens']:4d}")
    assert total_o >= 1.3 * total_b
    for rb, ro in zip(best["requests"], ours["requests"]):
        assert ro["num_cached_tokens"] >= rb["num_cached_tokens"], rb["name"]
    tol = worst_deviation(off, best)
    print(f"  logprobs from caching off: vLLM strongest {tol:.4f}, hybridcache "
          f"{worst_deviation(off, ours):.4f}, mutant {worst_deviation(off, mutant):.4f}")
    for n in check_same_greedy(off, ours, tol):
        print("  " + n)
    stats = ours["hybridcache"]
    assert stats["tail_hits"] > 0 and stats["saves_dropped"] == 0
    assert _cached(mutant) == _cached(ours)  # same hits, but without the partial page ...
    with pytest.raises(AssertionError):
        check_same_greedy(off, mutant, tol)  # ... the outputs move
