"""The shadow caches' replay (hybridcache.shadow): its fast path is the full manager's.

:meth:`ShadowCache._add_request` keys a replayed request by the live digests themselves,
where ``add_request(digests=)`` validates them and salts each again with the tenant's root.
The two must decide the same: every request's hit, every eviction, the score. The
reference here is the full path (a shadow whose ``_add_request`` calls ``add_request``
and whose outputs go through ``TokenHasher.adopt``); a mutant of the fast path shows the
comparison can fail.
"""

from __future__ import annotations

import pytest

from hybridcache.config import CacheConfig
from hybridcache.errors import OutOfSpaceError
from hybridcache.hashing import TokenHasher
from hybridcache.shadow import ShadowCache
from hybridcache.sim.generate import generate


class FullPathShadow(ShadowCache):
    """A shadow fed through the manager's public path: ``add_request(digests=)`` (which
    validates the digests and salts them again) and ``TokenHasher.adopt`` for the output's
    units (salted the same way): the replay as it was before the fast path."""

    def feed(self, digests, prompt_len, total, tenant, decay) -> None:
        mgr, unit = self.mgr, self.mgr.unit
        self._next_id += 1
        rid = str(self._next_id)
        match = mgr.add_request(rid, prompt_len, tenant=tenant, digests=digests[: prompt_len // unit])
        try:
            mgr.allocate(rid, total - match.hit_tokens)
        except OutOfSpaceError:
            mgr.free(rid, finished=False)
            self._count(0, prompt_len, decay)
            return
        if total > prompt_len:
            mgr.requests[rid].hasher.adopt(digests[: total // unit], total)
            mgr.requests[rid].num_tokens = total
        mgr.commit(rid, total)
        mgr.free(rid)
        self._count(match.hit_tokens, prompt_len, decay)


class ForgetsOutputs(ShadowCache):
    """Mutant: the fast path without the output's units (a request's next turn can then
    not hit its output)."""

    def feed(self, digests, prompt_len, total, tenant, decay) -> None:
        unit = self.mgr.unit
        super().feed(digests[: prompt_len // unit], prompt_len, prompt_len, tenant, decay)


def _streams(kind: str, n: int, seed: int):
    """``(digests, prompt_len, total, tenant)`` of a generated trace's requests, digests
    as the live manager makes them (chained, tenant-salted, prompt and output)."""
    for r in generate(kind, n, seed=seed, tenants=2):
        h = TokenHasher(16, tenant=r.tenant)
        h.extend(r.input_ids)
        total = r.input_length
        if r.output_ids is not None and len(r.output_ids):
            h.extend(r.output_ids)
            total += len(r.output_ids)
        yield h.digests, r.input_length, total, r.tenant


def _trace_of(shadow: ShadowCache, stream) -> list[tuple]:
    out = []
    for digests, prompt, total, tenant in stream:
        shadow.feed(list(digests), prompt, total, tenant, 0.99)
        ev = shadow.mgr.index.evictions
        out.append((shadow.hit_tokens, ev["kv"], ev["state"], len(shadow.mgr.index.handles)))
    return out


CFG = CacheConfig(hash_unit=16, admission="last-token+turn-end+branch-point+interval:4096", eviction="value")


@pytest.mark.parametrize("kind,seed,gib", [("chat", 3, 1), ("agent", 4, 1), ("docs", 5, 2), ("agentic", 6, 2)])
def test_fast_replay_decides_as_the_full_manager(kimi, kind, seed, gib):
    stream = list(_streams(kind, 120, seed))
    fast = ShadowCache("fast", kimi, gib << 30, CFG)
    full = FullPathShadow("full", kimi, gib << 30, CFG)
    a, b = _trace_of(fast, stream), _trace_of(full, stream)
    assert a == b
    assert fast.score == pytest.approx(full.score) and fast.saved == full.saved
    ev = fast.mgr.index.evictions
    assert fast.hit_tokens and ev["kv"] + ev["state"], "the stream must hit and evict to compare anything"
    # The fast path takes digests without tokens: its runs must keep no token bytes (an
    # empty hasher's bytes once made every shadow run claim tokens it did not have).
    fast.mgr.check_invariants()


def test_the_comparison_catches_a_replay_that_drops_outputs(kimi):
    stream = list(_streams("chat", 120, 3))
    full = _trace_of(FullPathShadow("full", kimi, 1 << 30, CFG), stream)
    assert _trace_of(ForgetsOutputs("mutant", kimi, 1 << 30, CFG), stream) != full


def _scan_by_unit(run, pred, start: int) -> int:
    for pos in range(start, run.held - 1, -1):
        if pred(run.unit_pages(pos)):
            return pos
    return -1


@pytest.mark.parametrize("seed", range(6))
def test_victim_scan_by_block_segment_finds_the_unit_a_scan_by_unit_finds(seed):
    """A slot allocation's victim scan (``value._deepest``, most of a miniature cache's
    replay cost) judges each block segment of a run once instead of each unit
    (``eviction.deepest_unpinned_segment``, over tables that allow a random set of blocks):
    on random runs (pages scattered and in consecutive stretches, any pin depth, one and two
    attention groups) it must return what the unit-by-unit scan returns."""
    import random

    from hybridcache.eviction import deepest_unpinned_segment
    from hybridcache.policies.value import _deepest
    from hybridcache.runs import Run

    rng = random.Random(seed)
    for _ in range(200):
        ppb, n, groups = rng.randint(1, 6), rng.randint(1, 40), rng.choice((1, 1, 2))
        free = list(range(ppb * 100))
        rng.shuffle(free)
        pages = []
        for _g in range(groups):
            if rng.random() < 0.5:
                p0 = rng.randrange(0, ppb * 10)
                pages.append(list(range(p0, p0 + n)))  # a bulk allocation
            else:
                pages.append([free.pop() for _i in range(n)])
        run = Run.of([bytes([i]) for i in range(n)], pages, 1.0, ppb, 0, None)
        run.held = rng.randint(0, n)
        ok = {b for b in range(110) if rng.random() < 0.3}

        def pred(unit_pages, ok=ok, ppb=ppb):
            return any(p // ppb in ok for p in unit_pages)

        # The slab tables that allow exactly ``ok``: every block fully registered, the
        # others pinned.
        full, pinned = [1] * 110, set(range(110)) - ok

        def scan(starts, blocks, start, held, full=full, pinned=pinned):
            return deepest_unpinned_segment(starts, blocks, start, held, full, full, pinned)

        for start in range(-1, n):
            assert _deepest(run, pred, start, scan) == _scan_by_unit(run, pred, start), (ppb, pages, run.held, ok, start)


@pytest.mark.parametrize("kind", ["chat", "docs", "agentic"])
def test_the_slot_filters_segment_scan_is_its_unit_by_unit_answer(kimi, kind):
    """The slot filter's walk over a run's block segments in one call
    (``Evictor.deepest_unpinned``, which ``value._deepest`` takes for that filter: a call
    per segment was a third of a full miniature's replay). On the caches a small manager holds while
    requests run (some of its runs held, private pages beside cached ones), every run and
    start must give what asking ``in_unpinned_slab`` unit by unit gives."""
    from hybridcache.manager import HybridCacheManager
    from hybridcache.policies.value import _deepest

    m = HybridCacheManager(kimi, 1 << 30, CacheConfig(hash_unit=16))
    ev = m.index.evictor
    pred, scan = m.index.kv_q.slab_pred, m.index.kv_q.slab_scan  # what _offer hands _deepest
    assert pred is ev._slot_pred and scan == ev.deepest_unpinned
    checked = found = 0
    running: list[str] = []
    for i, r in enumerate(generate(kind, 40, seed=3, tenants=2)):
        rid = str(i)
        res = m.add_request(rid, r.input_ids, tenant=r.tenant)
        try:
            m.allocate(rid, r.input_length + r.output_length - res.hit_tokens)
        except OutOfSpaceError:
            m.free(rid, finished=False)
            continue
        # Every third request stays running for a while, committed to its prompt's end:
        # its units are cached and held (pinned slabs), its output's pages private.
        m.commit(rid, r.input_length)
        if i % 3:
            m.free(rid)
        else:
            running.append(rid)
        if len(running) > 3:
            m.free(running.pop(0))
        for run in list(m.index.heads.values()):
            for start in range(-1, len(run.digests)):
                got = _deepest(run, pred, start, scan)  # first: it must refresh the pins itself
                want = _scan_by_unit(run, ev.in_unpinned_slab, start)
                assert got == want, (kind, i, start)
                checked += 1
                found += want >= 0
    assert checked > 1000 and 0 < found < checked  # both verdicts seen
