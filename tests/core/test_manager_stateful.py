"""Stateful property test: random request streams against a brute-force oracle.

The oracle keeps, as plain sets of token prefixes, every prefix whose KV or snapshot was
committed and not yet evicted (evictions come out of the engine port's event stream, taken
after every call that can evict), and, for a model with a sliding-window group, the units
whose sliding pages are cached (stored and removed as the stream says).
Hit lengths are recomputed by brute force over those sets with the window rule (a hit of
``L`` units needs full KV for every unit before ``L``, the sliding pages of the last
``ceil((window - 1) / unit)`` of them and, with state, a snapshot at ``L``) and must equal
the manager's; after every step the structural invariants are checked, and no running
request keeps sliding pages older than its window.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridcache.errors import OutOfSpaceError
from hybridcache.events import REMOVED, STORED
from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.policy_switch import switch_eviction
from hybridcache.port import EnginePort
from hybridcache.sliding import SLIDING
from tests.core.conftest import check_runs_and_ranks, tiny_spec
from tests.core.state_fingerprint import fingerprint

UNIT = 4
PIECES = [list(range(100 * k, 100 * k + n)) for k, n in enumerate([9, 13, 4, 7, 21, 3])]


class Oracle:
    """Committed, not evicted prefixes as ``(tenant, tuple(tokens))``."""

    def __init__(self) -> None:
        self.kv: set[tuple] = set()
        self.snap: set[tuple] = set()
        self.slide: set[tuple] = set()
        self.by_digest: dict[bytes, tuple] = {}

    def hit(self, tenant, tokens, has_state: bool, window: int | None = None) -> tuple[int, int]:
        max_units = (len(tokens) - 1) // UNIT

        def key(u):
            return (tenant, tuple(tokens[: u * UNIT]))

        kv_units = 0
        while kv_units < max_units and key(kv_units + 1) in self.kv:
            kv_units += 1
        hit = kv_units
        if has_state or window is not None:
            for hit in range(kv_units, -1, -1):
                if has_state and hit and key(hit) not in self.snap:
                    continue
                if window is not None:
                    # Tokens [hit*UNIT - window + 1, hit*UNIT) are read by the next token.
                    first = max(0, (hit * UNIT - window + 1) // UNIT)
                    if any(key(j + 1) not in self.slide for j in range(first, hit)):
                        continue
                break
        return hit * UNIT, kv_units * UNIT


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.oracle = Oracle()
        self.live: dict[str, dict] = {}
        self.n = 0
        self.m: HybridCacheManager | None = None

    @rule(
        eviction=st.sampled_from(["lru", "value", "marconi"]),
        admission=st.sampled_from(
            ["last-token+turn-end+branch-point", "chunk-end", "interval:8+turn-end", "last-token",
             "adaptive", "last-token+spare-interval:8", "last-block:8+branch-point",
             "last-token+turn-end+seen-branch"]
        ),
        blocks=st.integers(3, 12),
        state=st.booleans(),
        big_state=st.booleans(),
    )
    @precondition(lambda self: self.m is None)
    def init(self, eviction, admission, blocks, state, big_state):
        self._setup(eviction, admission, blocks, state, big_state, None)

    def _setup(self, eviction, admission, blocks, state, big_state, window):
        spec = tiny_spec(state=state, big_state=big_state, window=window)
        self.window = window
        cfg = CacheConfig(hash_unit=UNIT, eviction=eviction, admission=admission)
        probe = HybridCacheManager(spec, 1 << 30, cfg)
        self.m = HybridCacheManager(spec, blocks * probe.layout.block_bytes, cfg)
        self.port = EnginePort(self.m)
        self.has_state = state

    def _take_evictions(self):
        for ev in self.port.take_events():
            if ev.kind == SLIDING:
                (digest,) = ev.digests
                key = self.oracle.by_digest[digest]
                if ev.action == STORED:
                    assert key in self.oracle.kv, "sliding pages cached for a unit without full KV"
                    self.oracle.slide.add(key)
                elif ev.action == REMOVED:
                    self.oracle.slide.discard(key)
                continue
            if ev.action != REMOVED:
                continue
            (digest,) = ev.digests
            key = self.oracle.by_digest[digest]
            (self.oracle.kv if ev.kind == "kv" else self.oracle.snap).discard(key)

    def _digest_keys(self, r):
        req = self.m.requests[r["id"]]
        for u, d in enumerate(req.hasher.digests):
            self.oracle.by_digest[d] = (r["tenant"], tuple(r["tokens"][: (u + 1) * UNIT]))

    @rule(pieces=st.lists(st.integers(0, len(PIECES) - 1), min_size=1, max_size=4),
          tenant=st.sampled_from([None, "a", "b"]))
    @precondition(lambda self: self.m is not None and len(self.live) < 4)
    def add(self, pieces, tenant):
        self._add(pieces, tenant)

    def _add(self, pieces, tenant):
        tokens = [t for p in pieces for t in PIECES[p]]
        rid = f"r{self.n}"
        self.n += 1
        res = self.m.add_request(rid, tokens, tenant=tenant)
        want = self.oracle.hit(tenant, tokens, self.has_state, self.window)
        assert (res.hit_tokens, res.kv_hit_tokens) == want
        self.live[rid] = {"id": rid, "tenant": tenant, "tokens": list(tokens), "alloc": None}
        self._digest_keys(self.live[rid])

    def _alloc(self, r, n, draft=0):
        self._take_evictions()  # what earlier calls stored: the refusal check starts empty
        before = self.m.cached_snapshot_slots()
        state = fingerprint(self.m)
        try:
            a = self.m.allocate(r["id"], n, num_draft=draft)
        except OutOfSpaceError:
            assert fingerprint(self.m) == state, "a refused allocate changed the manager"
            assert not self.port.take_events(), "a refused allocate emitted events"
            return None
        self._take_evictions()
        cached = self.m.cached_snapshot_slots()
        assert cached <= before  # allocation never registers anything
        targets = set(a.state_copies.dst) | {s.slot for s in a.save_points} | set(a.draft_slots)
        assert not targets & cached, "a copy plan targets a registered snapshot"
        if a.state_copies:
            assert set(a.state_copies.src) <= cached
        if self.window is not None:
            # The step's first token reads tokens from start - window + 1 on: every unit
            # from there has a page in the sliding group's block table.
            table = a.block_table["swa"]
            first = max(0, (a.start - self.window + 1) // UNIT)
            assert len(table) == len(a.block_table["attn"])
            assert all(p >= 0 for p in table[first:]), "a sliding page the step reads is missing"
        r["alloc"] = a
        return a

    def _commit(self, r, n):
        a = r["alloc"]
        self.m.commit(r["id"], n)
        req = self.m.requests[r["id"]]
        known = min(n, len(r["tokens"]))
        for u in range(1, known // UNIT + 1):
            if u <= req.units:
                self.oracle.kv.add((r["tenant"], tuple(r["tokens"][: u * UNIT])))
        for sp in a.save_points:
            if sp.boundary <= known and sp.slot != req.rolling_slot:
                self.oracle.snap.add((r["tenant"], tuple(r["tokens"][: sp.boundary])))
        self._take_evictions()  # sliding pages stored (and released) by the commit

    @rule(data=st.data())
    @precondition(lambda self: self.m is not None and self.live)
    def prefill(self, data):
        r = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        req = self.m.requests[r["id"]]
        if req.allocated and req.num_allocated >= len(r["tokens"]):
            return
        start = req.num_allocated if req.allocated else self.m.match(r["id"]).hit_tokens
        remaining = len(r["tokens"]) - start
        n = data.draw(st.integers(1, max(1, remaining)))
        a = self._alloc(r, n)
        if a is not None:
            self._commit(r, a.start + n)

    @rule(data=st.data(), k=st.integers(1, 3), new=st.lists(st.integers(0, 50), min_size=4, max_size=4))
    @precondition(lambda self: self.m is not None and self.live)
    def decode_speculative(self, data, k, new):
        r = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        req = self.m.requests[r["id"]]
        if not req.allocated or req.num_computed < len(r["tokens"]):
            return
        a = self._alloc(r, 1 + k, draft=k if self.has_state else 0)
        if a is None:
            return
        accepted = data.draw(st.integers(1, 1 + k))
        self.m.accept(r["id"], accepted)
        rejected_points = [s for s in a.save_points if s.boundary > a.start + accepted]
        toks = new[:accepted]
        self.m.append_tokens(r["id"], toks)
        r["tokens"].extend(toks)
        self._digest_keys(r)
        r["alloc"] = a._replace(save_points=tuple(s for s in a.save_points if s not in rejected_points))
        self._commit(r, a.start + accepted)
        cached = self.m.cached_snapshot_slots()
        assert not {s.slot for s in rejected_points} & cached

    @rule(data=st.data(), finished=st.booleans())
    @precondition(lambda self: self.m is not None and self.live)
    def free(self, data, finished):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        r = self.live.pop(rid)
        req = self.m.requests[rid]
        rb, computed = req.rolling_boundary, req.num_computed
        had_rolling = req.rolling_slot >= 0
        self.m.free(rid, finished=finished)
        self._take_evictions()
        if had_rolling and finished and 0 < rb <= min(computed, len(r["tokens"])):
            key = (r["tenant"], tuple(r["tokens"][:rb]))
            if key in self.oracle.kv:
                self.oracle.snap.add(key)

    @rule(eviction=st.sampled_from(["lru", "value", "marconi"]))
    @precondition(lambda self: self.m is not None)
    def switch_policy(self, eviction):
        """The live cache changes eviction policy (hybridcache.policy_switch) while requests
        run: every cached entry must stay evictable under the new one (``clear`` and the
        teardown empty the arena) and every hit stay the oracle's."""
        switch_eviction(self.m, eviction)
        assert self.m.index.eviction == self.m.config.eviction == eviction

    @rule()
    @precondition(lambda self: self.m is not None and not self.live)
    def clear(self):
        self.port.clear()
        self._take_evictions()
        assert self.m.arena.pages_in_use == 0
        assert self.m.arena.slots_in_use == 0
        assert not self.m.index.nodes
        assert not any(c.entries for c in self.m.index.sliding)
        assert not self.oracle.slide, "the stream did not remove every sliding page"
        self.oracle.kv.clear()
        self.oracle.snap.clear()

    @invariant()
    def structure(self):
        m = self.m
        if m is None:
            return
        pages: list[int] = []
        slots: list[int] = []
        handles = m.index.handles
        kv = [d for run in m.index.heads.values() for d in run.digests]
        for run in m.index.heads.values():
            pages.extend(p for group in run.pages for p in group)
        for node in handles.values():
            assert node.snap_ref >= 0
            if node.snap >= 0:
                slots.append(node.snap)
        for req in m.requests.values():
            for t in req.pages:
                pages.extend(t[req.units : req.units_allocated])
                pages.extend(t[i] for i in req.dup_pages)
            slots.extend(s for s in [req.slot, req.rolling_slot] if s >= 0)
            if req.pending_rolling is not None:
                slots.append(req.pending_rolling[1])
            slots.extend(req.draft_slots)
            slots.extend(req.saves.values())
            for track in req.slide:
                pages.extend(track.private_pages())
                # The window bound: nothing the next token cannot read is kept.
                assert track.lo >= max(0, (req.num_computed - self.window + 1) // UNIT)
                assert all(p < 0 for t in track.tables for p in t[: track.lo])
        sliding = [d for c in m.index.sliding for d in c.entries]
        pages.extend(p for c in m.index.sliding for e in c.entries.values() for p in e.pages)
        assert len(pages) == len(set(pages)) == m.arena.pages_in_use, "page leaked or shared"
        assert len(slots) == len(set(slots)) == m.arena.slots_in_use, "slot leaked or shared"
        s = m.arena.stats()
        assert s.used_bytes <= s.capacity_bytes
        assert s.kv_bytes + s.state_bytes <= s.used_bytes
        # The oracle and the manager agree on what is cached.
        assert {self.oracle.by_digest[d] for d in kv} == self.oracle.kv
        snap_nodes = {d for d, n in handles.items() if n.snap >= 0}
        assert {self.oracle.by_digest[d] for d in snap_nodes} == self.oracle.snap
        assert {self.oracle.by_digest[d] for d in sliding} == self.oracle.slide
        check_runs_and_ranks(m)
        m.check_invariants()

    def teardown(self):
        if self.m is None:
            return
        for rid in list(self.live):
            self.m.free(rid)
        self.m.clear()
        assert self.m.arena.pages_in_use == 0 and self.m.arena.slots_in_use == 0
        assert self.m.arena.stats().used_bytes == 0


#: Both machines: deterministic (derandomize), long enough streams to evict and re-hit.
STATEFUL_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    derandomize=True,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target],
)
ManagerMachine.TestCase.settings = STATEFUL_SETTINGS
TestManagerStateful = ManagerMachine.TestCase


