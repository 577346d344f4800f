"""copy_states / copy_kv_pages on every backend against an independent reference.

Every test runs on three backends: the torch path with everything batched, the torch path
with everything looped, and the Triton kernel in the interpreter (with a tiny chunk size
so segments are split across programs). Destination rows are poisoned first and the whole
arena is compared byte for byte, so an unwritten byte, a byte written past a row's end or
into padding, or a wrong source all fail.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels_testlib import (
    DTYPES,
    TensorSpec,
    make_arena,
    mixed_specs,
    poison_rows,
    reference_copy,
)

from hybridcache.kernels import (
    BackendError,
    LayoutError,
    PlanError,
    copy_kv_pages,
    copy_states,
    resolve_backend,
    torch_copy,
)


def _triton_skip_reason() -> str | None:
    try:
        from hybridcache.kernels import triton_copy
    except ImportError:
        return "triton is not importable"

    if not triton_copy.INTERPRETED:
        return "triton_copy was imported before TRITON_INTERPRET=1 was set"
    return None


TRITON_SKIP = _triton_skip_reason()


@pytest.fixture(
    params=[
        "torch-batched",
        "torch-loop",
        pytest.param(
            "triton", marks=pytest.mark.skipif(TRITON_SKIP is not None, reason=str(TRITON_SKIP))
        ),
    ]
)
def backend(request, monkeypatch) -> dict:
    """Keyword arguments selecting one backend (and its strategy) for the public API."""
    if request.param == "torch-batched":
        monkeypatch.setattr(torch_copy, "BATCH_MAX_ROW_BYTES", 1 << 40)
        return {"backend": "torch"}
    if request.param == "torch-loop":
        monkeypatch.setattr(torch_copy, "BATCH_MAX_ROW_BYTES", 0)
        return {"backend": "torch"}
    return {"backend": "triton", "chunk_bytes": 64}


def _run_and_compare(arena, plan_pairs, run, seed=0, nbytes_per_tensor=None):
    """Poison destinations, run ``run(views)``, compare the arena with the reference."""
    buf = arena.random_buffer(seed)
    views = arena.views(buf)
    poison_rows(views, [d for _, d in plan_pairs if _ != d])
    expected = buf.clone()
    reference_copy(arena.views(expected), plan_pairs, nbytes_per_tensor)
    result = run(views)
    assert torch.equal(buf, expected), "arena differs from the reference copy"
    return result


def test_copy_states_mixed_dtypes(backend):
    arena = make_arena(mixed_specs(), 12, pad=8)
    pairs = [(0, 5), (0, 6), (1, 7), (2, 2), (3, 8), (11, 4)]
    copied = _run_and_compare(arena, pairs, lambda v: copy_states(pairs, v, **backend))
    assert copied == 5 * sum(s.row_bytes for s in arena.specs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_states_each_dtype(backend, dtype):
    arena = make_arena([TensorSpec(dtype, (3, 11))], 6)
    pairs = [(0, 3), (1, 4), (1, 5)]
    _run_and_compare(arena, pairs, lambda v: copy_states(pairs, v, **backend), seed=1)


def test_copy_states_misaligned_rows(backend):
    """Rows at addresses that are not 16-byte aligned (kernel head/tail path) ..."""
    arena = make_arena(mixed_specs(), 8, base=4, align=4)
    pairs = [(0, 4), (1, 5), (2, 6)]
    _run_and_compare(arena, pairs, lambda v: copy_states(pairs, v, **backend), seed=2)


def test_copy_states_rows_differently_aligned(backend):
    """... and rows whose source and destination differ modulo 16 (kernel byte path)."""
    specs = [TensorSpec(torch.uint8, (37,)), TensorSpec(torch.int8, (150,))]
    arena = make_arena(specs, 6, base=3, align=1, slot_round=1)
    pairs = [(0, 1), (2, 5), (3, 4)]
    _run_and_compare(arena, pairs, lambda v: copy_states(pairs, v, **backend), seed=3)


def test_copy_states_plan_forms(backend):
    arena = make_arena(mixed_specs()[:2], 6)
    forms = [
        [(0, 3), (1, 4)],
        np.array([[0, 3], [1, 4]], dtype=np.int32),
        torch.tensor([[0, 3], [1, 4]]),
        SimpleNamespace(src=(0, 1), dst=(3, 4)),
        SimpleNamespace(src=np.array([0, 1], np.uint8), dst=torch.tensor([3, 4])),
    ]
    for form in forms:
        _run_and_compare(arena, [(0, 3), (1, 4)], lambda v, f=form: copy_states(f, v, **backend))


def test_identity_pairs_are_noops(backend):
    arena = make_arena(mixed_specs(), 6)
    buf = arena.random_buffer(4)
    before = buf.clone()
    assert copy_states([(3, 3)], arena.views(buf), **backend) == 0
    assert torch.equal(buf, before)
    pairs = [(3, 3), (3, 4)]  # a no-op slot may still be read by another pair
    _run_and_compare(arena, pairs, lambda v: copy_states(pairs, v, **backend), seed=4)


@pytest.mark.parametrize(
    "plan",
    [
        [],
        (),
        np.zeros((0, 2), np.int64),
        torch.zeros((0, 2), dtype=torch.long),
        SimpleNamespace(src=[], dst=[]),
    ],
    ids=["list", "tuple", "numpy", "torch", "object"],
)
def test_empty_plan_is_noop(backend, plan):
    arena = make_arena(mixed_specs(), 4)
    buf = arena.random_buffer(5)
    before = buf.clone()
    assert copy_states(plan, arena.views(buf), **backend) == 0
    assert copy_kv_pages(plan, arena.views(buf)[:1], **backend) == 0
    assert torch.equal(buf, before)


@pytest.mark.parametrize(
    ("plan", "needle"),
    [
        ([(0, 5), (1, 5)], "slot 5 is written by pair 0"),
        ([(0, 5), (5, 6)], "destination slot 5"),
        ([(2, 2), (1, 2)], "slot 2 is written by"),
        ([(1, 2), (3, 1)], "destination slot 1"),
    ],
)
def test_overlapping_plans_rejected(backend, plan, needle):
    arena = make_arena(mixed_specs(), 8)
    buf = arena.random_buffer(6)
    before = buf.clone()
    with pytest.raises(PlanError, match=needle):
        copy_states(plan, arena.views(buf), **backend)
    with pytest.raises(ValueError):  # PlanError is a ValueError
        copy_kv_pages(plan, arena.views(buf), **backend)
    assert torch.equal(buf, before)


def test_out_of_range_slots_rejected(backend):
    small = torch.zeros(4, 8)
    big = torch.zeros(10, 8)
    with pytest.raises(PlanError, match=r"destination index 6 .*tensors\[0\].*4 slots"):
        copy_states([(0, 6)], [small, big], **backend)
    with pytest.raises(PlanError, match="source index -1"):
        copy_states([(-1, 2)], [big], **backend)
    with pytest.raises(PlanError, match="index 10"):
        copy_states([(10, 10)], [big], **backend)  # even a no-op pair must be in range


def test_aliasing_tensors_rejected(backend):
    buf = torch.zeros(256, dtype=torch.uint8)
    a = buf[:160].view(10, 16)
    with pytest.raises(PlanError, match="destinations overlap"):
        copy_states([(0, 1)], [a, a], **backend)
    shifted = buf[16:176].view(10, 16)  # shifted's row 0 is a's row 1
    with pytest.raises(PlanError, match="overlaps"):
        copy_states([(0, 1)], [a, shifted], **backend)
    copy_states([(0, 2)], [a, shifted], **backend)  # disjoint bytes: fine


def test_layout_errors():
    x = torch.zeros(4, 3, 5)
    with pytest.raises(LayoutError, match="not contiguous"):
        copy_states([(0, 1)], [x.transpose(1, 2)])
    with pytest.raises(LayoutError, match="0-dimensional"):
        copy_states([(0, 1)], [torch.tensor(1.0)])
    with pytest.raises(LayoutError, match="list of tensors"):
        copy_states([(0, 1)], x)
    with pytest.raises(LayoutError, match="rows overlap"):
        copy_states([(0, 1)], [torch.as_strided(torch.zeros(40), (4, 10), (5, 1))])


def test_backend_names():
    with pytest.raises(BackendError, match="unknown backend"):
        copy_states([(0, 1)], [torch.zeros(2, 2)], backend="cuda")
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("torch", torch.device("cpu")) == "torch"


def test_manager_copy_plan_accepted(backend):
    manager = pytest.importorskip("hybridcache.manager")
    plan = manager.CopyPlan((0, 1), (4, 5))
    arena = make_arena(mixed_specs(), 6)
    _run_and_compare(arena, [(0, 4), (1, 5)], lambda v: copy_states(plan, v, **backend), seed=7)


def _kv_arena():
    specs = [TensorSpec(torch.bfloat16, (4, 2, 8)), TensorSpec(torch.float16, (4, 36))]
    return make_arena(specs, 8, pad=16)


def test_copy_kv_full_pages(backend):
    arena = _kv_arena()
    pairs = [(0, 4), (1, 5), (1, 6)]
    copied = _run_and_compare(arena, pairs, lambda v: copy_kv_pages(pairs, v, **backend), seed=8)
    assert copied == 3 * (128 + 288)


@pytest.mark.parametrize("num_tokens", [3, [1, 4, 0], np.array([2, 2, 3])], ids=str)
def test_copy_kv_partial_pages(backend, num_tokens):
    arena = _kv_arena()
    pairs = [(0, 4), (1, 5), (2, 6)]
    counts = np.broadcast_to(np.asarray(num_tokens), (3,))
    token_bytes = [s.row_bytes // s.row_shape[0] for s in arena.specs]
    nbytes = [[int(c) * tb for c in counts] for tb in token_bytes]
    copied = _run_and_compare(
        arena,
        pairs,
        lambda v: copy_kv_pages(pairs, v, num_tokens=num_tokens, **backend),
        seed=9,
        nbytes_per_tensor=nbytes,
    )
    assert copied == sum(sum(n) for n in nbytes)


def test_copy_kv_partial_errors():
    kv = [torch.zeros(6, 4, 8)]
    with pytest.raises(PlanError, match="exceeds the page size 4"):
        copy_kv_pages([(0, 1)], kv, num_tokens=5)
    with pytest.raises(PlanError, match="2 entries for 1 pairs"):
        copy_kv_pages([(0, 1)], kv, num_tokens=[1, 2])
    with pytest.raises(PlanError, match=">= 0"):
        copy_kv_pages([(0, 1)], kv, num_tokens=-1)
    with pytest.raises(PlanError, match="no token dimension"):
        copy_kv_pages([(0, 1)], [torch.zeros(6)], num_tokens=1)
    with pytest.raises(PlanError, match="integers"):
        copy_kv_pages([(0, 1)], kv, num_tokens=[1.5])


def test_mixed_devices_and_non_tensors_rejected():
    with pytest.raises(LayoutError, match="several devices"):
        copy_states([(0, 1)], [torch.zeros(4, 2), torch.zeros(4, 2, device="meta")])
    with pytest.raises(LayoutError, match="expected a torch.Tensor"):
        copy_states([(0, 1)], [np.zeros((4, 2))])


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), max_size=6),
    st.sampled_from(["torch", "triton"] if TRITON_SKIP is None else ["torch"]),
    st.integers(0, 3),
)
def test_random_plans_match_reference_or_are_rejected(pairs, backend_name, base_words):
    """Any plan either copies exactly like the reference or raises PlanError untouched."""
    arena = make_arena(mixed_specs(), 10, base=4 * base_words, pad=4)
    buf = arena.random_buffer(len(pairs))
    before = buf.clone()
    dsts = [d for _, d in pairs]
    valid = len(set(dsts)) == len(dsts) and all(
        d not in {s for s, _ in pairs} for s, d in pairs if s != d
    )
    if not valid:
        with pytest.raises(PlanError):
            copy_states(pairs, arena.views(buf), backend=backend_name)
        assert torch.equal(buf, before)
        return
    expected = buf.clone()
    reference_copy(arena.views(expected), pairs)
    copy_states(pairs, arena.views(buf), backend=backend_name, chunk_bytes=256)
    assert torch.equal(buf, expected)
