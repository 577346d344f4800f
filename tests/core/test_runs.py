"""Runs (hybridcache.runs): per-run holds, folding of hit/release ends, value ranking of tails."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.runs import Run, add_segments, pop_tail, shift_blocks, split
from tests.core.conftest import check_runs_and_ranks, tiny_spec

UNIT = 4


def _run(n: int, ppb: int = 2) -> Run:
    return Run.of([bytes([i]) for i in range(n)], [[10 + i for i in range(n)]], 1.0, ppb, 0, None)


def serve(m: HybridCacheManager, rid: str, tokens: list[int], out: int = 0) -> int:
    hit = m.add_request(rid, tokens).hit_tokens
    m.allocate(rid, len(tokens) + out - hit)
    if out:
        m.append_tokens(rid, list(range(9000, 9000 + out)))
    m.commit(rid, len(tokens) + out)
    m.free(rid)
    return hit


def path_of(m: HybridCacheManager, tokens: list[int]) -> tuple[list, list]:
    """The handles of the cached KV path of ``tokens``, and its holds."""
    m.add_request("probe", tokens)
    digests = m.requests["probe"].hasher.digests
    m.free("probe")
    units, holds = m.index.kv_path(digests, len(digests))
    return [m.index.unit(digests, u) for u in range(units)], holds


def test_split_moves_the_far_part_and_clamps_ends():
    run = _run(6)
    run.hits, run.rel = {6: 2, 3: 1}, {6: (5.0, 1), 3: (9.0, 2)}
    tail = split(run, 2, ppb=2)
    assert run.first == 0 and run.digests == [b"\0", b"\1"]
    assert run.hits == {2: 3} and run.rel == {2: (9.0, 2)}
    assert tail is not None and tail.first == 3 and tail.digests == [b"\3", b"\4", b"\5"]
    assert tail.hits == {3: 2} and tail.rel == {3: (5.0, 1)}
    assert tail.pages == [[13, 14, 15]] and tail.segs == [([0, 1], [6, 7])]


def test_pop_tail_folds_ends_into_the_new_tail():
    run = _run(3)
    run.hits, run.rel = {3: 1, 2: 4}, {3: (7.0, 5), 2: (1.0, 3)}
    assert pop_tail(run) == b"\2" and len(run) == 2
    assert run.hits == {2: 5} and run.rel == {2: (7.0, 5)}
    assert run.segs == [([0], [5])]  # pages 10, 11: both in block 5


def test_shift_blocks_counts_pages_per_block():
    run = _run(5, ppb=2)  # pages 10..14 -> blocks 5, 5, 6, 6, 7
    counts = [0] * 8
    shift_blocks(counts, run, 1, 4, 1)
    assert counts[5:8] == [1, 2, 0]


def test_tail_hits_rank_a_run_above_a_colder_one():
    m = HybridCacheManager(tiny_spec(state=False), 1 << 20, CacheConfig(hash_unit=UNIT))
    a, b = list(range(17)), list(range(100, 117))
    for i in range(3):
        assert serve(m, f"a{i}", a) == (16 if i else 0)
    serve(m, "b", b)
    q = m.index.kv_q
    tail_a, tail_b = path_of(m, a)[0][-1], path_of(m, b)[0][-1]
    assert tail_a.kv_hits == 2 and tail_b.kv_hits == 0
    assert q.priority(tail_a) > q.priority(tail_b)
    prio, victim = q.peek()
    assert victim is tail_b and prio == q.priority(tail_b)


def test_a_turn_extends_the_run_it_continues():
    m = HybridCacheManager(tiny_spec(), 1 << 22, CacheConfig(hash_unit=UNIT))
    turn1 = list(range(21))
    serve(m, "t1", turn1, out=8)  # registers units 0..6 (28 tokens)
    turn2 = turn1 + list(range(9000, 9008)) + list(range(500, 513))
    assert serve(m, "t2", turn2, out=8) > 0
    full = turn2 + list(range(9000, 9008))
    path, holds = path_of(m, full)
    assert len(holds) == 1 and len(path) == len(holds[0][0]) == len(full) // UNIT
    run = holds[0][0]
    assert run.holds == {} and run.held == 0  # nothing held once both turns are freed


@pytest.mark.parametrize("eviction", ["value", "lru", "marconi"])
def test_a_slot_empties_a_slab_inside_a_run(eviction):
    """A state slot needs an empty block. The run's tail sits in a slab that running requests
    pin, so the slot loop takes the units of the run's middle slab (deepest first), splits
    the run and leaves its head reachable and its far part stranded (cached, unreachable)."""
    spec = tiny_spec()  # 9 pages of one unit per block, one snapshot per block
    m = HybridCacheManager(spec, 5 * 9216, CacheConfig(hash_unit=UNIT, admission="none", eviction=eviction))
    assert m.layout.pages_per_block == 9 and m.layout.slots_per_block == 1
    a = list(range(89))  # 22 full units: slabs 1, 2 and 4 units of slab 3
    serve(m, "a", a)
    for rid, base in (("b", 1000), ("c", 2000)):  # running: their pages pin slab 3
        m.add_request(rid, list(range(base, base + 4)))
        m.allocate(rid, 4)
    m.add_request("d", list(range(3000, 3004)))
    m.allocate("d", 4)  # no free block left: slab 2's nine units go
    assert m.index.evictions == {"kv": 9, "state": 0}
    check_runs_and_ranks(m)
    path, holds = path_of(m, a)
    assert len(path) == 9 and len(holds) == 1 and len(holds[0][0]) == 9
    runs = dict(enumerate(m.index.heads.values()))
    assert sorted(len(r) for r in runs.values()) == [4, 9]  # far part (stranded), head
    for rid in "bcd":
        m.free(rid)
    check_runs_and_ranks(m)


def _segments_per_page(pages: list[int], base: int, ppb: int, starts: list[int], blocks: list[int]) -> None:
    last = blocks[-1] if blocks else -1
    for i, p in enumerate(pages, base):
        if p // ppb != last:
            starts.append(i)
            blocks.append(p // ppb)
            last = p // ppb


@given(
    ppb=st.sampled_from([1, 2, 3, 7, 337]),
    head=st.integers(0, 40),
    start=st.integers(0, 2000),
    n=st.integers(0, 700),
    swaps=st.lists(st.tuples(st.integers(0, 699), st.integers(0, 699)), max_size=3),
    scattered=st.booleans(),
)
def test_add_segments_matches_a_per_page_scan(ppb, head, start, n, swaps, scattered):
    """Block segments of consecutive pages are computed arithmetically; any other distinct
    pages (a swapped pair keeps both end points, scattered ones do not) take the general
    path. Both must agree with a per-page scan, after an existing head of segments too."""
    pages = list(range(start, start + n)) if not scattered else [(start + 13 * i) % 5003 for i in range(n)]
    for i, j in swaps:
        if i < n and j < n:
            pages[i], pages[j] = pages[j], pages[i]
    starts, blocks = [], []
    _segments_per_page(list(range(9000, 9000 + head)), 0, ppb, starts, blocks)
    want = (list(starts), list(blocks))
    _segments_per_page(pages, head, ppb, *want)
    add_segments(starts, blocks, pages, head, ppb)
    assert (starts, blocks) == want


def test_walks_leave_a_shared_run_where_they_diverge():
    """A walk leaves a run by a binary search and remembers the point (``fork``); later walks
    that diverge there, earlier or later, or never, all find their own exact end."""
    m = HybridCacheManager(tiny_spec(state=False), 1 << 22, CacheConfig(hash_unit=UNIT))
    shared = list(range(64))  # one run of 16 units
    serve(m, "base", shared + [1])
    for k, cut in enumerate([40, 40, 20, 60, 40, 64]):
        tokens = shared[:cut] + [5000 + k] * 8
        path, holds = path_of(m, tokens)
        assert len(path) == cut // UNIT, (cut, len(path))
        run = holds[0][0]
        assert run.first == 0 and (cut == 64 or run.fork == cut // UNIT)
