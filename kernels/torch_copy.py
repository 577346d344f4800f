"""Torch backend: the CPU path and the reference the Triton kernel is tested against.

First, segments that continue each other in memory on both sides are merged into runs: in
a slot-major arena one snapshot (every layer's rows of one slot) is one run. Then two
strategies, chosen per run by its length:

* a single row shorter than :data:`BATCH_MAX_ROW_BYTES`: batched with the other short rows
  of its tensor: one ``index_select`` of all source rows into a preallocated workspace,
  then one ``index_copy_`` into the destinations. Two calls per tensor instead of one per
  pair; it wins ~4x at 4 KiB rows where per-call overhead dominates.
* anything longer: one ``copy_`` per run. From ~64 KiB a copy is long enough that a loop is
  as fast as batching, and it skips the extra pass through the workspace.

Rows are reinterpreted as the widest integer type their alignment allows before batching
(``index_select`` on int64 words is 2-3x faster than on bytes on CPU). Everything copies
bytes, so the result is bit-identical to the Triton kernel whatever the dtype.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from .layout import RowCopyJob, widest_view
from .segments import Segments, merge_adjacent, storage_address, storage_bytes

BATCH_MAX_ROW_BYTES = 64 * 1024
"""Rows with fewer bytes than this are batched; see the module docstring and docs/kernels.md."""

_local = threading.local()


def workspace(device: torch.device, nbytes: int) -> torch.Tensor:
    """A per-thread, per-device uint8 scratch buffer of at least ``nbytes``, reused across calls.

    Why: on CPU a fresh multi-MiB allocation page-faults on first touch, which costs as much
    as the copy itself. The buffer only grows. On CUDA the caching allocator would do, but
    one code path is simpler; stream order keeps reuse safe.
    """
    buffers: dict[torch.device, torch.Tensor] = getattr(_local, "buffers", None) or {}
    _local.buffers = buffers
    buf = buffers.get(device)
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8, device=device)
        buffers[device] = buf
    return buf[:nbytes]


def _to_index(idx: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64)).to(device)


def _copy_batched(
    src: torch.Tensor, src_idx: np.ndarray, dst: torch.Tensor, dst_idx: np.ndarray
) -> None:
    """Gather source rows into the workspace, then scatter them; works across devices."""
    n, width = len(src_idx), src.shape[1]
    elem = src.element_size()
    buf = workspace(src.device, n * width * elem).view(src.dtype).view(n, width)
    torch.index_select(src, 0, _to_index(src_idx, src.device), out=buf)
    if dst.device != src.device:
        buf = buf.to(dst.device)
    dst.index_copy_(0, _to_index(dst_idx, dst.device), buf)


def _copy_loop(
    src: torch.Tensor, src_idx: np.ndarray, dst: torch.Tensor, dst_idx: np.ndarray
) -> None:
    """One ``copy_`` per pair; asynchronous for device<->pinned-host moves on CUDA."""
    for s, d in zip(src_idx.tolist(), dst_idx.tolist()):
        dst[d].copy_(src[s], non_blocking=True)


def _same_width_views(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Widen both uint8 views to one common integer dtype."""
    ws, wd = widest_view(src), widest_view(dst)
    if ws.element_size() == wd.element_size():
        return ws, wd
    size = min(ws.element_size(), wd.element_size())
    dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    return src.view(dtype), dst.view(dtype)


def _copy_job_batched(job: RowCopyJob, pairs: np.ndarray) -> None:
    """Batched copy of the listed pairs of one job, grouped by byte count (partial pages)."""
    nbytes = job.nbytes[pairs]
    for nb in np.unique(nbytes).tolist():
        sel = pairs[nbytes == nb]
        src, dst = _same_width_views(job.src_rows[:, :nb], job.dst_rows[:, :nb])
        if len(sel) > 1:
            _copy_batched(src, job.src_idx[sel], dst, job.dst_idx[sel])
        else:
            _copy_loop(src, job.src_idx[sel], dst, job.dst_idx[sel])


def _copy_runs(jobs: Sequence[RowCopyJob], runs: Segments, which: np.ndarray) -> None:
    """One ``copy_`` per listed run, through byte views of the storages the runs live in."""
    if which.size == 0:
        return
    bases: dict[int, torch.Tensor] = {}
    for job in jobs:
        for rows in (job.src_rows, job.dst_rows):
            key = storage_address(rows)
            if key not in bases:
                bases[key] = storage_bytes(rows)
    assert runs.src_store is not None and runs.dst_store is not None
    for k in which.tolist():
        s_base, d_base = int(runs.src_store[k]), int(runs.dst_store[k])
        so, do, n = int(runs.src[k]) - s_base, int(runs.dst[k]) - d_base, int(runs.nbytes[k])
        bases[d_base][do : do + n].copy_(bases[s_base][so : so + n], non_blocking=True)


def copy_torch(
    jobs: Sequence[RowCopyJob], segs: Segments, batch_max_row_bytes: int | None = None
) -> None:
    """Execute validated jobs (``segs`` = their segments) with the torch strategies.

    Adjacent segments are merged into runs first (:func:`merge_adjacent`). A run that is a
    single row shorter than ``batch_max_row_bytes`` (default :data:`BATCH_MAX_ROW_BYTES`,
    read at call time so benchmarks and tests can move it) is batched with the other such
    rows of its tensor; every other run is one ``copy_``.
    """
    if len(segs) == 0:
        return
    threshold = BATCH_MAX_ROW_BYTES if batch_max_row_bytes is None else batch_max_row_bytes
    runs, counts = merge_adjacent(segs)
    small = (counts == 1) & (runs.nbytes < threshold)
    for j in np.unique(runs.job[small]).tolist():
        _copy_job_batched(jobs[j], np.sort(runs.pair[small & (runs.job == j)]))
    _copy_runs(jobs, runs, np.flatnonzero(~small))
