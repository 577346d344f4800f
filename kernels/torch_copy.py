"""Torch backend: the CPU path and the reference the Triton kernel is tested against.

Two strategies, chosen per tensor by the bytes copied per row:

* rows shorter than :data:`BATCH_MAX_ROW_BYTES`: one ``index_select`` of all source rows
  into a preallocated workspace, then one ``index_copy_`` into the destinations. Two calls
  per tensor instead of one per pair; it wins ~4x at 4 KiB rows where per-call overhead
  dominates.
* longer rows: one ``copy_`` per pair. From ~64 KiB a row copy is long enough that the loop
  is as fast as batching, and it skips the extra pass through the workspace.

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


def copy_job_torch(job: RowCopyJob, batch_max_row_bytes: int | None = None) -> None:
    """Execute one job; pairs are grouped by byte count so partial copies batch too.

    ``batch_max_row_bytes`` defaults to the module's :data:`BATCH_MAX_ROW_BYTES`, read at
    call time so a benchmark or test can move the threshold.
    """
    if len(job.src_idx) == 0:
        return
    if batch_max_row_bytes is None:
        batch_max_row_bytes = BATCH_MAX_ROW_BYTES
    for nb in np.unique(job.nbytes).tolist():
        if nb == 0:
            continue
        sel = np.flatnonzero(job.nbytes == nb)
        src, dst = _same_width_views(job.src_rows[:, :nb], job.dst_rows[:, :nb])
        src_idx, dst_idx = job.src_idx[sel], job.dst_idx[sel]
        if nb < batch_max_row_bytes and len(sel) > 1:
            _copy_batched(src, src_idx, dst, dst_idx)
        else:
            _copy_loop(src, src_idx, dst, dst_idx)


def copy_jobs_torch(jobs: Sequence[RowCopyJob], batch_max_row_bytes: int | None = None) -> None:
    """Execute every job with the torch strategies above (callers validated the plan)."""
    for job in jobs:
        copy_job_torch(job, batch_max_row_bytes)