class SlidingWindowMachine(ManagerMachine):
    """The same streams on models that always have a sliding-window group, with budgets
    large enough that hits are common and small enough that sliding pages get evicted
    apart from their units' full KV (the cases where the window rule decides the hit)."""

    @rule(
        eviction=st.sampled_from(["lru", "value", "marconi"]),
        admission=st.sampled_from(["last-token+turn-end+branch-point", "interval:8+turn-end", "chunk-end",
                                   "last-token+turn-end+seen-branch"]),
        blocks=st.integers(5, 20),
        state=st.booleans(),
        window=st.sampled_from([1, 5, 9, 14]),
    )
    @precondition(lambda self: self.m is None)
    def init(self, eviction, admission, blocks, state, window):
        self._setup(eviction, admission, blocks, state, True, window)

    @rule(pieces=st.lists(st.integers(0, 2), min_size=2, max_size=5), tenant=st.sampled_from([None, "a"]))
    @precondition(lambda self: self.m is not None and len(self.live) < 4)
    def add(self, pieces, tenant):
        """Prompts that share prefixes often (hits are the point here)."""
        self._add(pieces, tenant)


SlidingWindowMachine.TestCase.settings = STATEFUL_SETTINGS
TestSlidingWindowStateful = SlidingWindowMachine.TestCase


def test_numpy_and_list_tokens_agree():
    m = HybridCacheManager(tiny_spec(), 1 << 20, CacheConfig(hash_unit=UNIT))
    a = m.add_request("a", list(range(40)))
    m.allocate("a", 40)
    m.commit("a", 40)
    m.free("a")
    b = m.add_request("b", np.arange(40, dtype=np.int64))
    assert b.hit_tokens == a.hit_tokens + 36
