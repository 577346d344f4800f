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

State oracle (issue 17: greedy outputs of a tiny random model are a weak oracle, a mutant
registering a rejected draft's state left them unchanged): every snapshot the scheduler
registers while speculative decoding runs (block states and sub-block tails), read from
the worker's caches after the step that made it, holds the state a caching-off engine
without drafts computes at the same token boundary (:mod:`vllm_specdec_oracle`; within
its stated bf16-rounding tolerances). It runs on both models with drafts partly rejected,
and fails for both mutants: ``vllm_specdec_schedulers.LastDraftTails`` (a tail after a
step with drafts takes the state after the step's last, rejected, draft) and
``ConvWindowsNotSpread`` (stale conv windows in tails made past a step's first state).
"""

from __future__ import annotations

import pytest

try:
    import hybridcache.adapters.vllm  # noqa: F401
except ImportError as exc:
    pytest.skip(f"vLLM adapter not importable: {exc}", allow_module_level=True)

import vllm_specdec_oracle as oracle  # noqa: E402
import vllm_tiny_kimi as kimi  # noqa: E402
from cpu_skips import TORCH_PATH_REASON, skip_on_avx2_only, torch_gdn_spec_path  # noqa: E402

#: Built and measured on vLLM's torch GDN speculative path: skipped elsewhere (cpu_skips).
pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(not torch_gdn_spec_path(), reason=TORCH_PATH_REASON)]


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


@pytest.fixture(scope="module")
def tiny_kimi(tmp_path_factory):
    """The tiny KDA model, built once for this module."""
    return kimi.build_tiny_kimi(tmp_path_factory.mktemp("tiny-kimi"))


def test_specdec_kda_matches_caching_off(tiny_kimi, tmp_path):
    _check(tiny_kimi, tmp_path, "KDA")


@skip_on_avx2_only("one request's output with drafts")
def test_specdec_qwen3_next_matches_caching_off(tiny_qwen3_next, tmp_path):
    off, spec = _check(tiny_qwen3_next, tmp_path, "Qwen3-Next")
    mutant = kimi.serve(tiny_qwen3_next, tmp_path / "mutant.json", "ours", spec_tokens=3,
                        repeat=True, scheduler_cls="vllm_specdec_schedulers.ConvWindowsNotSpread")
    assert _total(mutant) == _total(spec)  # the same hits ...
    assert _same(off, mutant) != []  # ... from tails with stale conv windows


# --------------------------------------------------------------------------- state oracle
MUTANTS = ("LastDraftTails", "ConvWindowsNotSpread")


def _oracle_runs(model, d, label: str) -> dict:
    """Captures with our scheduler and each mutant, then one no-cache truth run for the
    union of their boundaries: one engine start per configuration."""
    import time

    t0 = time.time()
    caps = {"ours": oracle.capture(model, d / "ours.pt")}
    for m in MUTANTS:
        caps[m] = oracle.capture(model, d / f"{m}.pt",
                                 scheduler_cls=f"vllm_specdec_schedulers.{m}")
    truth = oracle.truth(model, d / "truth.pt", [d / "ours.pt", *(d / f"{m}.pt" for m in MUTANTS)])
    rows = {k: oracle.compare(c, truth) for k, c in caps.items()}
    print(f"\n{label} state oracle ({time.time() - t0:.0f} s: captures "
          + ", ".join(f"{k} {c['total_s']:.0f} s" for k, c in caps.items())
          + f", truth {truth['total_s']:.0f} s); state dtypes (conv, recurrent) "
          f"{sorted(set(caps['ours']['dtypes'].values()))}:")
    for k, rs in rows.items():
        st = caps[k]["stats"]
        bad = [r for r in rs if not r["ok"]]
        print(f"  {k}: {len(rs)} snapshots ({sum(r['kind'] == 'tail' for r in rs)} tails), "
              f"{sum(r['rejected_in_step'] for r in rs)} from steps with rejected drafts; "
              f"drafts {st['draft_tokens']}, accepted {st['accepted_drafts']}; max rec "
              f"{max(r['rec'] for r in rs):.3g} ({max(r['rec_rel'] for r in rs):.3g} rel), "
              f"max conv {max(r['conv'] for r in rs):.3g} "
              f"({max(r['conv_ulps'] for r in rs):.3g} ulps); out of tolerance: "
              + (", ".join(f"{r['kind']}@{r['boundary']} (rec {r['rec_rel']:.3g} rel, conv "
                           f"{r['conv_ulps']:.3g} ulps)" for r in bad) or "none"))
    return dict(caps=caps, rows=rows)


@pytest.fixture(scope="module")
def kda_oracle(tiny_kimi, tmp_path_factory):
    return _oracle_runs(tiny_kimi, tmp_path_factory.mktemp("kda-oracle"), "KDA")


@pytest.fixture(scope="module")
def qwen_oracle(tiny_qwen3_next, tmp_path_factory):
    return _oracle_runs(tiny_qwen3_next, tmp_path_factory.mktemp("qwen-oracle"), "Qwen3-Next")


@pytest.fixture(params=["kda", "qwen"])
def oracle_runs(request):
    return request.getfixturevalue(f"{request.param}_oracle")


def test_specdec_registered_states_equal_no_cache_states(oracle_runs):
    rows, st = oracle_runs["rows"]["ours"], oracle_runs["caps"]["ours"]["stats"]
    assert st["accepted_drafts"] < st["draft_tokens"]  # drafts were rejected ...
    kinds = {r["kind"] for r in rows}
    assert kinds == {"block", "tail"}
    # ... and snapshots were registered from steps that rejected some
    assert any(r["rejected_in_step"] for r in rows)
    assert [r for r in rows if not r["ok"]] == []


def test_specdec_state_oracle_catches_rejected_draft_state(oracle_runs):
    """A tail holding the state after the step's last draft fails, among them one made
    from a step whose last draft was rejected."""
    bad = [r for r in oracle_runs["rows"]["LastDraftTails"] if not r["ok"]]
    assert any(r["rejected_in_step"] for r in bad)


def test_specdec_state_oracle_catches_stale_conv_window(oracle_runs):
    bad = [r for r in oracle_runs["rows"]["ConvWindowsNotSpread"] if not r["ok"]]
    assert any(r["kind"] == "tail" and r["conv_ulps"] > oracle.CONV_ULP_TOL for r in bad)
