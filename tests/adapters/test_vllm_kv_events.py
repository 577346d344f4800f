"""vLLM's KV cache events from ``HybridCacheScheduler`` (issue 14, item 4).

vLLM's real ``Scheduler`` runs with vLLM's own ``KVEventsConfig``; the events it publishes
(``update_from_output`` takes them from the manager and hands a ``KVEventBatch`` to its
publisher) are recorded by a publisher of vLLM's interface and replayed as a router would:

- the hashes equal those native vLLM sends for the same requests (its own manager, run on
  the same sessions), with the same parent hash and tokens per block;
- a replay of stored / removed events ends with exactly what the cache holds (a missing
  removal or a removal of a block never stored fails);
- ``reset_prefix_cache`` ends with ``AllBlocksCleared``;
- with ``--prefix-match-unit``, sub-block tails are announced as native vLLM's partial
  entries (native's are among ours; each is the hash of its tokens) and their drops as
  removals; ``kv_cache_report_mode="full"`` reports the blocks a hit reuses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

try:
    from hybridcache.adapters.vllm import HybridCacheScheduler
    from hybridcache.adapters.vllm.kv_events import VllmKVEvents
except Exception as exc:  # pragma: no cover - vLLM missing or incompatible
    pytest.skip(f"vLLM adapter not importable: {exc}", allow_module_level=True)

import vllm_sched_harness as h  # noqa: E402
from vllm.config import KVEventsConfig  # noqa: E402
from vllm.distributed.kv_events import (  # noqa: E402
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisher,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

pytestmark = pytest.mark.vllm

ATTN = 1  # make_scheduler: group 0 is the GDN group, group 1 attention
MAMBA = 0


class RecordingPublisher(EventPublisher):
    """vLLM's publisher interface, keeping the batches instead of sending them."""

    def __init__(self) -> None:
        self.batches: list[Any] = []

    def publish(self, events: Any) -> None:
        self.batches.append(events)

    def shutdown(self) -> None:
        pass

    @property
    def events(self) -> list[Any]:
        return [e for b in self.batches for e in b.events]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return h.write_config_dir(tmp_path_factory.mktemp("qwen3next_events"))


