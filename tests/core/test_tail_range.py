"""Range eviction of a run's tail takes exactly the victims that single evictions take.

A slot allocation evicts a run's unpinned tail as one range (``Evictor.tail_ranges``) where
the policy would take those units one by one. Two managers replay the same workload, one
with ranges and one unit by unit: every event (each removed unit's, in order), every stat
and the index's state must agree after every request, and the range path must have run.
"""

from __future__ import annotations

import random

import pytest

from hybridcache.errors import OutOfSpaceError
from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.port import EnginePort
from hybridcache.runs import Run
from tests.core.conftest import tiny_spec

UNIT = 4


def index_state(m: HybridCacheManager) -> tuple:
    """The index, arena and queue state that decides every later choice, as plain values
    (heap entries by rank, not by their sequence numbers or stale copies)."""
    idx, arena, q = m.index, m.arena, m.index.kv_q

    def run_state(run: Run) -> tuple:
        return (
            tuple(run.digests), tuple(map(tuple, run.pages)), tuple(map(tuple, (s for s, _ in run.segs))),
            tuple(map(tuple, (b for _, b in run.segs))), sorted(run.holds.items()), run.held,
            sorted(run.hits.items()), sorted(run.rel.items()), run.first,
        )

    live = sorted(
        (e[0], e[1], tuple(e[3].digests)) for e in getattr(q, "_heap", []) if e[3].qseq == e[2]
    )
    return (
        sorted((d, run_state(r)) for d, r in idx.heads.items()),
        sorted((d, h.snap, h.snap_hits, h.run is None) for d, h in idx.handles.items()),
        sorted(idx.bare), sorted(idx.branches.items()), idx.version, idx.kv_units,
        dict(idx.evictions), dict(idx.evicted_bytes), sorted(idx.tenant_bytes.items(), key=repr),
        tuple(idx._registered),
        tuple(arena._kind), tuple(arena.used_per_block), tuple(arena._free_blocks),
        tuple(map(tuple, arena._entry_free)), tuple(arena._open[1]), tuple(arena._open[2]),
        arena.pages_in_use, arena.slots_in_use, live, len(q),
        getattr(getattr(q, "_clock", None), "value", None),
    )


