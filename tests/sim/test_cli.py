"""The command line end to end: demo, generate -> run, presets, errors and bad lines."""

from __future__ import annotations

import json

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
    assert "unknown model preset 'nope'" in capsys.readouterr().err
    assert main(base + ["--capacity", "1MiB", "--policy", "hybridcache"]) == 2
    assert "cannot hold one state snapshot" in capsys.readouterr().err
    assert main(["run", "--trace", str(tmp_path / "missing.jsonl"), "--model", "kimi-linear-48b",
                 "--capacity", "1GiB"]) == 2


def test_presets_lists_sizes(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("kimi-linear-48b"))
    assert "8,064" in line and "41.41MiB" in line


def test_all_policies_on_a_block_trace_skips_vllm_native(tmp_path, capsys):
    trace = tmp_path / "m.jsonl"
    rows = [(1500, [1, 2, 3]), (2048, [1, 2, 4, 5]), (1100, [1, 2, 6]), (3000, [1, 2, 4, 5, 7, 8])]
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": n, "output_length": 3,
                                         "hash_ids": ids}) + "\n" for i, (n, ids) in enumerate(rows)))
    out = tmp_path / "r.json"
    assert main(["run", "--trace", str(trace), "--model", "kimi-linear-48b", "--capacity", "4GiB",
                 "--json", str(out), "--no-progress"]) == 0
    assert "skipping vllm-native replays token traces only" in capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert [r["policy"] for r in doc["results"]] == [
        "hybridcache", "vllm-align", "sglang", "sglang-extra", "marconi", "kv-only"]
    assert doc["hash_unit"] == 512
    kv = doc["results"][-1]
    assert kv["hit_tokens"] == 1024 + 1024 + 2048  # worked out in test_mooncake
