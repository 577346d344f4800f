"""The command line end to end: demo, generate -> run, presets, errors and bad lines."""

from __future__ import annotations

import json

import pytest

from hybridcache.sim.cli import main

KEYS = {"policy", "capacity_bytes", "token_hit_rate", "request_hit_rate", "kv_hit_state_miss_tokens",
        "prefill_flops_saved_frac", "snapshots_stored", "evictions", "per_tenant"}


def test_demo_writes_json_and_png(tmp_path, capsys):
    rc = main(["demo", "--out", str(tmp_path), "--requests", "24", "--capacity", "1GiB,4GiB",
               "--policy", "hybridcache,vllm-align,kv-only", "--no-progress"])
    assert rc == 0
    doc = json.loads((tmp_path / "hybridcache-demo.json").read_text())
    assert (tmp_path / "hybridcache-demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert doc["model"] == "kimi-linear-48b" and doc["requests"] == 24
    assert len(doc["results"]) == 6 and all(KEYS <= set(r) for r in doc["results"])
    assert {r["capacity_bytes"] for r in doc["results"]} == {1 << 30, 4 << 30}
    assert doc["prompt_tokens"] == doc["results"][0]["prompt_tokens"]
    for r in doc["results"]:
        assert 0.0 <= r["token_hit_rate"] <= 1.0 and set(r["per_tenant"]) <= {"tenant0", "tenant1"}
    out = capsys.readouterr().out
    assert "token hit rate" in out and "hybridcache" in out and "4GiB" in out


def test_generate_then_run(tmp_path, capsys):
    trace = tmp_path / "chat.jsonl"
    assert main(["generate", "--kind", "chat", "--requests", "30", "--seed", "1", "--tenants", "3",
                 "-o", str(trace)]) == 0
    assert len(trace.read_text().splitlines()) == 30
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["run", "--trace", str(trace), "--model", "kimi-linear-48b", "--capacity", "2GiB",
               "--policy", "hybridcache,sglang,kv-only", "--json", str(out_json), "--plot", str(out_png),
               "--no-progress"])
    assert rc == 0 and out_png.exists()
    doc = json.loads(out_json.read_text())
    by = {r["policy"]: r for r in doc["results"]}
    assert set(by) == {"hybridcache", "sglang", "kv-only"}
    # Multi-turn chat: every policy hits, states never beat free states.
    assert 0 < by["sglang"]["token_hit_rate"] <= by["kv-only"]["token_hit_rate"]
    assert by["hybridcache"]["token_hit_rate"] <= by["kv-only"]["token_hit_rate"]
    assert set(by["kv-only"]["per_tenant"]) == {"tenant0", "tenant1", "tenant2"}


def test_bad_line_is_an_error_naming_file_and_line(tmp_path, capsys):
    trace = tmp_path / "m.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n'
                     '{"timestamp": 1, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n')
    args = ["run", "--trace", str(trace), "--model", "kimi-linear-48b", "--capacity", "1GiB",
            "--policy", "kv-only", "--no-progress"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{trace}:2:" in err and "hash_ids" in err
    assert main(args + ["--skip-bad-lines"]) == 0
    assert "skipped 1 malformed line" in capsys.readouterr().err


def test_argument_errors(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    main(["generate", "--kind", "docs", "--requests", "3", "-o", str(trace)])
    base = ["run", "--trace", str(trace), "--model", "kimi-linear-48b", "--no-progress"]
    assert main(base + ["--capacity", "lots"]) == 2
    assert "bad size 'lots'" in capsys.readouterr().err
    assert main(base + ["--capacity", "1GiB", "--policy", "fifo"]) == 2
    assert "unknown policy 'fifo'" in capsys.readouterr().err
    assert main(["run", "--trace", str(trace), "--model", "nope", "--capacity", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert "--model 'nope' is neither a preset nor a Hugging Face config.json" in err
    assert "kimi-linear-48b" in err
    assert main(base + ["--capacity", "1MiB", "--policy", "hybridcache"]) == 2
    assert "cannot hold one state snapshot" in capsys.readouterr().err
    assert main(["run", "--trace", str(tmp_path / "missing.jsonl"), "--model", "kimi-linear-48b",
                 "--capacity", "1GiB"]) == 2


def test_presets_lists_sizes(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("kimi-linear-48b"))
    assert "8,064" in line and "41.41MiB" in line


def test_all_native_on_a_block_trace_skips_vllm_native(tmp_path, capsys):
    trace = tmp_path / "m.jsonl"
    rows = [(1500, [1, 2, 3]), (2048, [1, 2, 4, 5]), (1100, [1, 2, 6]), (3000, [1, 2, 4, 5, 7, 8])]
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": n, "output_length": 3,
                                         "hash_ids": ids}) + "\n" for i, (n, ids) in enumerate(rows)))
    out = tmp_path / "r.json"
    assert main(["run", "--trace", str(trace), "--model", "kimi-linear-48b", "--capacity", "4GiB",
                 "--policy", "all-native", "--json", str(out), "--no-progress"]) == 0
    assert "skipping vLLM-native policies replay token traces only" in capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert [r["policy"] for r in doc["results"]] == [
        "hybridcache", "vllm-align", "sglang", "sglang-extra", "marconi", "kv-only"]
    assert doc["hash_unit"] == 512
    kv = doc["results"][-1]
    assert kv["hit_tokens"] == 1024 + 1024 + 2048  # worked out in test_mooncake


