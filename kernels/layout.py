"""Row layout: how slot-indexed tensors map to byte ranges, and the byte-level overlap check.

Contract (why it is this loose): the library carves KV pages and state slots out of one
arena, so a state tensor is often a strided view ``[num_slots, ...]`` whose ``stride(0)`` is
a whole slot of the arena while one row (one slot of one tensor) is a contiguous run of
bytes. The kernels therefore copy *rows as bytes* and need only three numbers per tensor:
the address of row 0, the byte stride between rows and the row's byte length. dtype does
not matter, which is how one launch moves bf16 conv state and fp32 recurrent state together
and why copies are bit-exact (NaN payloads included).

Every copy, whatever the backend, is described as a list of :class:`RowCopyJob` (one per
tensor); :mod:`segments` flattens jobs into byte segments for the overlap check and the
copy itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .errors import LayoutError


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
