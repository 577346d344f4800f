"""The ``spare-interval`` admission rule: checkpoints taken only into free room, first to evict.

Free room is free: while the arena has a free slot an extra checkpoint costs nothing, and
ranked below every other entry it leaves under pressure before anything the other rules made.
These tests hold the rule to those two promises, to the FLOPs its neighbours are valued by,
and the adaptive policy (which takes spare checkpoints at its densest candidate's spacing) to
the hits a dense setting gets with memory to spare.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from hybridcache.adaptive import BASE_RULES, AdaptiveManager, spare_interval
from hybridcache.admission import AdmissionPolicy, spare_points
from hybridcache.errors import UnknownNameError
from hybridcache.events import REMOVED, STORED
from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.port import EnginePort

UNIT = 16
SPARE = 352


def _serve(m: HybridCacheManager, rid: str, tokens: np.ndarray) -> int:
    """One request through the manager; returns its hit tokens."""
    m.add_request(rid, tokens)
    hit = m.match(rid).hit_tokens
    m.allocate(rid, len(tokens) - hit)
    m.commit(rid, len(tokens))
    m.free(rid)
    return hit


def _doc(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.uint32)


def test_rule_parses_and_refuses_bad_spacing():
    p = AdmissionPolicy.parse("last-token+spare-interval:352", UNIT)
    assert p.spare_interval == 352 and p.interval == 0 and p.last_token
    assert list(spare_points(p, 0, 1100)) == [352, 704, 1056]
    assert list(spare_points(p, 352, 704)) == [704]
    assert not spare_points(AdmissionPolicy.parse("last-token", UNIT), 0, 10_000)
    for bad in ("spare-interval:100", "spare-interval:0", "spare-interval:x", "spare-interval"):
        with pytest.raises(UnknownNameError):
            AdmissionPolicy.parse(bad, UNIT)


def test_spare_checkpoints_take_free_room_and_never_evict(kimi):
    """With room to spare every spare boundary gets a snapshot; when the room runs out the
    rule stops (it evicts nothing): the same prompts with and without it evict the same KV.
    Prompts are a unit plus one token long, so no KV unit lies past the last-token snapshot
    (such a stranded unit would rank with the spares)."""
    cap = 24 * HybridCacheManager(kimi, 1 << 30, CacheConfig(hash_unit=UNIT)).layout.block_bytes
    spare = HybridCacheManager(kimi, cap, CacheConfig(hash_unit=UNIT, admission=f"last-token+spare-interval:{SPARE}"))
    plain = HybridCacheManager(kimi, cap, CacheConfig(hash_unit=UNIT, admission="last-token"))
    _serve(spare, "a", _doc(1, 4001))
    _serve(plain, "a", _doc(1, 4001))
    # 11 spare boundaries below 4000 tokens and the last-token one; nothing evicted.
    assert spare.metrics.snapshots_saved == 4000 // SPARE + 1
    assert not spare.index.evictions["kv"] + spare.index.evictions["state"]
    # A prompt that needs more than the free room: spares stop, never evict for themselves.
    _serve(spare, "b", _doc(10**6, 60_001))
    _serve(plain, "b", _doc(10**6, 60_001))
    assert spare.index.evictions["state"], "the second prompt must need the spares' room"
    assert spare.metrics.snapshots_saved == 4000 // SPARE + 2  # b's last-token one alone
    assert spare.index.evictions["kv"] == plain.index.evictions["kv"]
    assert spare.index.evictions["state"] <= 4000 // SPARE  # only spares went
    assert _serve(spare, "a2", _doc(1, 4001)) == _serve(plain, "a2", _doc(1, 4001)) == 4000
    # A prompt that wants more spares than the free room holds: as many as fit, and the
    # entries of an earlier prompt (evictable) stay.
    one = HybridCacheManager(kimi, cap, CacheConfig(hash_unit=UNIT, admission=f"last-token+spare-interval:{SPARE}"))
    _serve(one, "s", _doc(10**7, 401))
    _serve(one, "c", _doc(1, 40_001))
    assert not one.index.evictions["kv"] + one.index.evictions["state"]
    assert 3 < one.metrics.snapshots_saved < 3 + 40_000 // SPARE
    assert _serve(one, "s2", _doc(10**7, 401)) == 400


def test_spare_checkpoints_go_before_every_other_entry(kimi):
    """Under pressure no KV unit and no regular snapshot is evicted while a spare one stays,
    however much the spare one would be worth: a short document's entries (little value)
    and a long one's deep spares (the FLOPs of thousands of tokens each) come first."""
    cap = 24 * HybridCacheManager(kimi, 1 << 30, CacheConfig(hash_unit=UNIT)).layout.block_bytes
    m = HybridCacheManager(kimi, cap, CacheConfig(hash_unit=UNIT, admission=f"last-token+spare-interval:{SPARE}"))
    port = EnginePort(m)
    for i, n in enumerate((401, 6001)):  # a unit plus one token: no KV past the last-token snapshot
        _serve(m, f"r{i}", _doc(1 + 10**6 * i, n))
    stored = [e for e in port.take_events() if e.action == STORED and e.kind == "state"]
    left = {e.digests[0] for e in stored if (e.depth + 1) * UNIT % SPARE == 0}
    assert len(left) == 400 // SPARE + 6000 // SPARE
    _serve(m, "big", _doc(9 * 10**6, 60_001))  # needs most of the cache
    removed = [e for e in port.take_events() if e.action == REMOVED]
    assert removed, "the big prompt must evict"
    for e in removed:
        if e.kind == "state" and e.digests[0] in left:
            left.discard(e.digests[0])
            continue
        assert not left, f"{e.kind} evicted while {len(left)} spare snapshots stayed"


