"""The engine port: a whole request path, events, views, pins and imports, through the
port only (no manager internals)."""

from __future__ import annotations

import pytest

from hybridcache.errors import InvalidRequestError
from hybridcache.events import CLEARED, REMOVED, STORED
from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.port import EnginePort
from tests.core.conftest import tiny_spec

U = 4


def _port(blocks: int | None = None, **cfg) -> EnginePort:
    spec = tiny_spec()
    config = CacheConfig(hash_unit=U, **cfg)
    cap = 1 << 20
    if blocks is not None:
        cap = blocks * HybridCacheManager(spec, 1 << 30, config).layout.block_bytes
    return EnginePort(HybridCacheManager(spec, cap, config))


def _serve(port: EnginePort, rid: str, prompt: list[int], output: list[int]) -> None:
    res = port.add_request(rid, prompt)
    a = port.allocate(rid, len(prompt) - res.hit_tokens + len(output))
    port.append_tokens(rid, output)
    port.commit(rid, a.start + a.num_tokens)
    port.free(rid)


def test_request_path_events_and_views():
    port = _port()
    prompt = list(range(30))
    res = port.add_request("a", prompt)
    assert res.hit_tokens == 0
    view = port.request("a")
    assert view.num_tokens == 30 and not view.allocated and len(view.digests) == 30 // U
    assert port.planned_save_points("a", 0, 33) == [(28, False), (32, True)]
    a = port.allocate("a", 33)
    assert view.allocated and view.num_allocated == 33  # a view follows the record
    assert port.block_tables("a")["attn"] == a.block_table["attn"]
    port.append_tokens("a", [1, 2, 3])
    port.commit("a", 33)
    events = port.take_events()
    assert port.take_events() == []  # taken out once
    kv = [e for e in events if e.kind == "kv"]
    assert [e.action for e in events] == [STORED] * len(events)
    assert sum(len(e.digests) for e in kv) == 33 // U
    assert kv[0].depth == 0 and kv[0].groups == ("attn",) and kv[0].tenant is None
    assert tuple(d for e in kv for d in e.digests) == tuple(port.digests("a"))
    assert [p for e in kv for (p,) in e.locations] == a.block_table["attn"][: 33 // U]
    (snap,) = [e for e in events if e.kind == "state"]
    assert snap.depth == 28 // U - 1 and snap.locations == (port.snapshot_slot("a", 28),)
    with pytest.raises(AttributeError):
        view.num_tokens = 3  # read-only
    port.free("a")
    assert port.request("a") is None
    # Turn-end snapshot at 32 registered on free; a repeat hits it.
    (turn_end,) = port.take_events()
    assert turn_end.kind == "state" and turn_end.depth == 32 // U - 1
    res = port.add_request("b", prompt + [1, 2, 3, 9])
    assert res.hit_tokens == 32
    prefix = port.cached_prefix("b", 8)
    assert prefix.block_tables["attn"] == a.block_table["attn"][:8] and prefix.snapshot_slot >= 0
    port.free("b")
    n = port.clear()
    events = port.take_events()
    assert n == len(events) - 1 and events[-1].action == CLEARED
    assert {e.action for e in events[:-1]} == {REMOVED}
    port.check_invariants()


def test_evictions_come_out_as_removed_events():
    port = _port(blocks=6)
    stored: set[tuple[str, bytes]] = set()
    for k in range(12):
        _serve(port, f"r{k}", list(range(100 * k, 100 * k + 13)), [5, 6, 7])
        for e in port.take_events():
            for d in e.digests:
                key = (e.kind, d)
                if e.action == STORED:
                    stored.add(key)
                else:
                    stored.remove(key)  # removed only what was stored
        port.check_invariants()
    assert port.stats()["evictions_kv"] > 0
    # What the events leave stored is exactly what the device holds.
    kv = {d for kind, d in stored if kind == "kv"}
    snaps = {d for kind, d in stored if kind == "state"}
    assert all(port.has_snapshot(d) for d in snaps)
    assert len(kv) * port.unit_kv_bytes + len(snaps) * port.snapshot_bytes == port.tenant_bytes(None)


def test_pins_and_taken_slots_keep_state():
    port = _port(blocks=4, admission="last-token")
    _serve(port, "a", list(range(13)), [])
    port.add_request("b", list(range(13)) + [50])
    pin = port.pin_snapshot("b", 12)
    assert pin is not None and pin.slot == port.snapshot_slot("b", 12)
    for k in range(6):  # pressure: the pinned snapshot must survive
        _serve(port, f"x{k}", list(range(1000 * (k + 1), 1000 * (k + 1) + 13)), [])
    assert port.snapshot_slot("b", 12) == pin.slot
    port.unpin_snapshot(pin)
    port.check_invariants()
    port.free("b")
    # take_save_slot: the engine owns the slot until release_slot.
    port.add_request("c", list(range(500, 513)))
    a = port.allocate("c", 13)
    (sp,) = a.save_points
    slot = port.take_save_slot("c", sp.boundary)
    port.commit("c", 13)
    assert port.snapshot_slot("c", sp.boundary) == -1
    port.check_invariants()
    port.free("c")
    port.release_slot(slot)
    port.check_invariants()
    with pytest.raises(InvalidRequestError):
        port.take_save_slot("c", 12)


def test_import_prefix_registers_loaded_units():
    port = _port()
    prompt = list(range(40))
    port.add_request("a", prompt)
    dev = port.device_prefix(port.digests("a"), 9)
    assert dev == (0, 0, [False] * 9, 0)
    with port.import_prefix("a") as imp:
        imp.hold(6)
        for u in range(6):
            assert imp.alloc_unit_pages(u) is not None
        assert imp.alloc_slot() >= 0
        loaded = imp.register(6, snapshot_flops=1.0)
    assert loaded == list(range(6))
    assert port.match("a").hit_tokens == 24
    events = port.take_events()
    assert [e.kind for e in events] == ["kv", "state"] and events[0].digests == tuple(port.digests("a")[:6])
    port.check_invariants()
    # An import that fails midway gives everything back.
    port.add_request("b", list(range(200, 240)))
    before = port.usage()
    with port.import_prefix("b") as imp:
        imp.alloc_unit_pages(0)
        imp.alloc_slot()
    assert port.usage() == before
    port.check_invariants()


def test_check_invariants_catches_corruption():
    port = _port()
    _serve(port, "a", list(range(30)), [1, 2])
    port.check_invariants()
    m = port._m
    m.index.kv_units += 1  # a counter that sizes allocations drifts
    with pytest.raises(AssertionError, match="unit counter"):
        port.check_invariants()
    m.index.kv_units -= 1
    run = next(iter(m.index.heads.values()))
    m.arena.free_page(run.pages[0][-1])  # a registered page freed behind the index's back
    with pytest.raises(AssertionError):
        port.check_invariants()


def test_engine_owned_pages_and_slots():
    """take_page / take_slot hand out free memory only; the port takes back only what it
    handed out (a refused release changes nothing); the invariant check counts them."""
    port = _port(blocks=8)
    free = port.free_blocks
    page, slot = port.take_page(), port.take_slot()
    assert page is not None and slot is not None and port.free_blocks < free
    assert port.usage() == (1, 1)
    port.check_invariants()
    for bad in (lambda: port.release_page(page + 1), lambda: port.release_slot(slot + 1),
                lambda: port.move_save_to("nobody", 4, slot)):
        with pytest.raises(InvalidRequestError):
            bad()
        assert port.usage() == (1, 1)
    port.release_page(page)
    port.release_slot(slot)
    with pytest.raises(InvalidRequestError):
        port.release_slot(slot)  # twice
    assert port.usage() == (0, 0) and port.free_blocks == free
    port.check_invariants()


def test_take_slot_evicts_only_when_asked_and_counts_first():
    port = _port(blocks=4, admission="last-token")
    for k in range(3):  # cached snapshots fill what KV leaves
        _serve(port, f"r{k}", list(range(100 * k, 100 * k + 13)), [])
    taken = []
    while (s := port.take_slot()) is not None:  # free memory only
        taken.append(s)
    evictions = port.stats()["evictions_state"], port.stats()["evictions_kv"]
    assert port.take_slot() is None and (port.stats()["evictions_state"],
                                         port.stats()["evictions_kv"]) == evictions
    got = port.take_slot(evict=True)  # an unheld snapshot (or KV) gives way
    assert got is not None
    assert port.stats()["evictions_state"] + port.stats()["evictions_kv"] > sum(evictions)
    port.check_invariants()
    while (s := port.take_slot(evict=True)) is not None:
        taken.append(s)
    # Nothing left to evict: refused, and nothing changed on the way.
    before = port.usage(), port.stats()
    assert port.take_slot(evict=True) is None
    assert (port.usage(), port.stats()) == before
    for s in taken + [got]:
        port.release_slot(s)
    port.check_invariants()


def test_accept_keeping_pages():
    """keep_pages: a rejected draft's pages stay in the request's table (append-only
    engine tables); without it they are freed; a refused accept changes nothing."""
    for keep in (False, True):
        port = _port()
        port.add_request("a", list(range(10)))
        port.allocate("a", 10)
        port.commit("a", 10)
        port.append_tokens("a", [7])
        port.allocate("a", 1 + 8, num_draft=8)  # the token plus 8 drafts: up to 19 tokens
        view = port.request("a")
        assert view.num_draft_slots == 8 and view.step_start == 10
        pages = port.block_tables("a")["attn"]
        assert len(pages) == -(-19 // U)
        before = port.usage()
        with pytest.raises(InvalidRequestError):
            port.accept("a", 0, keep_pages=keep)
        assert port.block_tables("a")["attn"] == pages and port.usage() == before
        port.accept("a", 2, keep_pages=keep)  # 12 tokens
        after = port.block_tables("a")["attn"]
        assert after == (pages if keep else pages[: -(-12 // U)])
        assert view.num_allocated == 12 and view.num_draft_slots == 0
        port.check_invariants()
        port.free("a")
        port.check_invariants()


def test_move_save_to_registers_the_engines_slot():
    port = _port(admission="last-token")
    port.add_request("a", list(range(13)))
    (sp,) = port.allocate("a", 13).save_points
    mine = port.take_slot()
    with pytest.raises(InvalidRequestError):
        port.move_save_to("a", sp.boundary + U, mine)  # no save point there
    with pytest.raises(InvalidRequestError):
        port.move_save_to("a", sp.boundary, mine, turn_end=True)  # not the turn-end save
    assert port.request("a").save_slots == {sp.boundary: sp.slot}
    port.move_save_to("a", sp.boundary, mine)
    assert port.request("a").save_slots == {sp.boundary: mine}
    with pytest.raises(InvalidRequestError):
        port.release_slot(mine)  # the request's now, not the engine's
    port.commit("a", 13)
    assert port.snapshot_slot("a", sp.boundary) == mine
    port.check_invariants()
    port.free("a")
    port.check_invariants()


def _cached_port(blocks: int) -> tuple[EnginePort, HybridCacheManager]:
    """A port whose arena of ``blocks`` blocks holds three served prompts' KV and
    snapshots (:data:`HIT_PROMPT` hits the first, the least recent)."""
    spec = tiny_spec()
    config = CacheConfig(hash_unit=U, admission="last-token")
    cap = blocks * HybridCacheManager(spec, 1 << 30, config).layout.block_bytes
    m = HybridCacheManager(spec, cap, config)
    port = EnginePort(m)
    for k in range(3):
        _serve(port, f"r{k}", list(range(100 * k, 100 * k + 13)), [1, 2, 3])
    return port, m


HIT_PROMPT = list(range(13)) + [1, 2, 3, 7]  # the first (least recent) prompt and output, then more


@pytest.mark.parametrize("blocks", range(4, 12))
def test_can_allocate_counts_extra_slots_then_take_slots_and_allocate_succeed(blocks):
    """``can_allocate(extra_slots=k)`` says yes exactly when ``take_slots(k)`` then
    ``allocate`` both succeed; a no changes nothing (the core's fingerprint)."""
    from hybridcache.errors import OutOfSpaceError
    from tests.core.fingerprint import fingerprint

    for k in range(5):
        for num_new in (1, 9, 30):
            port, m = _cached_port(blocks)
            port.add_request("n", HIT_PROMPT)
            before = fingerprint(m)
            ok = port.can_allocate("n", num_new, extra_slots=k)
            assert fingerprint(m) == before  # counting changes nothing
            if not ok:
                continue
            slots = port.take_slots("n", k)
            assert slots is not None and len(set(slots)) == k
            port.allocate("n", num_new)  # never OutOfSpaceError after a yes
            port.check_invariants()
        # A no from the count with k = 0 is the core's own refusal.
        port, m = _cached_port(blocks)
        port.add_request("n", list(range(13)))
        if not port.can_allocate("n", 40):
            before = fingerprint(m)
            with pytest.raises(OutOfSpaceError):
                port.allocate("n", 40)
            assert fingerprint(m) == before


@pytest.mark.parametrize("blocks", range(6, 12))
def test_take_slots_before_a_first_allocation_keep_its_hit(blocks):
    """Slots taken for a request not yet allocated never evict the hit it will hold:
    the same slots taken one by one with ``take_slot(evict=True)`` lose that hit."""
    hits = {}
    for how in ("take_slots", "take_slot"):
        port, m = _cached_port(blocks)
        res = port.add_request("n", HIT_PROMPT)
        assert res.hit_tokens > 0
        want = 0
        while port.can_allocate("n", 4, extra_slots=want + 1):
            want += 1
        assert want > 0
        if how == "take_slots":
            assert port.take_slots("n", want) is not None
        else:
            for _ in range(want):
                assert port.take_slot(evict=True) is not None
        try:
            hits[how] = port.allocate("n", 4).hit_tokens
        except Exception:  # noqa: BLE001 - the hit was evicted and the rest did not fit
            hits[how] = -1
    assert hits["take_slots"] == res.hit_tokens
    assert hits["take_slot"] != res.hit_tokens


def test_take_slots_refused_changes_nothing():
    from tests.core.fingerprint import fingerprint

    port, m = _cached_port(4)
    port.add_request("n", list(range(13)))
    before = fingerprint(m), port.usage()
    assert port.take_slots("n", 100) is None
    assert (fingerprint(m), port.usage()) == before
    with pytest.raises(InvalidRequestError):
        port.take_slots("missing", 1)
