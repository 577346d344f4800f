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


def _sweep_recording(monkeypatch, argument: str) -> tuple[object, list]:
    """The sweep module with four policies, its generator wrapped to record one argument
    (``tenants`` or ``shape``) of every call."""
    mod = _sweep_module()
    monkeypatch.setattr(mod, "POLICIES", ["hybridcache", "hybridcache-adaptive", "sglang", "kv-only"])
    seen: list = []
    real_generate = mod.generate

    def generate(kind, n, seed=0, tenants=2, shape=None):
        seen.append({"tenants": tenants, "shape": shape}[argument])
        return real_generate(kind, n, seed=seed, tenants=tenants, shape=shape)

    monkeypatch.setattr(mod, "generate", generate)
    return mod, seen


def test_held_out_settings_tenants_and_a_longer_max_model_len(monkeypatch, tmp_path, capsys):
    """``--tenants`` reaches the generator, and ``--max-model-len`` serves a preset past its
    own limit as ``NAME@N``; without it, the first long request is refused before any replay."""
    import json

    import hybridcache.presets as presets
    from hybridcache.errors import InvalidRequestError
    from hybridcache.presets import get_preset

    presets.preset_names()  # the adapters' presets in, then the registry restored after the test
    monkeypatch.setattr(presets, "_PRESETS", dict(presets._PRESETS))
    mod, seen = _sweep_recording(monkeypatch, "tenants")
    args = ["generated", "--model", "nemotron-h-8b", "--kinds", "agent", "--seeds", "31", "--requests", "40"]
    with pytest.raises(InvalidRequestError, match=r"longer than the model's maximum of 8,192 \('nemotron-h-8b'.s max_model_len\)"):
        mod.main(args)
    out = tmp_path / "rows.json"
    mod.main([*args, "--tenants", "8", "--max-model-len", "1048576", "--json", str(out)])
    assert seen == [2, 8]
    assert get_preset("nemotron-h-8b@1048576").max_model_len == 1 << 20
    assert get_preset("nemotron-h-8b").max_model_len == 8192
    rows = json.loads(out.read_text())
    assert [r["trace"] for r in rows] == ["agent:31"] * 5 and "of 5 cells behind" in capsys.readouterr().out


def test_shapes_generate_each_kind_and_seed_at_each_drawn_shape(monkeypatch, tmp_path):
    """``--shapes`` generates every kind and seed again at each shape drawn from the seeds
    given, and labels the rows by shape; without it every trace is the kind as built."""
    import json

    from hybridcache.sim.shapes import Shape

    mod, shapes = _sweep_recording(monkeypatch, "shape")
    out = tmp_path / "rows.json"
    mod.main(["generated", "--kinds", "chat", "--seeds", "5", "--requests", "30",
              "--shapes", "7,8", "--json", str(out)])
    assert shapes == [Shape.draw(7), Shape.draw(8)] and Shape.draw(7) != Shape.draw(8)
    rows = json.loads(out.read_text())
    assert [r["trace"] for r in rows] == ["chat:5~s7"] * 5 + ["chat:5~s8"] * 5
    shapes.clear()
    mod.main(["generated", "--kinds", "chat", "--seeds", "5", "--requests", "30", "--json", str(out)])
    assert shapes == [None]
