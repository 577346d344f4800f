"""Block-level (Mooncake) replay: digests vs virtual tokens, tenants, and the real trace.

The shipped 300-line sample (``tests/data/mooncake_sample.jsonl``) runs everywhere; the tests
on the full trace need ``../shared/traces/mooncake_synthetic_trace.jsonl`` beside the clone
and skip without it, naming the missing path in pytest's summary.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from hybridcache.sim.policies import build_policy
from hybridcache.sim.replay import virtual_tokens
from hybridcache.sim.runner import run_one, sweep
from hybridcache.sim.traces import Trace, TraceRequest, read_trace


def mooncake(rows, tenants=None):
    reqs = [TraceRequest(float(i), n, 4, tenant=tenants[i] if tenants else None,
                         block_ids=np.asarray(ids, dtype=np.uint32)) for i, (n, ids) in enumerate(rows)]
    return Trace("<mc>", "mooncake", reqs, block_tokens=512)


ROWS = [(1500, [1, 2, 3]), (2048, [1, 2, 4, 5]), (1100, [1, 2, 6]), (3000, [1, 2, 4, 5, 7, 8])]


def test_block_digests_equal_virtual_tokens(kimi):
    t = mooncake(ROWS)
    as_tokens = Trace("<tok>", "tokens", [
        TraceRequest(r.timestamp, r.input_length, r.output_length, session_id="s",
                     input_ids=virtual_tokens(r, 512)) for r in t.requests])
    for name in ("kv-only", "hybridcache", "marconi"):
        a = run_one(t, build_policy(name, kimi, 512, outputs_known=False), 16 << 30)
        b = run_one(as_tokens, build_policy(name, kimi, 512, outputs_known=False), 16 << 30)
        assert a.hit_tokens == b.hit_tokens, name
    # By hand, KV only: 2nd shares blocks 1, 2 -> 1024; 3rd 1024; 4th shares 1, 2, 4, 5 -> 2048.
    assert run_one(t, build_policy("kv-only", kimi, 512), 16 << 30).hit_tokens == 1024 + 1024 + 2048


def test_vllm_align_on_blocks_uses_inflated_units(kimi):
    # One 1,920-token block covers 3.75 Mooncake blocks; prompts of 3,000 tokens repeated.
    ids = [10, 11, 12, 13, 14, 15]
    t = mooncake([(3000, ids)] * 3)
    r = run_one(t, build_policy("vllm-align", kimi, 512, outputs_known=False), 16 << 30)
    assert r.hit_tokens == 1920  # saved on the 2nd sight, hit on the 3rd


def test_block_trace_tenants_are_salted(kimi):
    t = mooncake([(1100, [1, 2, 3])] * 3, tenants=["x", "y", "x"])
    r = run_one(t, build_policy("kv-only", kimi, 512), 16 << 30)
    assert r.hit_tokens == 1024 and r.per_tenant == {"x": 1024 / 2200, "y": 0.0}


def test_real_trace_reads(mooncake_path):
    t = read_trace(mooncake_path)
    assert t.format == "mooncake" and len(t.requests) == 3993 and t.prompt_tokens == 61_194_628


def test_real_trace_targets(mooncake_path):
    """hybridcache beats the baselines and gets within 5% of free states at 256 GiB."""
    t = read_trace(mooncake_path)
    big = sweep(t, "kimi-linear-48b", ["hybridcache", "kv-only"], [256 << 30], progress=False)
    hc, kv = (r["token_hit_rate"] for r in big["results"])
    assert hc >= 0.95 * kv and 0.64 < kv < 0.66
    mid = sweep(t, "kimi-linear-48b", ["hybridcache", "sglang", "vllm-align"], [32 << 30], progress=False)
    rates = {r["policy"]: r["token_hit_rate"] for r in mid["results"]}
    assert rates["hybridcache"] >= max(rates["sglang"], rates["vllm-align"])


# --- the shipped sample (tests/data/, Apache-2.0, see tests/data/README.md): never skips ---

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "mooncake_sample.jsonl"
SAMPLE_LINES = (3601, 3900)  # 1-based, inclusive, in the full trace


def prefix_oracle(path: Path) -> tuple[int, int]:
    """Hit and prompt tokens of an unlimited KV-only cache at 512-token blocks, counted
    directly from the ids: the longest run of full blocks already seen, as a prefix."""
    seen: set[int] = set()
    hit = total = 0
    for line in path.read_text().splitlines():
        row = json.loads(line)
        ids, n = row["hash_ids"], row["input_length"]
        total += n
        run = 0
        for b in ids[: n // 512]:
            if b not in seen:
                break
            run += 1
        hit += run * 512
        seen.update(ids)
    return hit, total


def test_sample_reads():
    t = read_trace(SAMPLE)
    assert t.format == "mooncake" and t.block_tokens == 512 and t.skipped == 0
    assert len(t.requests) == 300 and t.prompt_tokens == 6_583_920
    assert [r.line for r in t.requests] == list(range(1, 301))


def test_sample_replay_matches_a_direct_count_and_orders_policies():
    t = read_trace(SAMPLE)
    doc = sweep(t, "kimi-linear-48b", ["hybridcache", "vllm-align", "sglang", "kv-only"],
                [128 << 30], progress=False)
    rates = {r["policy"]: r for r in doc["results"]}
    hit, total = prefix_oracle(SAMPLE)
    assert rates["kv-only"]["hit_tokens"] == hit and rates["kv-only"]["prompt_tokens"] == total
    kv = rates["kv-only"]["token_hit_rate"]
    assert kv > 0.5  # the window was cut where the trace reuses prefixes
    hc = rates["hybridcache"]["token_hit_rate"]
    assert hc <= kv and hc >= 0.95 * kv
    assert hc >= max(rates["sglang"]["token_hit_rate"], rates["vllm-align"]["token_hit_rate"])


def test_sample_gzipped_reads_the_same(tmp_path):
    import gzip

    packed = tmp_path / "sample.jsonl.gz"
    packed.write_bytes(gzip.compress(SAMPLE.read_bytes()))
    a, b = read_trace(SAMPLE), read_trace(packed)
    assert a.prompt_tokens == b.prompt_tokens
    assert all(np.array_equal(x.block_ids, y.block_ids) for x, y in zip(a.requests, b.requests))


@pytest.mark.parametrize("block", [16, 64])
def test_finer_block_traces_replay_like_the_virtual_tokens(kimi, block, tmp_path):
    """A trace re-cut at 16 or 64 tokens a block (--block-tokens) finds the same sharing as
    the 512-token original replayed at that unit: each 512-token id becomes 512/block ids."""
    t = read_trace(SAMPLE)
    rows = []
    for r in t.requests[:60]:
        fine = [int(b) * 64 + j for b in r.block_ids.tolist() for j in range(512 // block)]
        rows.append({"timestamp": r.timestamp, "input_length": r.input_length,
                     "output_length": r.output_length, "hash_ids": fine[: -(-r.input_length // block)]})
    fine_path = tmp_path / f"b{block}.jsonl"
    fine_path.write_text("".join(json.dumps(x) + "\n" for x in rows))
    fine_trace = read_trace(fine_path, block_tokens=block)
    coarse = Trace("<c>", "mooncake", t.requests[:60], block_tokens=512)
    a = run_one(fine_trace, build_policy("kv-only", kimi, block), 256 << 30)
    b = run_one(coarse, build_policy("kv-only", kimi, block), 256 << 30)
    assert fine_trace.block_tokens == block and a.prompt_tokens == b.prompt_tokens
    assert a.hit_tokens == b.hit_tokens > 0


def test_sample_is_verbatim_from_the_full_trace(mooncake_path):
    full = mooncake_path.read_bytes().splitlines(keepends=True)
    lo, hi = SAMPLE_LINES
    assert b"".join(full[lo - 1: hi]) == SAMPLE.read_bytes()


def _ids(n):
    return np.arange(n, dtype=np.uint32)


@pytest.mark.parametrize(("request_", "block", "error", "message"), [
    (TraceRequest(1.0, 8100, 93, input_ids=_ids(8100)), 0, "InvalidRequestError",
     r"<gen>: request 1: request of 8,193 tokens \(8,100 prompt \+ 93 output\) is longer than the model's "
     r"maximum of 8,192 \('nemotron-h-8b'.s max_model_len\)"),
    (TraceRequest(1.0, 0, 4, input_ids=_ids(0)), 0, "InvalidRequestError", r"request 1: empty prompt"),
    (TraceRequest(1.0, 100, 4), 0, "TraceFormatError", r"request 1: a token trace's request needs input_ids"),
    (TraceRequest(1.0, 50, 4, input_ids=_ids(100)), 0, "TraceFormatError", r"request 1: 100 input_ids but input_length 50"),
    (TraceRequest(1.0, 100, 4, input_ids=_ids(100), output_ids=_ids(3)), 0, "TraceFormatError",
     r"request 1: 3 output_ids but output_length 4"),
    (TraceRequest(1.0, 1100, 4, block_ids=_ids(2)), 512, "TraceFormatError",
     r"request 1: 'hash_ids' has 2 ids but input_length 1100 needs ceil\(1100/512\) = 3"),
    (TraceRequest(1.0, 1100, 4), 512, "TraceFormatError", r"request 1: 'hash_ids' has no ids but input_length 1100 needs ceil\(1100/512\) = 3"),
])
def test_sweep_refuses_a_bad_request_before_any_replay(monkeypatch, request_, block, error, message):
    """A trace built in code is not read by ``read_trace``, which refuses such lines: ``sweep``
    checks the requests itself, before any replay (nemotron-h-8b serves 8,192 tokens; a
    generated session past that stopped a sweep midway), and each error names the request."""
    import hybridcache.errors
    import hybridcache.sim.runner as runner
    import hybridcache.sim.traces

    def replayed(*a, **k):
        raise RuntimeError("replayed")

    monkeypatch.setattr(runner, "run_one", replayed)
    if block:
        ok = TraceRequest(0.0, 1024, 4, block_ids=_ids(2))
    else:
        ok = TraceRequest(0.0, 8000, 192, input_ids=_ids(8000), output_ids=_ids(192))
    fmt = "mooncake" if block else "tokens"
    cls = getattr(hybridcache.errors, error, None) or getattr(hybridcache.sim.traces, error)
    with pytest.raises(cls, match=message):
        sweep(Trace("<gen>", fmt, [ok, request_], block_tokens=block), "nemotron-h-8b", ["hybridcache"],
              [4 << 30], progress=False)
    with pytest.raises(RuntimeError, match="replayed"):  # the good request alone: the replay starts
        sweep(Trace("<gen>", fmt, [ok], block_tokens=block), "nemotron-h-8b", ["hybridcache"], [4 << 30],
              progress=False)


@pytest.mark.parametrize("unit", [0, -16, True, 8.0])
def test_sweep_refuses_a_hash_unit_that_is_not_a_positive_int(unit):
    from hybridcache.errors import ConfigError

    ok = TraceRequest(0.0, 100, 4, input_ids=_ids(100))
    with pytest.raises(ConfigError, match="hash_unit must be an int >= 1"):
        sweep(Trace("<gen>", "tokens", [ok]), "kimi-linear-48b", ["hybridcache"], [4 << 30], hash_unit=unit,
              progress=False)


@pytest.mark.parametrize(("policies", "capacities", "problem"), [
    (["hybridcache", "sglang", "hybridcache"], [4 << 30], "policies name 'hybridcache' twice"),
    (["hybridcache"], [4 << 30, 2 << 30, 4 << 30], f"capacities name {4 << 30} twice"),
    ([], [4 << 30], "at least one of policies"),
    (["hybridcache"], [], "at least one of capacities"),
    ("hybridcache", [4 << 30], "policies must be a list, got str 'hybridcache'"),
    (["hybridcache"], 4 << 30, f"capacities must be a list, got int {4 << 30}"),
    (["hybridcache"], [[4 << 30]], "capacities must list names or sizes"),
])
def test_sweep_refuses_policies_or_capacities_not_a_list_of_distinct_items(policies, capacities, problem, monkeypatch):
    """Results are keyed by policy and capacity: a repeat replayed the cell again and listed
    it twice. The refusal comes before any replay."""
    import hybridcache.sim.runner as runner
    from hybridcache.errors import ConfigError

    # A replay fails the test at once (pytest.fail is not a ConfigError, so raises() lets it through).
    monkeypatch.setattr(runner, "run_one", lambda *a, **k: pytest.fail("replayed before refusing"))
    ok = TraceRequest(0.0, 100, 4, input_ids=_ids(100))
    with pytest.raises(ConfigError, match=re.escape(problem)):
        sweep(Trace("<gen>", "tokens", [ok]), "kimi-linear-48b", policies, capacities, progress=False)


def test_sweep_takes_a_numpy_hash_unit_as_an_int():
    trace = Trace("<gen>", "tokens", [TraceRequest(0.0, 100, 4, input_ids=_ids(100))])
    doc = sweep(trace, "kimi-linear-48b", ["hybridcache"], [2 << 30], hash_unit=np.int64(32), progress=False)
    assert doc["hash_unit"] == 32 and type(doc["hash_unit"]) is int


def test_sweep_takes_capacities_from_any_iterable_once():
    """A generator or an array of capacities is read once into a list: every policy replays
    every capacity (a generator walked once per policy served only the first)."""
    import numpy as np

    trace = Trace("<gen>", "tokens", [TraceRequest(0.0, 100, 4, input_ids=_ids(100))])
    for caps in ((c for c in (2 << 30, 4 << 30)), np.array([2 << 30, 4 << 30])):
        doc = sweep(trace, "kimi-linear-48b", ["hybridcache", "sglang"], caps, progress=False)
        got = [(r["policy"], r["capacity_bytes"]) for r in doc["results"]]
        assert got == [(p, c) for p in ("hybridcache", "sglang") for c in (2 << 30, 4 << 30)], got
