"""Count, then take: an allocation that cannot be served changes nothing."""

from __future__ import annotations

import random

import pytest

from hybridcache.errors import OutOfSpaceError
from hybridcache.manager import CacheConfig, HybridCacheManager
from tests.core.conftest import tiny_spec
from tests.core.state_fingerprint import fingerprint

U = 4


def _manager(
    eviction: str, state: bool, big_state: bool, blocks: int, window: int | None = None
) -> HybridCacheManager:
    spec = tiny_spec(state=state, big_state=big_state, window=window, max_len=1 << 16)
    cfg = CacheConfig(hash_unit=U, eviction=eviction, admission="last-token+turn-end")
    probe = HybridCacheManager(spec, 1 << 30, cfg)
    return HybridCacheManager(spec, blocks * probe.layout.block_bytes, cfg)


def _serve(m: HybridCacheManager, rid: str, tokens: list[int]) -> None:
    res = m.add_request(rid, tokens)
    m.allocate(rid, len(tokens) - res.hit_tokens + 3)
    m.append_tokens(rid, [7, 8, 9])
    m.commit(rid, len(tokens) + 3)
    m.free(rid)


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("eviction", ["lru", "value", "marconi"])
@pytest.mark.parametrize("state,big_state", [(True, True), (True, False), (False, True)])
def test_refused_allocate_changes_nothing(eviction, state, big_state, window):
    """Fill the cache with evictable entries, hold part of it with a running request, then
    ask for more than evicting everything could give: the refusal moves no count. Before
    counting first, the refused call evicted every cached entry on its way to failing.
    With a sliding-window group, the cache also holds evictable sliding pages and the
    running request holds its window of them."""
    m = _manager(eviction, state, big_state, blocks=8 if window is None else 16, window=window)
    for k in range(6):
        _serve(m, f"warm{k}", list(range(100 * k, 100 * k + 13)))
    assert m.index.nodes, "the cache holds evictable entries"
    if window is not None:
        assert m.coordinator.evictable_pages, "the cache holds evictable sliding pages"
    m.add_request("run", list(range(5000, 5021)))
    m.allocate("run", 21)
    # A second request that shares a cached prefix (its hit would be held) and wants far
    # more than the arena holds.
    extra = m.layout.num_pages * U
    m.add_request("big", list(range(0, 13)) + list(range(9000, 9000 + extra)))
    before = fingerprint(m)
    with pytest.raises(OutOfSpaceError):
        m.allocate("big", extra)
    assert fingerprint(m) == before
    # The refused request is still waiting and can be served once room is made.
    m.free("run")
    assert not m.requests["big"].allocated


@pytest.mark.parametrize("window", [None, 5, 14])
@pytest.mark.parametrize("eviction", ["lru", "value", "marconi"])
@pytest.mark.parametrize("state,big_state", [(True, True), (True, False), (False, True)])
def test_count_agrees_with_take(eviction, state, big_state, window):
    """Random streams at the edge of the arena's size: every allocate either succeeds or
    is refused with nothing changed (a count that said yes where the take would fail, or
    the reverse without the change, shows up here)."""
    rnd = random.Random(f"{eviction}{state}{big_state}")
    m = _manager(eviction, state, big_state, blocks=(6 if state else 1) + (window is not None), window=window)
    pieces = [list(range(100 * k, 100 * k + n)) for k, n in enumerate([9, 13, 4, 7, 21])]
    live: dict[str, int] = {}
    refused = served = 0
    for step in range(400):
        if live and (len(live) > 5 or rnd.random() < 0.3):
            rid = rnd.choice(sorted(live))
            del live[rid]
            m.free(rid, finished=rnd.random() < 0.8)
            continue
        rid = f"r{step}"
        tokens = [t for _ in range(rnd.randint(1, 3)) for t in rnd.choice(pieces)]
        res = m.add_request(rid, tokens)
        n = len(tokens) - res.hit_tokens + rnd.randint(0, 9 if state else 90)
        before = fingerprint(m)
        try:
            m.allocate(rid, n, num_draft=rnd.randint(0, min(2, n - 1)) if state else 0)
        except OutOfSpaceError:
            refused += 1
            assert fingerprint(m) == before, f"step {step}: a refused allocate changed state"
            m.free(rid, finished=False)
            continue
        served += 1
        live[rid] = n
    assert refused and served, (refused, served)
