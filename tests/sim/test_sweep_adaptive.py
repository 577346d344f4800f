"""The adaptive sweep's script (``benchmarks/sweep_adaptive.py``) runs on a block-hash trace.

vLLM's own manager replays token traces only; the sweep leaves it out there and says so, instead
of failing before the first replay (as ``mooncake`` did once ``vllm-native-best`` joined).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _sweep_module():
    spec = importlib.util.spec_from_file_location("sweep_adaptive", REPO / "benchmarks" / "sweep_adaptive.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("sweep_adaptive", mod)
    spec.loader.exec_module(mod)
    return mod


def test_block_trace_leaves_out_vllm_native(capsys):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed: the native policy is not in play")
    mod = _sweep_module()
    assert any(p.startswith("vllm-native") for p in mod.POLICIES)
    trace = mod.read_trace(str(REPO / "tests" / "data" / "mooncake_sample.jsonl"))
    doc = mod.sweep_available(trace, "kimi-linear-48b", [8 << 30])
    ran = {r["policy"] for r in doc["results"]}
    assert ran == {p for p in mod.POLICIES if not p.startswith("vllm-native")}
    assert "left out" in capsys.readouterr().err
    rows = mod.cells(doc, "sample")
    assert len(rows) == 1 and rows[0]["best_other"] != "kv-only"
