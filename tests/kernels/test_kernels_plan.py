"""Plan normalisation and validation: unit cases plus hypothesis properties against
set-based reference models (no kernel involved, so these run fast and in any environment)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridcache.kernels import PlanError, normalize_plan, normalize_transfer
from hybridcache.kernels.layout import RowCopyJob
from hybridcache.kernels.plan import CopyPairs, check_range, validate_same_space
from hybridcache.kernels.segments import Segments, check_disjoint

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True)
slot = st.integers(min_value=0, max_value=12)
pair_lists = st.lists(st.tuples(slot, slot), max_size=10)


def _model_valid(pairs: list[tuple[int, int]]) -> bool:
    """Reference rules: distinct destinations; a real copy's destination is nobody's source."""
    dsts = [d for _, d in pairs]
    srcs = {s for s, _ in pairs}
    return len(set(dsts)) == len(dsts) and all(d not in srcs for s, d in pairs if s != d)


@SETTINGS
@given(pair_lists)
def test_all_plan_forms_normalise_alike(pairs):
    expected_src = [s for s, _ in pairs]
    expected_dst = [d for _, d in pairs]
    forms = [
        pairs,
        np.array(pairs, dtype=np.int64).reshape(-1, 2),
        torch.tensor(pairs, dtype=torch.int32).reshape(-1, 2),
        SimpleNamespace(src=expected_src, dst=expected_dst),
        SimpleNamespace(src=np.array(expected_src, np.int16), dst=tuple(expected_dst)),
    ]
    for form in forms:
        p = normalize_plan(form)
        assert p.src.dtype == np.int64 and p.dst.dtype == np.int64
        assert p.src.tolist() == expected_src and p.dst.tolist() == expected_dst


@SETTINGS
@given(pair_lists)
def test_validation_matches_reference_model(pairs):
    p = normalize_plan(pairs)
    if _model_valid(pairs):
        kept, keep = validate_same_space(p)
        assert list(zip(kept.src.tolist(), kept.dst.tolist())) == [
            (s, d) for s, d in pairs if s != d
        ]
        assert keep.tolist() == [s != d for s, d in pairs]
    else:
        with pytest.raises(PlanError) as info:
            validate_same_space(p)
        # The message names a slot that really is written twice or written and read.
        dsts = [d for _, d in pairs]
        srcs = {s for s, _ in pairs}
        culprits = {d for d in dsts if dsts.count(d) > 1} | {
            d for s, d in pairs if s != d and d in srcs
        }
        assert any(f"slot {c} " in str(info.value) for c in culprits)


@SETTINGS
@given(st.lists(st.integers(-3, 20), max_size=8), st.integers(1, 16))
def test_check_range_matches_model(indices, limit):
    arr = np.array(indices, np.int64)
    if all(0 <= i < limit for i in indices):
        check_range(arr, limit, "source", "t")
    else:
        with pytest.raises(PlanError, match="out of range"):
            check_range(arr, limit, "source", "t")


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 12), st.integers(0, 60)), max_size=8))
def test_byte_overlap_check_matches_brute_force(segments):
    """check_disjoint vs an all-pairs interval test; segments are (src, nbytes, dst)."""
    segs = [(s, n, d) for s, n, d in segments if n > 0]
    src = np.array([s for s, _, _ in segs], np.int64)
    nb = np.array([n for _, n, _ in segs], np.int64)
    dst = np.array([d for _, _, d in segs], np.int64)
    idx = np.arange(len(segs), dtype=np.int64)
    s = Segments(src, dst, nb, np.zeros(len(segs), np.int64), idx)
    job = RowCopyJob(
        torch.zeros(1, 1, dtype=torch.uint8),
        torch.zeros(1, 1, dtype=torch.uint8),
        idx,
        idx,
        nb,
        "t",
    )

    def hit(a0, an, b0, bn):
        return a0 < b0 + bn and b0 < a0 + an

    bad = any(
        (i != j and hit(dst[i], nb[i], dst[j], nb[j])) or hit(dst[i], nb[i], src[j], nb[j])
        for i in range(len(segs))
        for j in range(len(segs))
    )
    if bad:
        with pytest.raises(PlanError):
            check_disjoint(s, [job])
    else:
        check_disjoint(s, [job])


@pytest.mark.parametrize(
    ("plan", "needle"),
    [
        ([(1, 2, 3)], "shape"),
        ([1, 2], "shape"),
        ([(0.5, 1)], "integers"),
        (np.array([[True, False]]), "integers"),
        ([(1, 2), (3,)], "rectangular"),
        (SimpleNamespace(src=[1, 2], dst=[3]), "2 entries"),
        (SimpleNamespace(src=[[1]], dst=[[2]]), "one-dimensional"),
        (SimpleNamespace(src=[[1], [2, 3]], dst=[1, 2]), "rectangular"),
        (SimpleNamespace(src=3, dst=4), "one-dimensional"),
        (np.array([[2**64 - 1, 0]], dtype=np.uint64), "int64"),
    ],
)
def test_malformed_plans_rejected(plan, needle):
    with pytest.raises(PlanError, match=needle):
        normalize_plan(plan)


def test_transfer_plan_forms():
    g = normalize_transfer([7, 3], to_host=True)
    assert g.src.tolist() == [7, 3] and g.dst.tolist() == [0, 1]
    s = normalize_transfer(np.array([7, 3]), to_host=False)
    assert s.src.tolist() == [0, 1] and s.dst.tolist() == [7, 3]
    p = normalize_transfer([(7, 2)], to_host=True)
    assert p.src.tolist() == [7] and p.dst.tolist() == [2]
    assert len(normalize_transfer([], to_host=True)) == 0
    cp = CopyPairs(np.array([1]), np.array([2]))
    assert normalize_transfer(cp, to_host=False) is cp