def workload(seed: int, n: int) -> list[tuple[str, list[int], int]]:
    """``(action, tokens, extra)`` steps: conversations sharing system prompts, each turn
    extending the last prompt; a few requests stay live across later ones (pinned slabs)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1000, 2000) for _ in range(rng.randrange(8, 40))] for _ in range(3)]
    convs: list[list[int]] = []
    steps = []
    for _ in range(n):
        if not convs or rng.random() < 0.3:
            convs.append(list(rng.choice(systems)))
        conv = rng.choice(convs)
        conv += [rng.randrange(2000, 9000) for _ in range(rng.randrange(3, 60))]
        steps.append(("run", list(conv), rng.randrange(1, 12)))
        if rng.random() < 0.2:
            steps.append(("hold", list(conv[: rng.randrange(4, len(conv))]), 1))
    return steps


class Driver:
    """One manager and its port, replaying steps as the simulator does."""

    def __init__(self, spec, blocks: int, cfg: CacheConfig, ranges: bool) -> None:
        probe = HybridCacheManager(spec, 1 << 30, cfg)
        self.m = HybridCacheManager(spec, blocks * probe.layout.block_bytes, cfg)
        self.m.index.evictor.tail_ranges = ranges and self.m.index.evictor.tail_ranges
        if not ranges:  # an adaptive switch of ranking builds a new evictor: keep it unit by unit
            index, install = self.m.index, self.m.index.install_policy

            def install_unit_by_unit(*args, **kwargs) -> None:
                install(*args, **kwargs)
                index.evictor.tail_ranges = False

            index.install_policy = install_unit_by_unit
        self.port = EnginePort(self.m)
        self.held: list[str] = []
        self.n = 0

    def step(self, action: str, tokens: list[int], extra: int) -> tuple:
        m = self.m
        rid = f"r{self.n}"
        self.n += 1
        match = m.add_request(rid, tokens)
        outcome: object = match.hit_tokens
        try:
            m.allocate(rid, len(tokens) + extra - match.hit_tokens)
        except OutOfSpaceError:
            m.free(rid, finished=False)
            outcome = "refused"
        else:
            m.commit(rid, len(tokens) + extra)
            if action == "hold":
                self.held.append(rid)
            else:
                m.free(rid)
            if len(self.held) > 2:
                m.free(self.held.pop(0))
        return outcome, [repr(e) for e in self.port.take_events()], repr(m.stats()), index_state(m)


CASES = [
    # (big_state, eviction, admission, blocks): a snapshot of several pages (slot
    # allocations take KV only from unpinned slabs), and a block of one page.
    (True, "value", "last-token+turn-end+branch-point", 8),
    (True, "value", "interval:8+turn-end", 10),
    (True, "value", "interval:8+turn-end", 16),
    (True, "value", "adaptive", 10),
    # Larger caches: slot allocations set runs aside and offer their inner units, which the
    # stranded-turn path must let go first (Evictor._stranded_victim; without that check
    # these cases diverge).
    (True, "value", "last-token+turn-end+branch-point", 16),
    (True, "value", "interval:8+turn-end", 24),
    (False, "value", "interval:8+turn-end", 24),
]


@pytest.mark.parametrize(("big_state", "eviction", "admission", "blocks"), CASES)
def test_range_eviction_equals_single_evictions(big_state, eviction, admission, blocks):
    spec = tiny_spec(state=True, big_state=big_state)
    cfg = CacheConfig(hash_unit=UNIT, eviction=eviction, admission=admission)
    ranged = turns = 0
    for seed in range(3):
        fast, slow = Driver(spec, blocks, cfg, True), Driver(spec, blocks, cfg, False)
        assert fast.m.index.evictor.tail_ranges and not slow.m.index.evictor.tail_ranges
        for i, step in enumerate(workload(seed, 160)):
            a, b = fast.step(*step), slow.step(*step)
            assert a == b, f"seed {seed} step {i}: range eviction diverged from single evictions"
        fast.m.index.check_invariants()
        assert slow.m.index.evictor.range_units == 0 and slow.m.index.evictor.stranded_turns == 0
        ranged += fast.m.index.evictor.range_units
        turns += fast.m.index.evictor.stranded_turns
    if big_state:  # several pages per slot: freeing one takes runs of KV units
        assert ranged > 0, "the range path never ran"
    # Stranded tails at the clock, taken without the chooser (Evictor._stranded_victim).
    assert turns > 0, "the stranded-turn path never ran"


def _evict_one_by_one(m: HybridCacheManager, run: Run, order: list[int]) -> None:
    """What a slot allocation does per victim: the queue sees it go, the index drops it."""
    idx = m.index
    for node in [idx.handle(run, pos) for pos in order]:  # handles follow splits
        idx.kv_q.evicted(node)
        idx.evict_kv(node)


def _filled(big_state: bool) -> tuple[HybridCacheManager, EnginePort, Run]:
    spec = tiny_spec(state=True, big_state=big_state)
    cfg = CacheConfig(hash_unit=UNIT, eviction="value", admission="interval:8+turn-end")
    m = HybridCacheManager(spec, 64 * HybridCacheManager(spec, 1 << 30, cfg).layout.block_bytes, cfg)
    port = EnginePort(m)
    for rid, n in (("a", 40), ("b", 52)):  # two releases: two hold ends on one run
        match = m.add_request(rid, list(range(n)))
        m.allocate(rid, n + 1 - match.hit_tokens)
        m.commit(rid, n + 1)
        m.free(rid)
    port.take_events()
    (run,) = [r for r in m.index.heads.values() if len(r.digests) > 6]
    return m, port, run


@pytest.mark.parametrize("big_state", [True, False])
@pytest.mark.parametrize("k", [1, 5, 9])
def test_tail_range_and_evict_tail_range_match_single_evictions(big_state, k):
    """The queue's range choice plus the index's range removal leave what successive tail
    evictions leave (events, stats, state); the comparison catches a removal in another
    order (head first: splits and reordered events)."""
    ranged, rport, run_r = _filled(big_state)
    single, sport, run_s = _filled(big_state)
    wrong, wport, run_w = _filled(big_state)
    n = len(run_r.digests)
    assert ranged.index.kv_q._heap[0][3] is run_r  # the run's tail is the queue's top
    calls = []

    def last(pages: tuple[int, ...]) -> bool:
        calls.append(pages)
        return len(calls) == k

    assert ranged.index.kv_q.tail_range(run_r, None, None, last) == k
    ranged.index.evict_tail_range(run_r, k)
    _evict_one_by_one(single, run_s, list(range(n - 1, n - k - 1, -1)))
    _evict_one_by_one(wrong, run_w, list(range(n - k, n)))
    r_ev = [repr(e) for e in rport.take_events()]
    assert len(r_ev) == k
    assert r_ev == [repr(e) for e in sport.take_events()]
    assert index_state(ranged) == index_state(single)
    assert repr(ranged.stats()) == repr(single.stats())
    if k > 1:  # the check can fail
        assert [repr(e) for e in wport.take_events()] != r_ev
    ranged.index.check_invariants()


def test_free_pages_refuses_and_changes_nothing():
    m, _, run = _filled(True)
    arena = m.arena
    before = (tuple(arena.used_per_block), tuple(map(tuple, arena._entry_free)), arena.pages_in_use)
    page = run.pages[0][-1]
    for bad in ([page, page], [page, arena.layout.num_pages], [page, -1]):
        with pytest.raises(ValueError):
            arena.free_pages(bad)
        assert (tuple(arena.used_per_block), tuple(map(tuple, arena._entry_free)), arena.pages_in_use) == before
