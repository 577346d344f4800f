"""End to end in a real vLLM on CPU: ``HybridCacheConnector`` with a real redis-server.

The tiny random Qwen3-Next (2 Gated DeltaNet + 2 attention layers, built here, nothing
downloaded) serves the multi-turn workload of :mod:`vllm_e2e_workload` three times, each in
a fresh process:

1. without a connector (vLLM's own prefix cache only): the reference outputs;
2. with the connector and an empty Redis: it saves KV + GDN states as it goes;
3. with the connector in a *new* engine (empty device cache) on the same Redis: prompts
   resume from the saved prefixes (external hits, loaded before the forward pass);
4. and 5. as 2. and 3. with ``HybridCacheScheduler`` plus the connector (another Redis):
   the tier receives the snapshots our manager keeps, the new engine loads from it into
   our manager's blocks. Run 1 is shared by both tests.

Greedy outputs are compared as in ``test_vllm_e2e.py`` (identity up to bf16 near-ties,
every logprob before a divergence within ``TOL``). That tolerance alone would not catch a
lost recurrent state on this random model (its GDN layers forget fast: zeroing the restored
state moves logprobs by ~0.004, measured). But vLLM's ``align`` mode cuts prefill chunks at
the same block boundaries whether a prefix is computed or restored, so a request resumed
from a correctly restored prefix computes the same products as the reference and its
logprobs are *bit-identical* (unless its batch differs): the test requires that for at
least one request that resumed deeper than the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

try:
    import hybridcache.adapters.vllm  # noqa: F401
except ImportError as exc:
    pytest.skip(f"vLLM adapter not importable: {exc}", allow_module_level=True)

import vllm_connector_harness as ch  # noqa: E402
from vllm_e2e_workload import SCHEDULER, check_same_greedy, serve  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.redis]


@pytest.fixture(scope="module")
def native(tiny_qwen3_next: Path, tmp_path_factory) -> dict:
    """The reference: vLLM without connector (its own prefix cache only)."""
    return serve(tiny_qwen3_next, tmp_path_factory.mktemp("native") / "native.json")


def kv_transfer(url: str) -> str:
    """``--kv-transfer-config`` for the connector on the Redis at ``url``."""
    return json.dumps(ch.transfer_dict(ch.redis_extra(url)))


def test_qwen3_next_restarts_from_redis(tiny_qwen3_next, native, redis_server, tmp_path):
    cfg = kv_transfer(redis_server.url)
    first = serve(tiny_qwen3_next, tmp_path / "first.json", "--kv-transfer-config", cfg)
    second = serve(tiny_qwen3_next, tmp_path / "second.json", "--kv-transfer-config", cfg)
    notes = check_same_greedy(native, first) + check_same_greedy(native, second)

    c1, c2 = first["connector"], second["connector"]
    cached = {k: sum(r["num_cached_tokens"] for r in run["requests"])
              for k, run in (("native", native), ("first", first), ("second", second))}
    exact = sum(a["output"] == b["output"]
                for a, b in zip(native["requests"], second["requests"]))
    print(f"\nblock size {native['block_size']}; num_cached_tokens native {cached['native']}, "
          f"connector 1st run {cached['first']}, 2nd run (new engine) {cached['second']} "
          f"(external {c2['scheduler']['hit_tokens']}); identical outputs {exact}/"
          f"{len(native['requests'])}; run time {native['total_s']:.0f} / "
          f"{first['total_s']:.0f} / {second['total_s']:.0f} s")
    _print_runs(native, first, second, notes)

    # The first run finds an empty Redis and saves; the second, in a fresh engine whose
    # device cache is empty, resumes every prompt from the tier.
    assert c1["scheduler"]["hit_tokens"] == 0
    assert c1["worker"]["saves"] > 0 and c1["worker"]["save_failures"] == 0
    assert c2["scheduler"]["hit_tokens"] > 0
    assert c2["worker"]["loads"] > 0 and c2["worker"]["load_failures"] == 0
    assert cached["second"] > cached["native"]
    deeper_exact = [
        a["name"] for a, c in zip(native["requests"], second["requests"])
        if c["num_cached_tokens"] > a["num_cached_tokens"] and a["logprobs"] == c["logprobs"]
    ]
    print(f"  resumed deeper than the reference with bit-identical logprobs: {deeper_exact}")
    assert deeper_exact
    for a, c in zip(native["requests"], second["requests"]):
        assert c["num_cached_tokens"] >= a["num_cached_tokens"], a["name"]
        assert c["num_cached_tokens"] > 0, a["name"]  # even the very first prompt
        if a["num_cached_tokens"] == c["num_cached_tokens"]:
            assert a["output"] == c["output"], a["name"]


def _print_runs(native: dict, first: dict, second: dict, notes: list[str]) -> None:
    """Per-request cached tokens of the three runs and the worker counters (for the log)."""
    print(f"  1st run worker: {first['connector']['worker']}\n"
          f"  2nd run worker: {second['connector']['worker']}")
    for a, b, c in zip(native["requests"], first["requests"], second["requests"]):
        print(f"  {a['name']:16s} prompt {a['prompt_len']:4d}  cached native "
              f"{a['num_cached_tokens']:4d}  1st {b['num_cached_tokens']:4d}  "
              f"2nd {c['num_cached_tokens']:4d}")
    for n in notes:
        print("  " + n)


def test_hybridcache_scheduler_with_connector_restarts_from_redis(
    tiny_qwen3_next, native, redis_server, tmp_path
):
    """``--scheduler-cls HybridCacheScheduler`` plus the connector: the first engine saves
    the snapshots our manager keeps (prompt ends, branch points, turn ends); a new engine
    on the same Redis resumes from them, and outputs match vLLM without connector."""
    cfg = kv_transfer(redis_server.url)
    sched = ("--scheduler-cls", SCHEDULER)
    first = serve(tiny_qwen3_next, tmp_path / "first.json", *sched, "--kv-transfer-config", cfg)
    second = serve(tiny_qwen3_next, tmp_path / "second.json", *sched, "--kv-transfer-config", cfg)
    notes = check_same_greedy(native, first) + check_same_greedy(native, second)
    c1, c2 = first["connector"], second["connector"]
    h1, h2 = first["hybridcache"], second["hybridcache"]
    cached = {k: sum(r["num_cached_tokens"] for r in run["requests"])
              for k, run in (("native", native), ("first", first), ("second", second))}
    print(f"\nours+connector: num_cached_tokens native {cached['native']}, 1st run "
          f"{cached['first']}, 2nd run (new engine) {cached['second']} (external "
          f"{c2['scheduler']['hit_tokens']}, loads {h2['external_loads_completed']}); "
          f"run time {first['total_s']:.0f} / {second['total_s']:.0f} s")
    _print_runs(native, first, second, notes)

    assert c1["scheduler"]["hit_tokens"] == 0 and h1["boundary_offers"] > 0
    assert c1["worker"]["saves"] > 0 and c1["worker"]["save_failures"] == 0
    assert c2["scheduler"]["hit_tokens"] > 0
    assert c2["worker"]["loads"] == h2["external_loads_completed"] > 0
    assert c2["worker"]["load_failures"] == 0 and h2["external_loads_dropped"] == 0
    assert h1["saves_dropped"] == h2["saves_dropped"] == 0
    assert cached["second"] > cached["first"] >= cached["native"]
    for b, c in zip(first["requests"], second["requests"]):
        assert c["num_cached_tokens"] >= b["num_cached_tokens"] and c["num_cached_tokens"] > 0
    # As in the test above: a request resumed from Redis deeper than the first run, whose
    # chunks after the hit are the same in both runs, must compute bit-identically (a
    # lost or misplaced state would change its logprobs, however slightly).
    deeper_exact = [
        b["name"] for b, c in zip(first["requests"], second["requests"])
        if c["num_cached_tokens"] > b["num_cached_tokens"] and b["logprobs"] == c["logprobs"]
    ]
    print(f"  resumed deeper than the 1st run with bit-identical logprobs: {deeper_exact}")
    assert deeper_exact
