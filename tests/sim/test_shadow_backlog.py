"""The adaptive policy's shadows wait for the live cache's pressure (hybridcache.shadow_backlog).

Before the live cache evicts an entry its rules value, no candidate can beat the setting
it starts from, so the sampled requests wait in a backlog and the shadows replay them,
in order and a few per finished request, once that pressure comes. Each test here fails
without one half of it: fed before the pressure, fed all at once, fed out of order.
"""

from __future__ import annotations

import pytest

from hybridcache import adaptive, shadow_backlog
from hybridcache.admission import AdmissionPolicy
from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.shadow_backlog import (
    DRAIN_PER_REQUEST,
    Backlog,
    Sampled,
    backlog_for,
    live_pressure,
)
from hybridcache.sim.generate import generate

ADAPTIVE = CacheConfig(hash_unit=16, admission="adaptive", eviction="value")


def serve(m: HybridCacheManager, reqs, on_finished=None) -> None:
    for i, r in enumerate(reqs):
        rid = str(i)
        res = m.add_request(rid, r.input_ids, tenant=r.tenant)
        m.allocate(rid, r.input_length + r.output_length - res.hit_tokens)
        if r.output_ids is not None and len(r.output_ids):
            m.append_tokens(rid, r.output_ids)
        m.commit(rid, r.input_length + r.output_length)
        m.free(rid)
        if on_finished is not None:
            on_finished(m)


@pytest.fixture(scope="module")
def chat():
    """300 chat requests: at 4 GiB the live cache first comes under pressure near request
    130 (seed 3), and the backlog drains well before the end."""
    return generate("chat", 300, seed=3, tenants=2)


def test_the_shadows_wait_for_the_live_cache_s_pressure_then_drain_a_few_at_a_time(kimi, chat):
    m = HybridCacheManager(kimi, 4 << 30, ADAPTIVE)
    seen: list[tuple[bool, int, int]] = []
    serve(m, chat, lambda m: seen.append((live_pressure(m.index), m.sampled, len(m._backlog))))
    onset = next(i for i, (pressed, _, _) in enumerate(seen) if pressed)
    assert 20 < onset < 250, onset  # the trace must hold both phases
    assert all(fed == 0 for _, fed, _ in seen[:onset]), "fed before the live cache was under pressure"
    assert seen[onset - 1][2] > DRAIN_PER_REQUEST, "no backlog to drain"
    steps = [b[1] - a[1] for a, b in zip(seen[onset - 1:], seen[onset:])]
    assert max(steps) == DRAIN_PER_REQUEST, steps[:10]
    assert seen[-1][2] == 0 and m.sampled > seen[onset - 1][2], "the backlog never drained"
    m._backlog.sanity_check()


def test_without_the_wait_the_shadows_are_fed_from_the_first_sampled_request(kimi, chat, monkeypatch):
    monkeypatch.setattr(shadow_backlog, "WAIT_FOR_PRESSURE", False)
    m = HybridCacheManager(kimi, 4 << 30, ADAPTIVE)
    fed_before: list[int] = []
    serve(m, chat[:60], lambda m: fed_before.append(m.sampled) if not live_pressure(m.index) else None)
    assert fed_before and fed_before[-1] > 0


def test_the_shadows_see_the_same_requests_in_the_same_order(kimi, chat, monkeypatch):
    """Waiting changes when the shadows replay, not what: with every decision held back
    (and the shift detectors, which act on the live cache's time, off), each shadow ends
    where it would have, fed at once. Fails if the backlog drops, reorders or repeats a
    request."""
    monkeypatch.setattr(adaptive.AdaptiveManager, "_adopt", lambda self, best: None)
    monkeypatch.setattr(adaptive, "SHIFT_DETECTION", False)
    monkeypatch.setattr(adaptive, "EXPLORE_PAIRS", 10**9)  # the bucket never pauses either run
    ends = []
    for wait in (True, False):
        monkeypatch.setattr(shadow_backlog, "WAIT_FOR_PRESSURE", wait)
        m = HybridCacheManager(kimi, 4 << 30, ADAPTIVE)
        serve(m, chat)
        assert not len(m._backlog)
        ends.append([(s.name, s.hit_tokens, s.prompt_tokens, s.evictions, round(s.score, 6)) for s in m.shadows])
    assert ends[0] == ends[1]


def test_a_full_backlog_drains_without_pressure():
    """Memory: the backlog never holds more units than its limit before it drains."""
    from hybridcache.index import PrefixIndex

    class Idle:  # an index that never evicts
        evictions = {"kv": 0, "state": 0}
        floor_evictions = 0

    bl = Backlog(limit_units=100, waiting=True)
    idle: PrefixIndex = Idle()  # type: ignore[assignment]
    for _ in range(9):
        bl.push(Sampled([b"x"] * 10, 160, 160, None, 11))
        assert bl.release(idle) == [] and bl.waiting
    bl.push(Sampled([b"y"] * 10, 160, 160, None, 11))
    out = bl.release(idle)
    assert not bl.waiting and len(out) == DRAIN_PER_REQUEST and out[0].digests[0] == b"x"
    bl.sanity_check()
    # Shadows rebuilt cold get a fresh backlog: empty, and the wait stays ended.
    rebuilt = backlog_for([AdmissionPolicy(last_token=True)], 100, bl)
    assert not len(rebuilt) and rebuilt.units == 0 and not rebuilt.waiting
    assert backlog_for([AdmissionPolicy(last_token=True)], 100, None).waiting


def test_floor_evictions_are_not_pressure():
    """Spares and states ranked first to evict leave as the cache fills with spares: only
    KV, or a snapshot the rules value, is pressure."""
    class Index:
        evictions = {"kv": 0, "state": 5}
        floor_evictions = 5

    idx = Index()
    assert not live_pressure(idx)  # type: ignore[arg-type]
    idx.evictions = {"kv": 0, "state": 6}
    assert live_pressure(idx)  # type: ignore[arg-type]
    idx.evictions = {"kv": 1, "state": 5}
    assert live_pressure(idx)  # type: ignore[arg-type]


def test_spares_leaving_a_full_cache_are_not_pressure(kimi):
    """A large cache fills its free room with spare checkpoints long before anything the
    rules made must go (chat at 64 GiB: spares evicted from request 445, the first valued
    entry at 2,897): the spares' evictions are counted as floor evictions and the
    shadows keep waiting. Fails if the index does not count them."""
    m = HybridCacheManager(kimi, 64 << 30, ADAPTIVE)
    serve(m, generate("chat", 700, seed=0, tenants=2))
    assert m.index.evictions["state"] > 0 and m.index.floor_evictions == m.index.evictions["state"]
    assert not live_pressure(m.index) and m._backlog.waiting and m.sampled == 0 and len(m._backlog) > 0
