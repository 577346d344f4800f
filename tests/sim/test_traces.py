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


# --- hostile lines (issue 15): each is a file:line error that --skip-bad-lines skips ---

HOSTILE = [
    (b'{"timestamp": 0, "session_id": "s\xff\xfe", "input_ids": [1], "output_length": 1}', "not UTF-8"),
    (b'{"timestamp": 0, "session_id": "s", "input_ids": [' + b"9" * 5000 + b'], "output_length": 1}',
     "invalid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"timestamp": 0, "session_id": "s", "input_ids": [' + b"[" * 100_000 + b"]" * 100_000
     + b'], "output_length": 1}', "nested too deeply"),
    (b'{"timestamp": 1e999, "session_id": "s", "input_ids": [1], "output_length": 1}', "finite"),
    (b'{"timestamp": NaN, "session_id": "s", "input_ids": [1], "output_length": 1}', "finite"),
    (b'{"timestamp": 0, "session_id": "\\ud800", "input_ids": [1], "output_length": 1}', "surrogate"),
    (b'{"timestamp": 0, "session_id": "s", "input_ids": [1], "output_length": 100000000000000}',
     "implausibly large"),
]


def write_bytes(path, lines: list[bytes]):
    path.write_bytes(b"".join(x + b"\n" for x in lines))
    return path


GOOD_LINE = json.dumps(TOK_GOOD[0]).encode()


@pytest.mark.parametrize("bad,why", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_line_is_a_file_line_error_and_skippable(tmp_path, bad, why):
    path = write_bytes(tmp_path / "t.jsonl", [GOOD_LINE, bad, GOOD_LINE])
    with pytest.raises(TraceFormatError) as e:
        read_trace(path, "tokens")
    assert str(e.value).startswith(f"{path}:2: ") and why in str(e.value)
    assert len(str(e.value)) < 400  # a huge value is cut, not echoed
    t = read_trace(path, "tokens", skip_bad_lines=True)
    assert t.skipped == 1 and [r.line for r in t.requests] == [1, 3]


def test_request_longer_than_the_model_is_a_bad_line(tmp_path):
    rows = [TOK_GOOD[0], {**TOK_GOOD[1], "output_length": 100}, TOK_GOOD[0]]
    path = write(tmp_path / "t.jsonl", rows)
    with pytest.raises(TraceFormatError, match=rf"{path}:2: .*longer than the model's maximum of 50"):
        read_trace(path, max_tokens=50)
    t = read_trace(path, max_tokens=50, skip_bad_lines=True)
    assert t.skipped == 1 and len(t.requests) == 2
    assert len(read_trace(path, max_tokens=106).requests) == 3  # 6 + 100 fits exactly


def test_json_array_file_is_named_as_such(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps(TOK_GOOD, indent=2))
    for skip in (False, True):
        with pytest.raises(TraceFormatError, match=rf"{path}:1: .*one JSON array.*one JSON object per line"):
            read_trace(path, skip_bad_lines=skip)


def test_gzip_trace_reads_like_the_plain_one(tmp_path):
    import gzip

    plain = write(tmp_path / "m.jsonl", MC_GOOD)
    packed = tmp_path / "m.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    a, b = read_trace(plain), read_trace(packed)
    assert b.format == "mooncake" and b.prompt_tokens == a.prompt_tokens
    assert [r.block_ids.tolist() for r in a.requests] == [r.block_ids.tolist() for r in b.requests]
    broken = tmp_path / "x.jsonl.gz"
    broken.write_bytes(gzip.compress(plain.read_bytes())[:20])
    with pytest.raises(TraceFormatError, match=f"{broken}: not a readable gzip file"):
        read_trace(broken)


@pytest.mark.parametrize("block", [16, 64])
def test_block_tokens_sets_the_block_size(tmp_path, block):
    rows = [{"timestamp": 0, "input_length": 3 * block - 1, "output_length": 1, "hash_ids": [1, 2, 3]},
            {"timestamp": 1, "input_length": 2 * block, "output_length": 1, "hash_ids": [1, 2]}]
    path = write(tmp_path / "b.jsonl", rows)
    t = read_trace(path, block_tokens=block)
    assert t.block_tokens == block and t.prompt_tokens == 5 * block - 1
    with pytest.raises(TraceFormatError, match=r":1: .*ceil\(\d+/512\) = 1 \(another block size\? pass --block-tokens\)"):
        read_trace(path)  # the default is Mooncake's 512
    with pytest.raises(TraceFormatError, match="block_tokens must be a positive integer"):
        read_trace(path, block_tokens=0)


@pytest.mark.parametrize("limit", [0, -1, 8.5, True, "8192"])
def test_a_max_tokens_that_is_not_a_positive_int_is_refused_as_such(tmp_path, limit):
    """Not every line "longer than the model's maximum of 0": the argument is named."""
    path = write(tmp_path / "t.jsonl", [{"timestamp": 0, "session_id": "s", "input_ids": [1, 2], "output_length": 1}])
    with pytest.raises(TraceFormatError, match=f"max_tokens must be a positive integer or None, got {limit!r}"):
        read_trace(path, max_tokens=limit)
    assert len(read_trace(path, max_tokens=3).requests) == 1


# --- fuzz: random bytes and random JSON structures, one per line ---

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.sampled_from(["\ud800", "a\udfff"]),  # lone surrogates: valid JSON, not UTF-8-encodable
)
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
_keys = st.sampled_from(["timestamp", "input_length", "output_length", "hash_ids", "tenant",
                         "session_id", "input_ids", "output_ids"])