def test_regular_snapshot_is_valued_without_the_spares_below_it(kimi):
    """A snapshot's value is the FLOPs from the snapshot below it: a spare one is evicted
    first, so it must not shrink the value of the regular snapshot above it."""
    flops = {}
    for adm in ("last-token", f"last-token+spare-interval:{SPARE}"):
        m = HybridCacheManager(kimi, 4 << 30, CacheConfig(hash_unit=UNIT, admission=adm))
        port = EnginePort(m)
        _serve(m, "a", _doc(1, 3000))
        ev = [e for e in port.take_events() if e.action == STORED and e.kind == "state"]
        flops[adm] = max(ev, key=lambda e: e.depth).flops
    assert flops["last-token"] == flops[f"last-token+spare-interval:{SPARE}"]


def test_snapshot_after_a_restored_spare_is_valued_from_below_the_spare(kimi):
    """A request that restores a spare checkpoint values its own snapshots from where that
    spare was valued from, not from the spare (which goes first under pressure): a
    document's end reached from a spare halfway is worth what it is worth with no spare."""
    flops = {}
    for adm in ("last-token", f"last-token+spare-interval:{SPARE}"):
        m = HybridCacheManager(kimi, 4 << 30, CacheConfig(hash_unit=UNIT, admission=adm))
        port = EnginePort(m)
        _serve(m, "a", _doc(1, 1500))  # spares at 352, 704, 1056 and 1408
        port.take_events()
        # The same first 1,200 tokens, then its own: restores the third spare, or nothing.
        hit = _serve(m, "b", np.concatenate([_doc(1, 1200), _doc(100_000, 1800)]))
        assert hit == (3 * SPARE if "spare" in adm else 0)
        ev = [e for e in port.take_events() if e.action == STORED and e.kind == "state"]
        flops[adm] = max(ev, key=lambda e: e.depth).flops
    assert flops["last-token"] == flops[f"last-token+spare-interval:{SPARE}"]


def test_adaptive_takes_spares_at_a_sixteenth_of_tokens_per_snapshot(kimi):
    m = AdaptiveManager(kimi, 16 << 30, CacheConfig(hash_unit=UNIT, admission="adaptive"))
    tps = kimi.snapshot_bytes / kimi.kv_bytes_per_token
    assert m.spare_interval == spare_interval(kimi, UNIT) == math.ceil(math.ceil(tps / 16) / UNIT) * UNIT
    spans = [AdmissionPolicy.parse(c.admission, UNIT).interval for c in m.candidates]
    assert all(m.spare_interval < n for n in spans if n)  # denser than every candidate
    assert m.admission.spare_interval == m.spare_interval


def _hit_rate(m: HybridCacheManager) -> float:
    return m.metrics.hit_tokens / m.metrics.prompt_tokens


def test_adaptive_gets_dense_hits_while_memory_lasts(kimi):
    """With memory to spare (nothing is ever evicted) the shadows never compare and the live
    cache stays on its first candidate; its spare checkpoints must still give it the hits of
    the dense candidate replayed as a fixed policy (``sglang-extra`` ahead at 16 GiB). Without
    them (``spare_interval = 0``) it has the first candidate's hits, well below."""
    from tests.sim.test_adaptive import _branching_requests

    rates = {}
    for spare in (True, False):
        m = AdaptiveManager(kimi, 16 << 30, CacheConfig(hash_unit=UNIT, admission="adaptive"))
        if not spare:
            m.spare_interval = 0
            m._use(m._rules)
        _branching_requests(m, 60, 20_000, seed=4)
        assert not m.index.evictions["kv"] + m.index.evictions["state"]
        assert len(m.switches) == 1
        rates[spare] = _hit_rate(m)
    # The dense setting at the spares' spacing (the former ``checkpoints-1/16x`` candidate's).
    dense = f"{BASE_RULES}+interval:{spare_interval(kimi, UNIT)}"
    fixed = HybridCacheManager(kimi, 16 << 30, CacheConfig(hash_unit=UNIT, admission=dense))
    _branching_requests(fixed, 60, 20_000, seed=4)
    assert rates[True] >= _hit_rate(fixed) - 0.002, (rates, _hit_rate(fixed))
    assert rates[False] < _hit_rate(fixed) - 0.02, (rates, _hit_rate(fixed))


def test_a_hit_on_a_spare_checkpoint_equals_a_dense_computation():
    """Real tensors (the reference model over the arena): a prompt that shares 40 tokens with
    an earlier one resumes from that one's spare checkpoint at 32 and generates exactly what
    a cache-free computation does."""
    import torch

    from hybridcache.adapters.reference import ReferenceModel, Runner, RunnerConfig, model_spec
    from hybridcache.kernels.storage import ArenaStorage
    from tests.reference.conftest import TINY

    g = torch.Generator().manual_seed(3)
    first = torch.randint(0, 128, (70,), generator=g).tolist()
    second = first[:40] + torch.randint(0, 128, (30,), generator=g).tolist()
    spec = model_spec(TINY)
    mgr = HybridCacheManager(spec, 1 << 18, CacheConfig(hash_unit=UNIT, admission="last-token+spare-interval:16"))
    storage = ArenaStorage(mgr.layout, spec)
    model = ReferenceModel(TINY)
    runner = Runner(model, mgr, storage, RunnerConfig(prefill_chunk=24))
    for rid, prompt in (("a", first), ("b", second)):
        runner.submit(rid, prompt, 5)
        while not (done := runner.step()):
            pass
        (res,) = done
        dense = model.logits_full(res.history[:-1])[len(prompt) - 1 :]
        assert (res.logits - dense).abs().max() < 1e-5
        assert res.tokens == dense.argmax(-1).tolist()
    assert res.hit_tokens == 32  # a's spare checkpoint (no other rule saves there)
    assert runner.stats.copies == 1
