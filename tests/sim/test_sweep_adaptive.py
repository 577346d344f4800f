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


def _recording_sweeps(monkeypatch, mod) -> list[list[str]]:
    """The policies of every replay the sweep module starts."""
    calls: list[list[str]] = []
    real_sweep = mod.sweep

    def sweep(trace, model, policies, capacities, progress=True):
        calls.append(list(policies))
        return real_sweep(trace, model, policies, capacities, progress=progress)

    monkeypatch.setattr(mod, "sweep", sweep)
    return calls


def test_peers_from_an_earlier_run_replay_only_our_policies(monkeypatch, tmp_path):
    """``--peers`` replays ``hybridcache`` and ``hybridcache-adaptive`` only and takes every
    other policy's figures from the earlier run's rows: the same code gives the same rows,
    and a peer's figure changed in the file is the one the row compares against."""
    import json

    mod, _ = _sweep_recording(monkeypatch, "tenants")
    args = ["generated", "--kinds", "chat", "--seeds", "5", "--requests", "30"]
    first = tmp_path / "first.json"
    mod.main([*args, "--json", str(first)])
    calls = _recording_sweeps(monkeypatch, mod)
    again = tmp_path / "again.json"
    mod.main([*args, "--peers", str(first), "--json", str(again)])
    assert calls == [["hybridcache", "hybridcache-adaptive"]]
    drop = ("time_ratio", "policies")
    old, new = json.loads(first.read_text()), json.loads(again.read_text())
    assert [{k: v for k, v in r.items() if k not in drop} for r in new] == \
           [{k: v for k, v in r.items() if k not in drop} for r in old]
    assert all(r["policies"]["sglang"] == o["policies"]["sglang"] for r, o in zip(new, old))
    fixed = old[0]["fixed"]
    old[0]["policies"]["sglang"]["hit"] = 1.0
    old[0]["policies"]["hybridcache"]["hit"] = 0.5 * fixed  # ours are replayed, not read
    first.write_text(json.dumps(old))
    mod.main([*args, "--peers", str(first), "--json", str(again)])
    row = json.loads(again.read_text())[0]
    assert (row["best_other"], row["best_other_rate"], row["fixed"]) == ("sglang", 1.0, fixed) and fixed > 0


def test_peers_that_do_not_fit_stop_the_run_before_any_replay(monkeypatch, tmp_path):
    """A file that is not an earlier run's rows with every policy, a cell it lacks or whose
    row lacks the ``kv-only`` bound, and a cell measured on another trace (here: another
    request count) each stop the run with a message naming it, before the first replay."""
    import json

    mod, _ = _sweep_recording(monkeypatch, "tenants")
    args = ["generated", "--kinds", "chat", "--seeds", "5", "--requests", "30"]
    first = tmp_path / "first.json"
    mod.main([*args, "--json", str(first)])
    rows = json.loads(first.read_text())
    calls = _recording_sweeps(monkeypatch, mod)
    bad = tmp_path / "bad.json"
    for text, match in [("not json", "cannot read"),
                        (json.dumps([{k: v for k, v in r.items() if k != "policies"} for r in rows]), "not the rows"),
                        (json.dumps(rows[:-1]), "no row for chat:5 at 16 GiB")]:
        bad.write_text(text)
        with pytest.raises(SystemExit, match=match):
            mod.main([*args, "--peers", str(bad)])
    rows[0]["policies"].pop("kv-only")
    bad.write_text(json.dumps(rows))
    with pytest.raises(SystemExit, match="chat:5 at 1 GiB has no kv-only figures"):
        mod.main([*args, "--peers", str(bad)])
    with pytest.raises(SystemExit, match="no row for chat:6 at 1 GiB"):
        mod.main(["generated", "--kinds", "chat", "--seeds", "5,6", "--requests", "30", "--peers", str(first)])
    with pytest.raises(SystemExit, match="chat:5 at 1 GiB was measured on another trace"):
        mod.main([*args[:-1], "31", "--peers", str(first)])
    with pytest.raises(SystemExit, match="cannot read"):
        mod.main([*args, "--peers", str(tmp_path / "missing.json")])
    assert calls == []


def test_capacities_are_the_ones_asked_for(monkeypatch, tmp_path, capsys):
    """``--capacities`` sets the generated traces' capacities (a model for which 16 GiB is a
    small cache is swept where it is a large one), read as ``hybridcache-sim --capacity``
    reads sizes; a bad list is refused before any replay."""
    import json

    mod, _ = _sweep_recording(monkeypatch, "tenants")
    out = tmp_path / "rows.json"
    mod.main(["generated", "--kinds", "chat", "--seeds", "5", "--requests", "30", "--capacities", "3GiB,40GiB",
              "--json", str(out)])
    assert [r["capacity_gib"] for r in json.loads(out.read_text())] == [3.0, 40.0]
    calls = _recording_sweeps(monkeypatch, mod)
    for bad, why in (("0GiB", "must be positive"), ("4GiB,x", "bad size 'x'"), (",", "no capacity given")):
        with pytest.raises(SystemExit):
            mod.main(["generated", "--kinds", "chat", "--seeds", "5", "--capacities", bad])
        assert why in capsys.readouterr().err
    assert calls == []
