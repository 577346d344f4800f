"""Trace readers: good lines, every kind of bad line, skipping, auto-detection, round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hybridcache.sim.generate import generate
from hybridcache.sim.traces import TraceFormatError, read_trace, write_token_trace

MC_GOOD = [
    {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]},
    {"timestamp": 12, "input_length": 1024, "output_length": 0, "hash_ids": [1, 3], "tenant": "a"},
]
TOK_GOOD = [
    {"timestamp": 0.5, "session_id": "s1", "input_ids": [1, 2, 3], "output_ids": [4, 5]},
    {"timestamp": 1.5, "session_id": 7, "tenant": "b", "input_ids": [1, 2, 3, 4, 5, 6], "output_length": 9},
]


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_mooncake_good_lines(tmp_path):
    t = read_trace(write(tmp_path / "m.jsonl", MC_GOOD))
    assert t.format == "mooncake" and t.block_tokens == 512 and t.skipped == 0
    a, b = t.requests
    assert (a.input_length, a.output_length, a.block_ids.tolist(), a.tenant) == (1000, 5, [1, 2], None)
    assert (b.timestamp, b.tenant, b.block_ids.tolist()) == (12.0, "a", [1, 3])
    assert t.prompt_tokens == 2024 and t.tenants == ["", "a"]


def test_tokens_good_lines(tmp_path):
    t = read_trace(write(tmp_path / "t.jsonl", TOK_GOOD + [""]))  # blank lines are ignored
    assert t.format == "tokens" and t.block_tokens == 0
    a, b = t.requests
    assert a.input_ids.tolist() == [1, 2, 3] and a.output_ids.tolist() == [4, 5] and a.output_length == 2
    assert b.session_id == "7" and b.tenant == "b" and b.output_ids is None and b.output_length == 9


BAD_MOONCAKE = [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({"timestamp": 0, "output_length": 1, "hash_ids": [1]}, "missing field 'input_length'"),
    ({"timestamp": 0, "input_length": "9", "output_length": 1, "hash_ids": [1]}, "'input_length' must be an integer"),
    ({"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}, "'input_length' must be >= 1"),
    ({"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1]}, "needs ceil(1000/512) = 2"),
    ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-1]}, "'hash_ids'[0]"),
    ({"timestamp": 0, "input_length": 10, "output_length": -2, "hash_ids": [1]}, "'output_length' must be >= 0"),
    ({"timestamp": "x", "input_length": 10, "output_length": 1, "hash_ids": [1]}, "'timestamp' must be a number"),
]


@pytest.mark.parametrize("bad,why", BAD_MOONCAKE)
def test_mooncake_bad_line_names_file_line_and_problem(tmp_path, bad, why):
    path = write(tmp_path / "m.jsonl", [MC_GOOD[0], bad, MC_GOOD[1]])
    with pytest.raises(TraceFormatError) as e:
        read_trace(path, "mooncake")
    assert f"{path}:2:" in str(e.value) and why in str(e.value)


BAD_TOKENS = [
    ({"timestamp": 0, "input_ids": [1], "output_length": 1}, "missing field 'session_id'"),
    ({"timestamp": 0, "session_id": "s", "output_length": 1}, "missing field 'input_ids'"),
    ({"timestamp": 0, "session_id": "s", "input_ids": [], "output_length": 1}, "'input_ids' is empty"),
    ({"timestamp": 0, "session_id": "s", "input_ids": [1, 2.5], "output_length": 1}, "'input_ids'[1]"),
    ({"timestamp": 0, "session_id": "s", "input_ids": [1, 1 << 33], "output_length": 1}, "'input_ids'[1]"),
    ({"timestamp": 0, "session_id": "s", "input_ids": "abc", "output_length": 1}, "must be a list"),
    ({"timestamp": 0, "session_id": "s", "input_ids": [1]}, "'output_ids' or 'output_length'"),
    ({"timestamp": 0, "session_id": "s", "input_ids": [1], "output_ids": [2], "output_length": 3}, "!= len(output_ids)"),
    ({"timestamp": 0, "session_id": "s", "input_ids": [1], "output_length": 1, "tenant": [1]}, "'tenant' must be a string"),
]


@pytest.mark.parametrize("bad,why", BAD_TOKENS)
def test_tokens_bad_line_names_file_line_and_problem(tmp_path, bad, why):
    path = write(tmp_path / "t.jsonl", [TOK_GOOD[0], TOK_GOOD[1], bad])
    with pytest.raises(TraceFormatError) as e:
        read_trace(path)
    assert f"{path}:3:" in str(e.value) and why in str(e.value)


def test_skip_bad_lines_counts_them(tmp_path):
    path = write(tmp_path / "m.jsonl", [MC_GOOD[0], "{oops", BAD_MOONCAKE[5][0], MC_GOOD[1]])
    t = read_trace(path, skip_bad_lines=True)
    assert t.skipped == 2 and len(t.requests) == 2


def test_detection_and_empty_files(tmp_path):
    with pytest.raises(TraceFormatError, match="cannot tell the format"):
        read_trace(write(tmp_path / "x.jsonl", [{"timestamp": 0, "prompt": "hi"}]))
    with pytest.raises(TraceFormatError, match="no parsable JSON line"):
        read_trace(write(tmp_path / "y.jsonl", ["nope"]))
    with pytest.raises(TraceFormatError, match="no valid request"):
        read_trace(write(tmp_path / "z.jsonl", ["{bad"]), "tokens", skip_bad_lines=True)
    with pytest.raises(TraceFormatError, match="unknown trace format"):
        read_trace(tmp_path / "x.jsonl", "csv")


def test_generated_trace_round_trips(tmp_path):
    reqs = generate("mixed", 25, seed=3, tenants=2)
    write_token_trace(tmp_path / "g.jsonl", reqs)
    t = read_trace(tmp_path / "g.jsonl")
    assert t.format == "tokens" and len(t.requests) == 25
    for a, b in zip(reqs, t.requests):
        assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.output_ids, b.output_ids)
        assert (a.tenant, a.session_id) == (b.tenant, b.session_id)
