"""Row layout: how slot-indexed tensors map to byte ranges, and the byte-level overlap check.

Contract (why it is this loose): the library carves KV pages and state slots out of one
arena, so a state tensor is often a strided view ``[num_slots, ...]`` whose ``stride(0)`` is
a whole slot of the arena while one row (one slot of one tensor) is a contiguous run of
bytes. The kernels therefore copy *rows as bytes* and need only three numbers per tensor:
the address of row 0, the byte stride between rows and the row's byte length. dtype does
not matter, which is how one launch moves bf16 conv state and fp32 recurrent state together
and why copies are bit-exact (NaN payloads included).

Every copy, whatever the backend, is described first as a list of :class:`RowCopyJob` and
then as flat arrays of byte segments (:class:`Segments`). The segments feed the Triton
kernel's address table and the overlap check, so both backends reject the same plans.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .errors import LayoutError, PlanError


def byte_rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """Return a ``uint8`` view ``[num_slots, row_bytes]`` of ``t`` sharing its memory.

    Raises :class:`LayoutError` unless ``t`` has a leading slot dimension, each row is
    contiguous, and rows do not overlap each other (``stride(0) >= row numel``).
    """
    if not isinstance(t, torch.Tensor):
        raise LayoutError(f"{name} is a {type(t).__name__}, expected a torch.Tensor")
    if t.dim() < 1:
        raise LayoutError(f"{name} is 0-dimensional; expected [num_slots, ...]")
    if t.is_conj() or t.is_neg():
        raise LayoutError(f"{name} has a lazy conj/neg bit; resolve it first")
    num_slots = t.shape[0]
    row_numel = int(np.prod(t.shape[1:], dtype=np.int64)) if t.dim() > 1 else 1
    if num_slots > 0 and row_numel > 0 and not t.select(0, 0).is_contiguous():
        raise LayoutError(
            f"{name} rows are not contiguous (shape {tuple(t.shape)}, strides {t.stride()}); "
            "each slot must be one contiguous run of bytes"
        )
    if num_slots > 1 and row_numel > 0 and t.stride(0) < row_numel:
        raise LayoutError(
            f"{name} rows overlap: stride(0) = {t.stride(0)} elements < row size {row_numel}"
        )
    stride0 = t.stride(0) if num_slots > 1 else row_numel
    rows = torch.as_strided(t, (num_slots, row_numel), (stride0, 1))
    return rows.view(torch.uint8)


def widest_view(rows: torch.Tensor) -> torch.Tensor:
    """Reinterpret a uint8 row view with the widest integer dtype its alignment allows.

    The torch path runs ``index_select`` on these rows; on CPU it is ~2-3x faster on int64
    words than on bytes (measured, see docs/kernels.md), so callers widen first.
    """
    width = rows.shape[1]
    stride0 = rows.stride(0)
    offset = rows.storage_offset()
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if width % size == 0 and stride0 % size == 0 and offset % size == 0:
            return rows.view(dtype)
    return rows


@dataclass(frozen=True)
class RowCopyJob:
    """Copy ``nbytes[i]`` leading bytes of ``src_rows[src_idx[i]]`` to ``dst_rows[dst_idx[i]]``.

    ``src_rows`` and ``dst_rows`` are uint8 views from :func:`byte_rows` (the same view for
    an in-place slot copy, a tensor and a staging buffer for host moves). ``label`` names the
    tensor in error messages.
    """

    src_rows: torch.Tensor
    dst_rows: torch.Tensor
    src_idx: np.ndarray
    dst_idx: np.ndarray
    nbytes: np.ndarray
    label: str


@dataclass(frozen=True)
class Segments:
    """Flat byte segments of a list of jobs: ``nbytes[k]`` bytes from ``src[k]`` to ``dst[k]``.

    ``job`` and ``pair`` point back to the job and the pair inside it, for error messages.
    Zero-byte copies are left out.
    """

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    job: np.ndarray
    pair: np.ndarray

    def __len__(self) -> int:
        return int(self.src.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())


def _row_addresses(rows: torch.Tensor, idx: np.ndarray) -> np.ndarray:
    """Byte address of each listed row of a uint8 row view."""
    return np.int64(rows.data_ptr()) + idx * np.int64(rows.stride(0))


def build_segments(jobs: Sequence[RowCopyJob]) -> Segments:
    """Concatenate the byte segments of every job (zero-byte copies dropped)."""
    parts: list[tuple[np.ndarray, ...]] = []
    for j, job in enumerate(jobs):
        keep = np.flatnonzero(job.nbytes > 0)
        if keep.size == 0:
            continue
        parts.append(
            (
                _row_addresses(job.src_rows, job.src_idx[keep]),
                _row_addresses(job.dst_rows, job.dst_idx[keep]),
                job.nbytes[keep],
                np.full(keep.size, j, np.int64),
                keep.astype(np.int64),
            )
        )
    if not parts:
        empty = np.zeros(0, np.int64)
        return Segments(empty, empty, empty, empty, empty)
    return Segments(*(np.concatenate(cols) for cols in zip(*parts)))


def _describe(segs: Segments, jobs: Sequence[RowCopyJob], k: int, role: str) -> str:
    job = jobs[int(segs.job[k])]
    p = int(segs.pair[k])
    slot = job.src_idx[p] if role == "source" else job.dst_idx[p]
    return f"{job.label} {role} row {int(slot)} (pair {int(segs.pair[k])})"


def check_disjoint(segs: Segments, jobs: Sequence[RowCopyJob]) -> None:
    """Raise :class:`PlanError` if two destinations, or a destination and a source, share bytes.

    This is the byte-level twin of the slot rules in :mod:`plan`: it also catches aliasing
    between *different* tensors (two views of the same arena bytes, the same tensor passed
    twice, a staging buffer that overlaps the arena). Runs in O(n log n) with numpy.
    """
    n = len(segs)
    if n == 0:
        return
    d_order = np.argsort(segs.dst, kind="stable")
    d_start = segs.dst[d_order]
    d_end = d_start + segs.nbytes[d_order]
    if n > 1:
        run_end = np.maximum.accumulate(d_end)
        bad = np.flatnonzero(d_start[1:] < run_end[:-1])
        if bad.size:
            b = int(d_order[bad[0] + 1])
            a = int(d_order[np.flatnonzero(d_end[: bad[0] + 1] > d_start[bad[0] + 1])[0]])
            raise PlanError(
                "destinations overlap: "
                f"{_describe(segs, jobs, a, 'destination')} and "
                f"{_describe(segs, jobs, b, 'destination')} share bytes"
            )
    s_order = np.argsort(segs.src, kind="stable")
    s_start = segs.src[s_order]
    s_run_end = np.maximum.accumulate(s_start + segs.nbytes[s_order])
    last = np.searchsorted(s_start, segs.dst + segs.nbytes, side="left") - 1
    hit = (last >= 0) & (s_run_end[np.maximum(last, 0)] > segs.dst)
    if hit.any():
        k = int(np.flatnonzero(hit)[0])
        lo, hi = segs.dst[k], segs.dst[k] + segs.nbytes[k]
        m = int(np.flatnonzero((segs.src < hi) & (segs.src + segs.nbytes > lo))[0])
        raise PlanError(
            f"{_describe(segs, jobs, k, 'destination')} overlaps "
            f"{_describe(segs, jobs, m, 'source')}; copies run concurrently"
        )


def common_device(tensors: Sequence[torch.Tensor], what: str) -> torch.device:
    """The one device all ``tensors`` live on; :class:`LayoutError` if they disagree."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise LayoutError(f"{what} live on several devices ({names}); one call needs one device")
    return devices.pop()


def check_tensor_list(tensors: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
    """Reject a bare tensor (iterating it would silently iterate rows) and return a list."""
    if isinstance(tensors, torch.Tensor):
        raise LayoutError(f"{what} must be a list of tensors, not a single tensor")
    return list(tensors)
