"""Arena geometry and allocator invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridcache.arena import Arena, plan_layout
from hybridcache.errors import CapacityError
from hybridcache.presets import get_preset
from tests.core.conftest import tiny_spec


def test_kimi_linear_layout_tiles_blocks_exactly():
    spec = get_preset("kimi-linear-48b")
    lay = plan_layout(spec, 8 << 30, hash_unit=16)
    assert lay.page_bytes == 16 * 8064  # 129,024: already 256-aligned
    assert lay.slots_per_block == 1
    assert lay.block_bytes == lay.pages_per_block * lay.page_bytes >= spec.snapshot_bytes
    assert lay.block_bytes - spec.snapshot_bytes < lay.page_bytes  # waste < one page
    # every state tensor of every layer sits inside the slot, aligned, without overlap
    spans = sorted((p.offset, p.offset + p.nbytes) for p in lay.placements)
    assert len(spans) == 40 and spans[-1][1] <= lay.slot_bytes
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert all(p.offset % 256 == 0 for p in lay.placements)


def test_small_state_packs_several_slots_per_page():
    lay = plan_layout(tiny_spec(big_state=False), 1 << 20, hash_unit=16)
    assert lay.pages_per_block == 1
    assert lay.slots_per_block == lay.page_bytes // lay.slot_bytes > 1


def test_capacity_error_says_bytes_needed():
    spec = get_preset("kimi-linear-48b")
    with pytest.raises(CapacityError, match=r"needs at least \d+ B"):
        plan_layout(spec, 1 << 20, hash_unit=16)


@settings(max_examples=80, deadline=None)
@given(
    big_state=st.booleans(),
    blocks=st.integers(1, 8),
    ops=st.lists(st.tuples(st.sampled_from(["page", "slot", "free"]), st.integers(0, 10**6)), max_size=200),
)
def test_allocator_never_double_allocates_or_overflows(big_state, blocks, ops):
    spec = tiny_spec(big_state=big_state)
    probe = plan_layout(spec, 1 << 30, hash_unit=4)
    arena = Arena(plan_layout(spec, blocks * probe.block_bytes, hash_unit=4))
    lay = arena.layout
    pages: set[int] = set()
    slots: set[int] = set()
    for op, r in ops:
        if op == "page":
            p = arena.alloc_page()
            if p is None:  # only when no block has room for a page
                assert arena.free_block_count == 0
            else:
                assert p not in pages and 0 <= p < lay.num_pages
                pages.add(p)
        elif op == "slot":
            s = arena.alloc_slot()
            if s is None:
                assert arena.free_block_count == 0
            else:
                assert s not in slots and 0 <= s < lay.num_slots
                slots.add(s)
        elif pages or slots:
            pool = sorted(pages) + [-1 - s for s in sorted(slots)]
            x = pool[r % len(pool)]
            if x >= 0:
                arena.free_page(x)
                pages.remove(x)
            else:
                arena.free_slot(-1 - x)
                slots.remove(-1 - x)
        # a block holds one kind only, and bytes stay within the budget
        page_blocks = {p // lay.pages_per_block for p in pages}
        slot_blocks = {s // lay.slots_per_block for s in slots}
        assert not page_blocks & slot_blocks
        st_ = arena.stats()
        assert st_.used_bytes == (len(page_blocks) + len(slot_blocks)) * lay.block_bytes <= st_.capacity_bytes
        assert arena.pages_in_use == len(pages) and arena.slots_in_use == len(slots)
    for p in list(pages):
        arena.free_page(p)
    for s in list(slots):
        arena.free_slot(s)
    assert arena.free_block_count == lay.num_blocks


def test_double_free_is_rejected():
    arena = Arena(plan_layout(tiny_spec(), 1 << 20, hash_unit=4))
    s = arena.alloc_slot()
    arena.free_slot(s)
    with pytest.raises(ValueError):
        arena.free_slot(s)


def test_double_free_inside_a_busy_block_is_rejected():
    spec = tiny_spec(big_state=False)
    arena = Arena(plan_layout(spec, 1 << 20, hash_unit=16))
    a, b = arena.alloc_slot(), arena.alloc_slot()
    assert a // arena.layout.slots_per_block == b // arena.layout.slots_per_block
    arena.free_slot(a)
    with pytest.raises(ValueError):
        arena.free_slot(a)


@settings(max_examples=80, deadline=None)
@given(
    big_state=st.booleans(),
    blocks=st.integers(1, 6),
    ops=st.lists(
        st.tuples(st.sampled_from(["page", "slot", "free", "bulk"]), st.integers(0, 10**6)),
        max_size=120,
    ),
)
def test_bulk_page_allocation_equals_one_by_one(big_state, blocks, ops):
    """alloc_pages(n) returns exactly what n alloc_page() calls would, and leaves the
    allocator in the same state (checked by replaying every op on a twin arena)."""
    spec = tiny_spec(big_state=big_state)
    probe = plan_layout(spec, 1 << 30, hash_unit=4)
    lay = plan_layout(spec, blocks * probe.block_bytes, hash_unit=4)
    bulk, single = Arena(lay), Arena(lay)
    pages: list[int] = []
    slots: list[int] = []
    for op, r in ops:
        if op == "bulk":
            n = r % (2 * max(lay.pages_per_block, 1) + 2)
            got = bulk.alloc_pages(n)
            want = [p for p in (single.alloc_page() for _ in range(n)) if p is not None]
            assert got == want
            pages += got
        elif op == "page":
            p = bulk.alloc_page()
            assert p == single.alloc_page()
            if p is not None:
                pages.append(p)
        elif op == "slot":
            s = bulk.alloc_slot()
            assert s == single.alloc_slot()
            if s is not None:
                slots.append(s)
        elif pages or slots:
            pool = pages if (r % 2 == 0 and pages) or not slots else slots
            e = pool.pop(r % len(pool))
            (bulk.free_page if pool is pages else bulk.free_slot)(e)
            (single.free_page if pool is pages else single.free_slot)(e)
        assert bulk.pages_in_use == single.pages_in_use == len(pages)
        assert bulk.stats() == single.stats()