def _chat_trace(tmp_path, n=12):
    trace = tmp_path / "chat.jsonl"
    assert main(["generate", "--kind", "chat", "--requests", str(n), "-o", str(trace)]) == 0
    return trace


def test_help_lists_policies_presets_formats_and_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    for word in ("hybridcache", "sglang-extra", "all-native", "kimi-linear-48b", "config.json",
                 "mooncake", "tokens", "(default: auto)", "(default: all)", "512", "decimal",
                 "hybridcache-llm[vllm]", "--block-tokens", "--csv"):
        assert word in out, word
    assert "`" not in out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "`" not in capsys.readouterr().out


def test_version(capsys):
    import hybridcache

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"hybridcache-sim {hybridcache.__version__}"


def test_json_records_version_and_settings(tmp_path):
    trace, out = _chat_trace(tmp_path), tmp_path / "r.json"
    assert main(["run", "--trace", str(trace), "--model", "kimi-linear-48b", "--capacity", "1GiB",
                 "--policy", "kv-only", "--json", str(out), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    import hybridcache

    assert doc["hybridcache_version"] == hybridcache.__version__ == "0.2.0"
    st = doc["settings"]
    assert st["trace"] == str(trace) and st["policies"] == ["kv-only"] and st["capacities_bytes"] == [1 << 30]
    assert st["model"] == "kimi-linear-48b" and st["block_tokens"] is None and st["skip_bad_lines"] is False


@pytest.mark.parametrize("flag,name,why", [
    ("--json", "missing-dir/r.json", "does not exist"),
    ("--plot", "missing-dir/r.png", "does not exist"),
    ("--csv", "missing-dir/r.csv", "does not exist"),
    ("--plot", "r.txt", "must end in .png"),
    ("--json", ".", "is a directory"),
])
def test_output_paths_are_checked_before_the_replay(tmp_path, capsys, monkeypatch, flag, name, why):
    import hybridcache.sim.cli as cli

    trace = _chat_trace(tmp_path)
    calls = []
    monkeypatch.setattr(cli, "sweep", lambda *a, **k: calls.append(1))  # must not be reached
    target = tmp_path / name
    assert main(["run", "--trace", str(trace), "--model", "kimi-linear-48b", "--capacity", "1GiB",
                 flag, str(target), "--no-progress"]) == 2
    assert why in capsys.readouterr().err and calls == []


def test_csv_output(tmp_path):
    import csv

    trace, out = _chat_trace(tmp_path), tmp_path / "r.csv"
    assert main(["run", "--trace", str(trace), "--model", "kimi-linear-48b", "--capacity", "1GiB,2GiB",
                 "--policy", "kv-only,sglang", "--csv", str(out), "--no-progress"]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [(r["policy"], int(r["capacity_bytes"])) for r in rows] == [
        ("kv-only", 1 << 30), ("kv-only", 2 << 30), ("sglang", 1 << 30), ("sglang", 2 << 30)]
    assert all(0 <= float(r["token_hit_rate"]) <= 1 for r in rows)


def test_decimal_sizes_are_said_out_loud(tmp_path, capsys):
    trace, out = _chat_trace(tmp_path), tmp_path / "r.json"
    assert main(["run", "--trace", str(trace), "--model", "kimi-linear-48b", "--capacity", "8GB",
                 "--policy", "kv-only", "--json", str(out), "--no-progress"]) == 0
    assert "8GB is decimal: 8,000,000,000 bytes (7.45GiB); write 8GiB for the binary size" in capsys.readouterr().err
    assert json.loads(out.read_text())["results"][0]["capacity_bytes"] == 8_000_000_000


def test_model_from_a_hugging_face_config(tmp_path, capsys):
    from hybridcache.adapters.hf import preset_config, spec_from_hf_config

    cfg = tmp_path / "my-model"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps(preset_config("qwen3-next-80b")))
    trace, out = _chat_trace(tmp_path), tmp_path / "r.json"
    for model in (cfg, cfg / "config.json"):
        assert main(["run", "--trace", str(trace), "--model", str(model), "--capacity", "2GiB",
                     "--policy", "hybridcache,kv-only", "--json", str(out), "--no-progress"]) == 0
        doc = json.loads(out.read_text())
        assert doc["model"] == str(model) and len(doc["results"]) == 2
    by_preset = tmp_path / "p.json"
    assert main(["run", "--trace", str(trace), "--model", "qwen3-next-80b", "--capacity", "2GiB",
                 "--policy", "hybridcache,kv-only", "--json", str(by_preset), "--no-progress"]) == 0
    rates = [r["token_hit_rate"] for r in json.loads(by_preset.read_text())["results"]]
    assert rates == [r["token_hit_rate"] for r in doc["results"]]
    assert spec_from_hf_config(cfg).kv_bytes_per_token > 0
    bad = tmp_path / "bad.json"
    bad.write_text('{"architectures": ["LlamaForCausalLM"]}')
    assert main(["run", "--trace", str(trace), "--model", str(bad), "--capacity", "2GiB"]) == 2
    assert "hybridcache-sim: error:" in capsys.readouterr().err


def test_all_leaves_out_vllm_native_and_says_how_to_get_it(tmp_path, capsys):
    trace, out = _chat_trace(tmp_path), tmp_path / "r.json"
    assert main(["run", "--trace", str(trace), "--model", "kimi-linear-48b", "--capacity", "2GiB",
                 "--json", str(out), "--no-progress"]) == 0
    assert "vllm-native" not in {r["policy"] for r in json.loads(out.read_text())["results"]}
    assert "--policy all-native" in capsys.readouterr().err


def test_block_tokens_flag(tmp_path):
    trace, out = tmp_path / "b16.jsonl", tmp_path / "r.json"
    rows = [(40, [1, 2, 3]), (48, [1, 2, 4]), (20, [1, 5])]
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": n, "output_length": 2,
                                         "hash_ids": ids}) + "\n" for i, (n, ids) in enumerate(rows)))
    args = ["run", "--trace", str(trace), "--model", "kimi-linear-48b", "--capacity", "1GiB",
            "--policy", "kv-only", "--json", str(out), "--no-progress"]
    assert main(args) == 2  # 512-token blocks: ceil(40/512) = 1 id, not 3
    assert main(args + ["--block-tokens", "16"]) == 0
    doc = json.loads(out.read_text())
    assert doc["hash_unit"] == 16 and doc["results"][0]["hit_tokens"] == 32 + 16


def test_over_long_request_is_a_skippable_line(tmp_path, capsys):
    trace = tmp_path / "long.jsonl"
    ok = {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}
    huge = {"timestamp": 1, "input_length": 600, "output_length": 1 << 30, "hash_ids": [1, 2]}
    trace.write_text("".join(json.dumps(r) + "\n" for r in (ok, huge, ok)))
    args = ["run", "--trace", str(trace), "--model", "kimi-linear-48b", "--capacity", "1GiB",
            "--policy", "kv-only,hybridcache", "--no-progress"]
    assert main(args) == 2
    assert f"{trace}:2: " in capsys.readouterr().err
    assert main(args + ["--skip-bad-lines"]) == 0


def test_demo_imports_no_torch(tmp_path):
    """The simulator installs without torch (an extra): the demo must not import it."""
    import subprocess
    import sys

    code = ("import sys; from hybridcache.sim.cli import main; "
            f"rc = main(['demo', '--out', {str(tmp_path)!r}, '--requests', '12', '--capacity', '1GiB', "
            "'--no-progress']); "
            "heavy = sorted(m for m in ('torch', 'vllm', 'triton') if m in sys.modules); "
            "print('HEAVY', heavy); sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "HEAVY []" in r.stdout
