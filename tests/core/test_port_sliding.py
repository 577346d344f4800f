"""The engine port's views with sliding-window groups: ``device_prefix`` reports the hit
the coordinator would give, ``cached_prefix`` the sliding pages a hit reads."""

from __future__ import annotations

import pytest

from hybridcache.errors import InvalidRequestError
from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.port import EnginePort
from tests.core.conftest import tiny_spec

U = 4
TOKENS = list(range(41))  # 10 full units


def _port(window: int | None, state: bool = False) -> EnginePort:
    spec = tiny_spec(state=state, window=window, max_len=1 << 16)
    admission = "interval:8+turn-end" if state else "last-token"
    return EnginePort(HybridCacheManager(spec, 1 << 22, CacheConfig(hash_unit=U, admission=admission)))


def _serve(port: EnginePort, rid: str, tokens: list[int]) -> None:
    res = port.add_request(rid, tokens)
    port.allocate(rid, len(tokens) - res.hit_tokens)
    port.commit(rid, len(tokens))
    port.free(rid)


def _drop_sliding(port: EnginePort, digests, units) -> None:
    cache = port._m.coordinator.caches[0]
    for u in units:
        cache.evict(cache.entries[digests[u]])


@pytest.mark.parametrize("state", [False, True])
@pytest.mark.parametrize("missing,want", [((), 10), ((8,), 8), ((7, 8), 7)])
def test_device_prefix_reports_the_coordinators_hit(state, missing, want):
    """Window 9 (reach 2): dropping unit 8's sliding pages removes ends 9 and 10; the full
    KV is all there. ``hit_units`` equals the hit a new request gets, ``kv_units`` and
    ``has_kv`` still describe the full KV."""
    port = _port(9, state)
    _serve(port, "a", TOKENS)
    port.add_request("probe", TOKENS + [1])
    digests = port.digests("probe")
    _drop_sliding(port, digests, missing)
    dev = port.device_prefix(digests, 10)
    assert dev.kv_units == 10 and dev.has_kv == [True] * 10
    got = port.add_request("b", TOKENS + [1]).hit_tokens // U
    assert dev.hit_units == got
    if not state:  # with state the snapshot ends (8, 10) decide as well
        assert got == want
    port.free("probe")
    port.free("b")
    port.check_invariants()


@pytest.mark.parametrize("state", [False, True])
def test_device_prefix_without_sliding_groups_is_the_walk(state):
    port = _port(None, state)
    _serve(port, "a", TOKENS)
    port.add_request("b", TOKENS + [1])
    dev = port.device_prefix(port.digests("b"), 10)
    assert dev.hit_units == (dev.snapshot_units if state else dev.kv_units)
    assert dev.hit_units * U == port.match("b").hit_tokens > 0


def test_cached_prefix_has_the_sliding_window_a_hit_reads():
    """The sliding table of a hit of 10 units: ``-1`` below the window, then the cached
    pages of units 8, 9, exactly what the hitting request's block table holds."""
    port = _port(9)
    _serve(port, "a", TOKENS)
    port.add_request("b", TOKENS + [1])
    prefix = port.cached_prefix("b", 10)
    cache = port._m.coordinator.caches[0]
    digests = port.digests("b")
    assert set(prefix.block_tables) == {"attn", "swa"}
    want = [-1] * 8 + [cache.entries[digests[u]].pages[0] for u in (8, 9)]
    assert prefix.block_tables["swa"] == want
    assert port.match("b").hit_tokens == 10 * U
    port.allocate("b", 1)
    tables = port.block_tables("b")
    assert tables["swa"][:10] == want and tables["attn"][:10] == prefix.block_tables["attn"]
    assert port.cached_prefix("b", 0).block_tables["swa"] == []
    port.free("b")
    port.check_invariants()


def test_cached_prefix_refuses_a_hit_whose_window_is_gone():
    port = _port(9)
    _serve(port, "a", TOKENS)
    port.add_request("b", TOKENS + [1])
    digests = port.digests("b")
    _drop_sliding(port, digests, (8,))
    with pytest.raises(InvalidRequestError):
        port.cached_prefix("b", 10)
    assert port.cached_prefix("b", 8).block_tables["swa"][6:] == [
        port._m.coordinator.caches[0].entries[digests[u]].pages[0] for u in (6, 7)
    ]
    port.free("b")
    port.check_invariants()
