"""The Triton kernel itself, run by Triton's interpreter on CPU (TRITON_INTERPRET=1, set in
conftest.py before the kernel module is imported): one launch per plan, chunk splitting,
every alignment path, and bit-identical results to the torch path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels_testlib import POISON, TensorSpec, make_arena, mixed_specs, poison_rows
from test_kernels_copy import TRITON_SKIP

from hybridcache.kernels import allocate_staging, copy_kv_pages, copy_states, gather_to_host
from hybridcache.kernels.segments import Segments

pytestmark = pytest.mark.skipif(TRITON_SKIP is not None, reason=str(TRITON_SKIP))


@pytest.fixture
def tc():
    from hybridcache.kernels import triton_copy

    return triton_copy


@pytest.fixture
def launches(tc, monkeypatch):
    """Record the table of every kernel launch."""
    seen: list[np.ndarray] = []
    real = tc.launch

    def spy(table, device, **kw):
        seen.append(table.copy())
        real(table, device, **kw)

    monkeypatch.setattr(tc, "launch", spy)
    return seen


def _expected_chunks(row_bytes: list[int], n_pairs: int, chunk: int) -> int:
    return n_pairs * sum(-(-rb // chunk) for rb in row_bytes if rb)


def test_one_launch_for_all_tensors_and_pairs(launches):
    arena = make_arena(mixed_specs(), 8)
    views = arena.views(arena.random_buffer(20))
    copied = copy_states([(0, 4), (1, 5), (2, 6)], views, backend="triton", chunk_bytes=128)
    assert len(launches) == 1
    table = launches[0]
    assert int(table[:, 2].sum()) == copied and (table[:, 2] <= 128).all()
    # adjacent rows of a slot were merged, so fewer chunks than one per (tensor, pair, 128 B)
    assert table.shape[0] < _expected_chunks([s.row_bytes for s in arena.specs], 3, 128)
    staging = allocate_staging(views, 3)
    gather_to_host([0, 1, 2], views, staging, backend="triton", chunk_bytes=128)
    assert len(launches) == 2
    copy_states([], views, backend="triton")
    copy_states([(3, 3)], views, backend="triton")
    assert len(launches) == 2  # nothing to copy: no launch


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 700)), max_size=6),
    st.sampled_from([16, 48, 64, 256]),
)
def test_chunk_table_covers_every_segment_once(segs, chunk):
    from hybridcache.kernels import triton_copy as tc

    src = np.array([s for s, _ in segs], np.int64)
    nb = np.array([n for _, n in segs], np.int64)
    dst = src + (1 << 24)
    z = np.zeros(len(segs), np.int64)
    table = tc.chunk_table(Segments(src, dst, nb, z, z), chunk)
    assert (table[:, 2] > 0).all() and (table[:, 2] <= chunk).all()
    assert (table[:, 1] - table[:, 0] == 1 << 24).all()
    covered = sorted((int(a), int(a + n)) for a, _, n in table)
    want = []
    for s, n in segs:
        want += [(s + k, min(s + k + chunk, s + n)) for k in range(0, n, chunk)]
    assert covered == sorted(want)


def test_default_chunk_size_adapts_to_the_plan(tc):
    one_snapshot = 20 * (2 * 2**20 + 73728)
    assert tc.default_chunk_bytes(64 * one_snapshot) == tc.MAX_CHUNK_BYTES
    small = tc.default_chunk_bytes(one_snapshot)
    assert tc.MIN_CHUNK_BYTES <= small < tc.MAX_CHUNK_BYTES and small & (small - 1) == 0
    assert one_snapshot // small >= tc.TARGET_PROGRAMS
    assert tc.default_chunk_bytes(100) == tc.MIN_CHUNK_BYTES


def test_chunk_size_must_be_multiple_of_16(tc):
    z = np.zeros(1, np.int64)
    with pytest.raises(ValueError, match="multiple of 16"):
        tc.chunk_table(Segments(z, z, z + 1, z, z), 24)


@pytest.mark.parametrize(
    ("src_off", "dst_off", "nbytes"),
    [
        (0, 0, 16),  # one aligned vector group
        (0, 32, 203),  # aligned body, several word blocks, byte tail
        (5, 37, 150),  # same misalignment: byte head, word body, byte tail
        (3, 40, 77),  # different misalignment: all bytes
        (7, 100, 1),  # a single byte
        (16, 64, 8),  # aligned but shorter than one vector group: bytes only
    ],
)
def test_kernel_alignment_paths(tc, src_off, dst_off, nbytes):
    """Drive the kernel directly with tiny blocks so every loop runs several times."""
    gen = torch.Generator().manual_seed(nbytes)
    src = torch.randint(0, 256, (512,), dtype=torch.uint8, generator=gen)
    dst = torch.full((512,), POISON, dtype=torch.uint8)
    base_s, base_d = src.data_ptr(), dst.data_ptr()
    assert base_s % 16 == 0 and base_d % 16 == 0
    one = np.ones(1, np.int64)
    segs = Segments(
        one * (base_s + src_off), one * (base_d + dst_off), one * nbytes, one * 0, one * 0
    )
    tc.copy_segments_triton(segs, torch.device("cpu"), chunk_bytes=64, word_block=4, byte_block=8)
    expected = torch.full((512,), POISON, dtype=torch.uint8)
    expected[dst_off : dst_off + nbytes] = src[src_off : src_off + nbytes]
    assert torch.equal(dst, expected)


def _random_plan(rng: np.random.Generator, num_slots: int, n: int) -> list[tuple[int, int]]:
    """Sources from the first half, distinct destinations from the second half."""
    src = rng.integers(0, num_slots // 2, n)
    dst = rng.choice(np.arange(num_slots // 2, num_slots), n, replace=False)
    return list(zip(src.tolist(), dst.tolist()))


@pytest.mark.parametrize("seed", [0, 1])
def test_triton_equals_torch_on_random_plans(seed):
    specs = mixed_specs() + [TensorSpec(torch.float32, (3000,))]  # > one 8 KiB word block
    arena = make_arena(specs, 10, pad=24, base=16 * seed)
    pairs = _random_plan(np.random.default_rng(seed), 10, 4)
    outs = []
    for backend, kw in (("torch", {}), ("triton", {}), ("triton", {"chunk_bytes": 4096})):
        buf = arena.random_buffer(seed)
        views = arena.views(buf)
        poison_rows(views, [d for _, d in pairs])
        copy_states(pairs, views, backend=backend, **kw)
        outs.append(buf)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    # and the copy really happened (the poison is gone from every destination)
    views = arena.views(outs[1])
    for t in views:
        for s, d in pairs:
            assert torch.equal(
                t[d].reshape(-1).view(torch.uint8), t[s].reshape(-1).view(torch.uint8)
            )


def test_triton_partial_pages_equal_torch():
    arena = make_arena([TensorSpec(torch.bfloat16, (16, 72)), TensorSpec(torch.int8, (16, 9))], 6)
    pairs, counts = [(0, 3), (1, 4), (2, 5)], [5, 16, 1]
    outs = []
    for backend in ("torch", "triton"):
        buf = arena.random_buffer(30)
        poison_rows(arena.views(buf), [3, 4, 5])
        copy_kv_pages(pairs, arena.views(buf), num_tokens=counts, backend=backend, chunk_bytes=512)
        outs.append(buf)
    assert torch.equal(outs[0], outs[1])


def test_interpreter_refuses_device_tensors(tc):
    assert tc.INTERPRETED
    reason = tc.unavailable_reason(torch.device("cuda"))
    assert reason is not None and "TRITON_INTERPRET" in reason
    assert tc.unavailable_reason(torch.device("cpu")) is None
