"""Segment merging: runs must copy exactly the same bytes as the segments they replace."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels_testlib import TensorSpec, make_arena

from hybridcache.kernels import copy_states
from hybridcache.kernels.layout import RowCopyJob, byte_rows
from hybridcache.kernels.segments import Segments, build_segments, merge_adjacent


def _byte_map(segs: Segments) -> dict[int, tuple[int, int]]:
    """dst byte -> (src byte, src storage) for every byte the segments copy."""
    out = {}
    for k in range(len(segs)):
        for b in range(int(segs.nbytes[k])):
            out[int(segs.dst[k]) + b] = (int(segs.src[k]) + b, int(segs.src_store[k]))
    return out


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(st.integers(0, 6), st.integers(1, 4), st.integers(0, 1)), min_size=0, max_size=8
    ),
    st.randoms(use_true_random=False),
)
def test_merge_preserves_the_byte_mapping(rows, rnd):
    """Random segments laid out back to back on the destination side (so they are disjoint),
    with sources that sometimes continue each other; merging must not change which source
    byte lands on which destination byte, nor join segments from different storages."""
    src, dst, nb, store = [], [], [], []
    pos = 1000
    for src_row, n, st_id in rows:
        src.append(src_row * 4)
        dst.append(pos)
        nb.append(n)
        store.append(st_id)
        pos += n + rnd.choice([0, 0, 1])
    order = list(range(len(rows)))
    rnd.shuffle(order)
    a = lambda v: np.array([v[i] for i in order], np.int64)  # noqa: E731
    z = np.zeros(len(rows), np.int64)
    segs = Segments(a(src), a(dst), a(nb), z, z, a(store), z)
    runs, counts = merge_adjacent(segs)
    assert counts.sum() == len(rows) and runs.nbytes.sum() == sum(nb)
    assert _byte_map(runs) == _byte_map(segs)


def test_slot_major_arena_merges_each_snapshot_into_one_run():
    """Rows of one slot are back to back (sizes multiple of 16): a snapshot is one run, and
    consecutive destination slots fed by consecutive source slots form one run."""
    specs = [TensorSpec(torch.float32, (4, 8)), TensorSpec(torch.bfloat16, (24,))] * 3
    arena = make_arena(specs, 8)
    buf = arena.random_buffer(1)
    views = arena.views(buf)
    rows = [byte_rows(t, "t") for t in views]

    def runs_for(pairs):
        src = np.array([s for s, _ in pairs], np.int64)
        dst = np.array([d for _, d in pairs], np.int64)
        jobs = [
            RowCopyJob(r, r, src, dst, np.full(len(pairs), r.shape[1], np.int64), "t") for r in rows
        ]
        return merge_adjacent(build_segments(jobs))[1]

    assert runs_for([(0, 5), (3, 7)]).tolist() == [len(specs), len(specs)]
    assert runs_for([(0, 4), (1, 5), (2, 6)]).tolist() == [3 * len(specs)]
    assert runs_for([(1, 4), (1, 5)]).tolist() == [len(specs), len(specs)]  # fan-out
    copy_states([(0, 4), (1, 5), (2, 6)], views)
    for t in views:
        assert torch.equal(
            t[4:7].reshape(-1).view(torch.uint8), t[0:3].reshape(-1).view(torch.uint8)
        )