_ids_value = st.lists(st.integers(-2, (1 << 32) + 2), max_size=6)
_records = st.dictionaries(_keys, st.one_of(_json, _ids_value, st.integers(0, 2000)), max_size=8)


def _line(drawn: tuple) -> bytes:
    kind, value, *extra = drawn
    if kind == "bytes":
        line = value
    elif kind == "spliced":  # a record with random bytes put inside it
        text = json.dumps(value).encode()
        at = extra[1] % (len(text) + 1)
        line = text[:at] + extra[0] + text[at:]
    elif kind == "deep":
        line = b'{"input_ids": ' + b"[" * value + b"]" * value + b"}"
    elif kind == "digits":
        line = b'{"timestamp": 0, "input_length": ' + b"7" * value + b', "hash_ids": [1]}'
    else:
        line = json.dumps(value).encode()
    return line.replace(b"\n", b" ")


_lines_strategy = st.lists(
    st.one_of(st.tuples(st.just("bytes"), st.binary(max_size=40)),
              st.tuples(st.just("json"), _records), st.tuples(st.just("json"), _json),
              st.tuples(st.just("spliced"), _records, st.binary(min_size=1, max_size=3),
                        st.integers(0, 1000)),
              st.tuples(st.just("deep"), st.sampled_from([3, 40, 5000, 100_000])),
              st.tuples(st.just("digits"), st.sampled_from([5, 20, 400, 5000]))),
    min_size=1, max_size=6,
)


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(lines=_lines_strategy, fmt=st.sampled_from(["auto", "mooncake", "tokens"]))
def test_fuzz_every_failure_names_file_and_line(tmp_path, lines, fmt):
    path = write_bytes(tmp_path / "f.jsonl", [_line(x) for x in lines])
    numbered = [i + 1 for i, raw in enumerate(path.read_bytes().split(b"\n")[:-1]) if raw.strip()]
    for skip in (False, True):
        try:
            t = read_trace(path, fmt, skip_bad_lines=skip, max_tokens=1 << 20)
        except TraceFormatError as e:
            msg = str(e)
            assert msg.startswith(f"{path}:"), msg
            where = msg[len(str(path)) + 1:].split(":", 1)[0]
            if where.strip().isdigit():
                assert int(where) in numbered, msg
            else:  # file-level: nothing usable, or the format cannot be told
                assert any(s in msg for s in ("no valid request", "no parsable JSON line")), msg
            continue
        assert t.skipped + len(t.requests) == len(numbered) or not skip
        for r in t.requests:
            assert r.line in numbered and r.input_length >= 1
            assert r.input_length + r.output_length <= 1 << 20
            ids = r.input_ids if r.input_ids is not None else r.block_ids
            assert ids is not None and ids.dtype == np.uint32
            (r.tenant or "").encode("utf-8")
