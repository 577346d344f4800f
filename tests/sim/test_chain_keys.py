"""Sampling keys of the adaptive policy's miniatures (hybridcache.shadow.ChainKeys).

What must hold: a root whose shared prefix is short (a system prompt before sessions) is
keyed at its split, so its sessions are sampled apart; a root whose first split would take
the unscaled shared prefixes past the budget (a document before its questions) is keyed
whole, so a sampled question does not bring its document into a shadow that samples only
its share of the documents; the choice is made once per root. On generated documents the
sample's unique KV then holds the share of the shadows' capacity that the live cache's
holds of its own, where split keys held several times more.
"""

from __future__ import annotations

import math

import pytest

import hybridcache.adaptive as adaptive
from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.presets import get_preset
from hybridcache.shadow import KEY_SPACE, ChainKeys
from hybridcache.sim.generate import generate


def test_a_short_shared_prefix_is_keyed_at_its_split_and_a_long_one_whole():
    keys = ChainKeys(budget=5)
    system = [b"s0", b"s1"]
    assert keys.key(system + [b"a2"]) == b"s0"
    assert keys.key(system + [b"b2", b"b3"]) == b"b2"  # split at 2: held 2 <= 5
    assert keys.held == 2 and keys.whole == 0
    doc = [b"d0", b"d1", b"d2", b"d3", b"d4"]
    assert keys.key(doc + [b"q1"]) == b"d0"
    assert keys.key(doc + [b"q2"]) == b"d0"  # split at 5 would hold 7 > 5: whole
    assert keys.key(doc + [b"q3", b"q4"]) == b"d0"  # and stays whole
    assert keys.key(doc[:2] + [b"x"]) == b"d0"  # even where a split would move
    assert keys.held == 2 and keys.whole == 1
    assert keys.key(system + [b"c2"]) == b"c2"  # the first root keeps its split keys


def test_a_split_that_moves_towards_the_root_holds_less():
    keys = ChainKeys(budget=10)
    keys.key([b"r", b"p1", b"p2", b"a"])
    keys.key([b"r", b"p1", b"p2", b"b"])  # split at 3
    assert keys.held == 3
    assert keys.key([b"r", b"q", b"c"]) == b"q"  # split at 1
    assert keys.held == 1 and keys.key([b"r", b"p1", b"p2", b"a", b"a2"]) == b"p1"


def test_the_budget_is_infinite_where_the_shadows_see_every_request():
    spec = get_preset("kimi-linear-48b")
    small = HybridCacheManager(spec, 1 << 30, CacheConfig(hash_unit=16, admission="adaptive"))
    assert small.rate == 1.0 and small.keys.budget == math.inf
    big = HybridCacheManager(spec, 16 << 30, CacheConfig(hash_unit=16, admission="adaptive"))
    units = max(int(big._capacity * big.rate), big.layout.block_bytes * 2) / big.index.node_kv_bytes
    assert big.rate < 1.0
    assert big.keys.budget == pytest.approx(units / adaptive.MIN_FAMILIES / (1.0 - big.rate))


def test_a_change_of_workload_frees_the_budget():
    """The old workload's shared prefixes leave the shadows with it: after a detected
    change, new roots are keyed against the whole budget again (roots already keyed keep
    their keys)."""
    m = HybridCacheManager(get_preset("kimi-linear-48b"), 16 << 30,
                           CacheConfig(hash_unit=16, admission="adaptive"))
    m.keys.held = int(m.keys.budget)
    m._after_shift(m.shifts)
    assert m.keys.held == 0 and m.shifts == [0]


def _footprint_shares(kind: str, n: int, gib: int, budget: bool) -> tuple[float, float, int]:
    """(the sample's unique KV over the shadows' capacity, all unique KV over the live
    capacity, roots keyed whole) for ``n`` generated requests, keyed as the manager keys
    them (``budget`` False: every root at its split)."""
    spec = get_preset("kimi-linear-48b")
    m = HybridCacheManager(spec, gib << 30, CacheConfig(hash_unit=16, admission="adaptive"))
    keys = m.keys if budget else ChainKeys()
    every, sampled = set(), set()
    for i, r in enumerate(generate(kind, n, seed=3, tenants=2)):
        m.add_request(str(i), r.input_ids, tenant=r.tenant)
        digests = list(m.requests[str(i)].hasher.digests)
        m.free(str(i), finished=False)
        every.update(digests)
        if int.from_bytes(keys.key(digests)[:8], "little") / KEY_SPACE < m.rate:
            sampled.update(digests)
    unit = m.index.node_kv_bytes
    return len(sampled) * unit / (m._capacity * m.rate), len(every) * unit / m._capacity, keys.whole


def test_documents_no_longer_fill_the_miniature():
    """Split keys made every question a family and brought its document along: the
    sample's unique KV took 0.99 of the shadows' capacity where the live cache's takes
    0.20 of its own (measured here); keyed whole, 0.22."""
    split, live, _ = _footprint_shares("docs", 400, 16, budget=False)
    kept, live2, whole = _footprint_shares("docs", 400, 16, budget=True)
    assert live == live2 and whole > 0
    assert split > 2.5 * live
    assert kept < 1.5 * live


def test_sessions_behind_system_prompts_keep_their_split_keys():
    _, _, whole = _footprint_shares("chat", 300, 16, budget=True)
    assert whole == 0
