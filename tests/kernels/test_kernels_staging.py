"""Host staging: layout arithmetic, gather/scatter round trips on every backend, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernels_testlib import POISON, TensorSpec, make_arena, mixed_specs, poison_rows
from test_kernels_copy import backend  # noqa: F401  (shared backend fixture)

from hybridcache.kernels import (
    STAGING_ALIGN,
    LayoutError,
    PlanError,
    allocate_staging,
    gather_to_host,
    scatter_from_host,
    staging_layout,
    staging_views,
)


def _covered(layout, capacity: int) -> torch.Tensor:
    """Boolean mask of the staging bytes that belong to some row (the rest is padding)."""
    mask = torch.zeros(capacity, layout.entry_bytes, dtype=torch.bool)
    for off, rb in zip(layout.offsets, layout.row_bytes):
        mask[:, off : off + rb] = True
    return mask


def test_layout_arithmetic():
    specs = mixed_specs()
    tensors = make_arena(specs, 3).views(
        torch.zeros(make_arena(specs, 3).nbytes, dtype=torch.uint8)
    )
    layout = staging_layout(tensors)
    assert layout.row_bytes == tuple(s.row_bytes for s in specs)
    assert all(off % STAGING_ALIGN == 0 for off in layout.offsets)
    assert layout.entry_bytes % STAGING_ALIGN == 0
    ends = [o + r for o, r in zip(layout.offsets, layout.row_bytes)]
    assert all(e <= o for e, o in zip(ends, layout.offsets[1:]))  # rows never overlap
    assert ends[-1] <= layout.entry_bytes < ends[-1] + STAGING_ALIGN
    staging = allocate_staging(tensors, 5)
    assert staging.shape == (5, layout.entry_bytes) and staging.dtype == torch.uint8
    assert not staging.is_pinned()  # no CUDA here
    assert layout.capacity(staging) == 5 and layout.nbytes(5) == staging.numel()
    assert allocate_staging(layout, 2).shape == (2, layout.entry_bytes)


def test_allocate_errors():
    t = [torch.zeros(2, 4)]
    with pytest.raises(LayoutError, match=">= 0"):
        allocate_staging(t, -1)
    if not torch.cuda.is_available():
        with pytest.raises(LayoutError, match="cannot pin"):
            allocate_staging(t, 1, pin=True)


def test_gather_scatter_round_trip(backend):  # noqa: F811
    arena = make_arena(mixed_specs(), 10, pad=8)
    buf = arena.random_buffer(11)
    views = arena.views(buf)
    original = buf.clone()
    staging = allocate_staging(views, 4)
    staging.fill_(POISON)
    slots = [3, 0, 7]
    copied = gather_to_host(slots, views, staging, **backend)
    assert copied == 3 * sum(s.row_bytes for s in arena.specs)
    typed = staging_views(staging, views)
    for t, st in zip(views, typed):
        for k, s in enumerate(slots):
            assert torch.equal(
                st[k].reshape(-1).view(torch.uint8), t[s].reshape(-1).view(torch.uint8)
            )
    layout = staging_layout(views)
    padding = ~_covered(layout, 4)
    padding[3] = True  # entry 3 was not written at all
    assert bool((staging[padding] == POISON).all()), "gather wrote outside its rows"
    # Scatter entries back into other slots (pair plan: entry -> slot) and into the originals.
    poison_rows(views, [3, 0, 7, 8, 9])
    scatter_from_host([(0, 8), (2, 9), (1, 0)], views, staging, **backend)
    scatter_from_host(np.array([3, 100, 7])[[0, 2]], views, staging[[0, 1]], **backend)
    expected = original.clone()
    ev = arena.views(expected)
    for t in ev:
        t[8], t[9] = t[3].clone(), t[7].clone()
        t[7] = t[0].clone()  # entry 1 (slot 0) went to slot 7 via the second scatter
    assert torch.equal(buf, expected)


def test_gather_pair_plan_to_chosen_entries(backend):  # noqa: F811
    arena = make_arena([TensorSpec(torch.bfloat16, (9,)), TensorSpec(torch.float32, (4, 4))], 6)
    buf = arena.random_buffer(12)
    views = arena.views(buf)
    staging = allocate_staging(views, 6)
    staging.fill_(POISON)
    gather_to_host(torch.tensor([[5, 4], [5, 1]]), views, staging, **backend)  # fan-out is fine
    typed = staging_views(staging, views)
    for t, st in zip(views, typed):
        assert torch.equal(st[4].view(torch.uint8), t[5].view(torch.uint8))
        assert torch.equal(st[1].view(torch.uint8), t[5].view(torch.uint8))
    untouched = staging[[0, 2, 3, 5]]
    assert bool((untouched == POISON).all())


def test_transfer_errors(backend):  # noqa: F811
    views = [torch.zeros(6, 8), torch.zeros(6, 3, dtype=torch.bfloat16)]
    staging = allocate_staging(views, 2)
    with pytest.raises(PlanError, match="staging destination index 2"):
        gather_to_host([0, 1, 2], views, staging, **backend)
    with pytest.raises(PlanError, match="source index 6"):
        gather_to_host([6], views, staging, **backend)
    with pytest.raises(PlanError, match="destination index 9"):
        scatter_from_host([9], views, staging, **backend)
    with pytest.raises(PlanError, match="slot 1 is written by"):
        gather_to_host([(0, 1), (2, 1)], views, staging, **backend)
    with pytest.raises(PlanError, match="slot 3 is written by"):
        scatter_from_host([3, 3], views, staging, **backend)
    with pytest.raises(LayoutError, match="uint8"):
        gather_to_host([0], views, staging.view(torch.int16), **backend)
    with pytest.raises(LayoutError, match="contiguous"):
        gather_to_host([0], views, staging.t(), **backend)
    alias = torch.zeros(2, staging_layout(views).entry_bytes, dtype=torch.uint8)
    overlapping = [alias.view(torch.float32)[:, :8]]  # the tensor lives inside the staging
    with pytest.raises(PlanError, match="overlaps"):
        gather_to_host([0], overlapping, alias, **backend)
    assert gather_to_host([], views, staging, **backend) == 0