def events_scheduler(model_dir: Path, cls: type, num_blocks: int, **kw: Any) -> tuple[Any, RecordingPublisher]:
    sched = h.make_scheduler(
        model_dir, cls, num_blocks,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"), **kw)
    rec = RecordingPublisher()
    sched.kv_event_publisher = rec  # the scheduler publishes each step's batch here
    return sched, rec


def workload(seed: int = 7) -> dict[str, list[h.Turn]]:
    return h.chats_and_document(seed, chats=3, turns=3, first=(40, 30), later=(50, 20),
                                answers=(20, 12), questions=3)


def stored_blocks(events: list[Any], group: int) -> dict[Any, tuple[Any, tuple[int, ...]]]:
    """Per stored full block of ``group``: (parent hash, its tokens), as a router reads them.

    Partial entries (``block_size`` = the hash unit: native vLLM's with
    ``--prefix-match-unit``, our sub-block tails) are left out (see ``partial_blocks``).
    """
    out: dict[Any, tuple[Any, tuple[int, ...]]] = {}
    for e in events:
        if not isinstance(e, BlockStored) or e.group_idx != group or e.block_size != h.BLOCK:
            continue
        bs = e.block_size
        for k, hsh in enumerate(e.block_hashes):
            parent = e.parent_block_hash if k == 0 else e.block_hashes[k - 1]
            out[hsh] = (parent, tuple(e.token_ids[k * bs:(k + 1) * bs]))
    return out


def replay(events: list[Any], group: int) -> tuple[set[Any], list[str]]:
    """A router's view of ``group`` after the events, and what was inconsistent."""
    live: set[Any] = set()
    errors: list[str] = []
    for e in events:
        if isinstance(e, AllBlocksCleared):
            live.clear()
        elif getattr(e, "group_idx", None) != group:
            continue
        elif isinstance(e, BlockStored):
            if e.parent_block_hash is not None and e.parent_block_hash not in live and group == ATTN:
                errors.append("stored under a parent that is not cached")
            live.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            for hsh in e.block_hashes:
                if hsh not in live:
                    errors.append("removed a block that is not cached")
                live.discard(hsh)
    return live, errors


def cached_counts(sched: Any) -> tuple[int, int]:
    """KV units and snapshots the core holds now (its own books)."""
    index = sched.kv_cache_manager.manager.index
    return index.kv_units, index.snapshots


@pytest.mark.parametrize("unit", [None, 16], ids=["block-hashes", "prefix-match-unit-16"])
def test_stored_hashes_equal_native_vllms(model_dir, unit):
    """Also when vLLM hashes 16-token units (``--prefix-match-unit``: events still name
    64-token blocks, hashed by vLLM's block-size view of the finer hashes)."""
    kw = {} if unit is None else {"prefix_match_unit": unit, "retention": None}
    ours, rec = events_scheduler(model_dir, HybridCacheScheduler, 400, **kw)
    native, nrec = events_scheduler(model_dir, Scheduler, 400, **kw)
    h.drive(ours, workload())
    h.drive(native, workload())
    mine, theirs = stored_blocks(rec.events, ATTN), stored_blocks(nrec.events, ATTN)
    assert len(mine) >= 12
    assert mine == theirs  # same hashes, parents and tokens per block as native vLLM
    e = next(e for e in rec.events if isinstance(e, BlockStored))
    n = next(e for e in nrec.events if isinstance(e, BlockStored) and e.group_idx == ATTN)
    for f in ("block_size", "medium", "lora_id", "lora_name", "kv_cache_spec_kind"):
        assert getattr(e, f) == getattr(n, f), f
    assert e.medium == MEDIUM_GPU
    # State entries are announced on the GDN group, under the same hashes.
    states = stored_blocks(rec.events, MAMBA)
    assert states and set(states) <= set(theirs)


def test_removals_follow_evictions_and_reset_clears(model_dir):
    sched, rec = events_scheduler(model_dir, HybridCacheScheduler, 24)
    h.drive(sched, workload(3))
    assert any(isinstance(e, BlockRemoved) for e in rec.events)
    kv_live, errors = replay(rec.events, ATTN)
    state_live, state_errors = replay(rec.events, MAMBA)
    assert not errors and not state_errors
    assert sched.kv_cache_manager.kv_events.unmapped == 0  # every stored entry announced
    assert (len(kv_live), len(state_live)) == cached_counts(sched)
    assert sched.reset_prefix_cache()
    tail = sched.kv_cache_manager.take_events()  # what the next step would publish
    evs = rec.events + tail
    assert isinstance(evs[-1], AllBlocksCleared)
    assert replay(evs, ATTN)[0] == set()


class _WrongParent(VllmKVEvents):
    def _stored(self, ev, request, view):  # type: ignore[override]
        n = len(self.out)
        super()._stored(ev, request, view)
        for e in self.out[n:]:
            e.parent_block_hash = None


class _NoRemovals(VllmKVEvents):
    def _removed(self, ev):  # type: ignore[override]
        pass


def _with(sched: Any, cls: type) -> None:
    mgr = sched.kv_cache_manager
    old = mgr.kv_events
    old.close()
    mgr.kv_events = cls.for_adapter(mgr, old.hash_block_size)


def test_a_wrong_parent_hash_is_caught(model_dir):
    ours, rec = events_scheduler(model_dir, HybridCacheScheduler, 400)
    native, nrec = events_scheduler(model_dir, Scheduler, 400)
    _with(ours, _WrongParent)
    h.drive(ours, workload())
    h.drive(native, workload())
    assert stored_blocks(rec.events, ATTN) != stored_blocks(nrec.events, ATTN)


def test_a_missing_removal_is_caught(model_dir):
    sched, rec = events_scheduler(model_dir, HybridCacheScheduler, 24)
    _with(sched, _NoRemovals)
    h.drive(sched, workload(3))
    kv_live, _ = replay(rec.events, ATTN)
    assert len(kv_live) != cached_counts(sched)[0]


def test_disabled_events_record_nothing(model_dir):
    sched = h.make_scheduler(model_dir, HybridCacheScheduler, 400)
    h.drive(sched, workload())
    mgr = sched.kv_cache_manager
    assert mgr.kv_events is None and mgr.manager.index.events is None
    assert mgr.take_events() == []


def _e2e(model: Path, out: Path, *extra: str) -> dict:
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")
    script = Path(__file__).with_name("vllm_kv_events_e2e.py")
    r = subprocess.run([sys.executable, str(script), str(model), str(out), *extra], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return json.loads(out.read_text())


def _e2e_blocks(res: dict, kind: str) -> set[tuple]:
    out = set()
    for e in res["events"]:
        if e["type"] != "BlockStored" or e["kv_cache_spec_kind"] != kind:
            continue
        bs = e["block_size"]
        for k, hsh in enumerate(e["block_hashes"]):
            parent = e["parent_block_hash"] if k == 0 else e["block_hashes"][k - 1]
            out.add((hsh, parent, tuple(e["token_ids"][k * bs:(k + 1) * bs])))
    return out


@pytest.mark.slow
def test_llm_publishes_native_hashes_over_zmq(tiny_qwen3_next, tmp_path):
    """``LLM(..., kv_events_config=...)`` with vLLM's ZeroMQ publisher, read by a subscriber:
    our scheduler announces the blocks native vLLM announces for the same prompts."""
    from hybridcache.adapters.vllm.scheduler import HybridCacheScheduler as cls

    ours = _e2e(tiny_qwen3_next, tmp_path / "ours.json",
                "--scheduler-cls", f"{cls.__module__}.{cls.__qualname__}")
    native = _e2e(tiny_qwen3_next, tmp_path / "native.json")
    mine, theirs = _e2e_blocks(ours, "full_attention"), _e2e_blocks(native, "full_attention")
    assert len(mine) >= 3 and mine == theirs
    states = {b[0] for b in _e2e_blocks(ours, "mamba")}
    assert states and states <= {b[0] for b in theirs}
    assert {e["medium"] for e in ours["events"]} == {MEDIUM_GPU}


@pytest.mark.parametrize("seed", range(8))
def test_random_streams_replay_to_the_cache(model_dir, seed):
    """Random sessions, pool sizes, admission and eviction policies: a router replaying
    the events ends with exactly the blocks and states the cache holds, never removes a
    block it was not told about, and sees hashes native vLLM gives the same tokens."""
    sessions, kw = h.random_stream(seed)
    sched, rec = events_scheduler(model_dir, HybridCacheScheduler, **kw)
    h.drive(sched, sessions)
    kv_live, errors = replay(rec.events, ATTN)
    state_live, state_errors = replay(rec.events, MAMBA)
    assert not errors and not state_errors
    assert (len(kv_live), len(state_live)) == cached_counts(sched)
    assert sched.kv_cache_manager.kv_events.unmapped == 0
    native, nrec = events_scheduler(model_dir, Scheduler, 400)
    h.drive(native, sessions)
    theirs = stored_blocks(nrec.events, ATTN)
    mine = stored_blocks(rec.events, ATTN)
    assert mine and all(theirs.get(k) == v for k, v in mine.items())


# ---------------------------------------------------------------------- sub-block tails
UNIT = 16


def short_workload(seed: int = 1) -> dict[str, list[h.Turn]]:
    """Prompts that end inside 64-token blocks: hits there are sub-block tails."""
    return h.chats_and_document(seed, chats=3, turns=3, first=(20, 7), later=(15, 3),
                                answers=(20, 12), questions=3)


def partial_blocks(events: list[Any], group: int) -> dict[Any, tuple[Any, tuple[int, ...]]]:
    """Per announced partial entry of ``group`` (``block_size`` = the hash unit): (parent
    hash, the tokens of its last unit)."""
    return {e.block_hashes[0]: (e.parent_block_hash, tuple(e.token_ids)) for e in events
            if isinstance(e, BlockStored) and e.group_idx == group and e.block_size == UNIT}


def replay_partials(events: list[Any], group: int) -> set[Any]:
    """A router's partial entries of ``group`` after the events. (No consistency errors, as
    :func:`replay` has: ``BlockRemoved`` carries no block size, so a removal of a full block
    cannot be told from one of a partial entry here.)"""
    live: set[Any] = set()
    for e in events:
        if isinstance(e, AllBlocksCleared):
            live.clear()
        elif getattr(e, "group_idx", None) != group:
            continue
        elif isinstance(e, BlockStored) and e.block_size == UNIT:
            live.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            live.difference_update(e.block_hashes)
    return live


def unit_chains(sessions: dict[str, list[h.Turn]], res: Any) -> dict[Any, tuple[Any, tuple[int, ...]]]:
    """Every prefix of every request the run served, at the hash unit: vLLM's hash of it
    (as events carry it) -> (its parent's, the last unit's tokens). What a router derives
    from the tokens it routed."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash

    out = {}
    for s, turns in sessions.items():
        history: list[int] = []
        for k, turn in enumerate(turns):
            tokens = history + turn.new_tokens + res.outputs[f"{s}/{k}"]
            parent = None
            for i in range(len(tokens) // UNIT):
                unit = tuple(tokens[i * UNIT:(i + 1) * UNIT])
                hsh = hash_block_tokens(sha256, parent, unit, None)
                key = maybe_convert_block_hash(hsh)
                out[key] = (maybe_convert_block_hash(parent) if parent else None, unit)
                parent = hsh
            history = tokens
    return out


def test_sub_block_tails_are_announced_as_vllms_partial_entries(model_dir):
    """With ``--prefix-match-unit 16``: every tail is one partial entry per group, named as
    native vLLM names its partial entries (hash of the prefix at the unit, its parent, the
    last unit's tokens); native vLLM's prompt-end partials are all among ours."""
    kw = {"prefix_match_unit": UNIT, "retention": None}
    ours, rec = events_scheduler(model_dir, HybridCacheScheduler, 400, **kw)
    native, nrec = events_scheduler(model_dir, Scheduler, 400, **kw)
    res = h.drive(ours, short_workload())
    h.drive(native, short_workload())
    chains = unit_chains(short_workload(), res)
    tails = ours.kv_cache_manager.tails
    assert tails is not None and len(tails.lru) >= 3
    for group in (ATTN, MAMBA):
        mine, theirs = partial_blocks(rec.events, group), partial_blocks(nrec.events, group)
        assert theirs and set(theirs.items()) <= set(mine.items())
        assert all(chains.get(hsh) == v for hsh, v in mine.items())  # the tokens' own hash
        live = replay_partials(rec.events, group)
        assert len(live) == len(tails.lru)  # one entry per tail the cache holds
        e = next(e for e in rec.events if isinstance(e, BlockStored) and e.group_idx == group
                 and e.block_size == UNIT)
        n = next(e for e in nrec.events if isinstance(e, BlockStored) and e.group_idx == group
                 and e.block_size == UNIT)
        for f in ("medium", "lora_id", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"):
            assert getattr(e, f) == getattr(n, f), f
    assert ours.kv_cache_manager.kv_events.unmapped == 0


class _NoTailRemovals(VllmKVEvents):
    def _removed_tails(self):  # type: ignore[override]
        pass


@pytest.mark.parametrize("mutant", [False, True], ids=["events", "no-tail-removals"])
def test_dropped_tails_are_announced_removed(model_dir, mutant):
    """A small pool evicts tails: a router replaying the events holds exactly the tails
    the cache holds (a mutant that forgets the removals is caught)."""
    sched, rec = events_scheduler(model_dir, HybridCacheScheduler, 40,
                                  prefix_match_unit=UNIT, retention=None)
    if mutant:
        _with(sched, _NoTailRemovals)
    h.drive(sched, h.chats_and_document(2, chats=6, turns=3, first=(20, 9), later=(15, 5),
                                        answers=(20, 12), questions=6))
    tails = sched.kv_cache_manager.tails
    assert tails.evicted > 0
    counts = {len(replay_partials(rec.events, g)) for g in (ATTN, MAMBA)}
    assert (counts != {len(tails.lru)}) if mutant else (counts == {len(tails.lru)})
    if not mutant:
        assert sched.reset_prefix_cache()
        evs = rec.events + sched.kv_cache_manager.take_events()
        assert isinstance(evs[-1], AllBlocksCleared) and not replay_partials(evs, ATTN)


def _reports(events: list[Any], baseline: list[Any]) -> list[Any]:
    """The events a run in ``kv_cache_report_mode="full"`` sent beyond the same run in the
    default mode: its reuse reports."""
    def key(e: Any) -> tuple:
        return (type(e).__name__, e.group_idx, tuple(getattr(e, "block_hashes", ())),
                getattr(e, "parent_block_hash", None), getattr(e, "block_size", None))
    left = [key(e) for e in baseline]
    out = []
    for e in events:
        k = key(e)
        if k in left:
            left.remove(k)
        else:
            out.append(e)
    return out


@pytest.mark.parametrize("unit", [None, UNIT], ids=["block-hashes", "prefix-match-unit-16"])
def test_full_report_mode_announces_reused_blocks(model_dir, unit):
    """``kv_cache_report_mode="full"`` (vLLM's per-request option): each hit is reported as
    vLLM's ``emit_cached_block_events`` reports it (per group, parent ``None``, hashes a
    router already holds); the default mode reports nothing of the kind. At block hashes,
    native vLLM's reports have the same shape (vLLM 0.32 raises on a sub-block hit in this
    mode, so there only ours run)."""
    kw = {} if unit is None else {"prefix_match_unit": unit, "retention": None}
    work = short_workload() if unit else workload()
    classes = [HybridCacheScheduler] + ([Scheduler] if unit is None else [])
    for cls in classes:
        runs = {}
        for mode in ("incremental", "full"):
            sched, rec = events_scheduler(model_dir, cls, 400, **kw)
            h.drive(sched, work, extra_args={"kv_cache_report_mode": mode})
            runs[mode] = rec.events
        reports = _reports(runs["full"], runs["incremental"])
        assert reports and all(isinstance(e, BlockStored) for e in reports), cls
        full = [e for e in reports if e.block_size == h.BLOCK]
        assert full and all(e.parent_block_hash is None for e in full)
        by_group = {g: sorted(tuple(e.block_hashes) for e in full if e.group_idx == g)
                    for g in (ATTN, MAMBA)}
        assert by_group[ATTN] == by_group[MAMBA]  # one report per group, as vLLM's
        known = set(stored_blocks(runs["incremental"], ATTN))
        assert all(hsh in known for e in full for hsh in e.block_hashes)
        if unit is not None:  # a sub-block hit also reports its tail's partial entry
            partial = [e for e in reports if e.block_size == unit]
            assert partial and set(partial_blocks(partial, ATTN)) <= set(
                partial_blocks(runs["incremental"], ATTN))
