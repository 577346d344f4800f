"""Host staging buffer for the offload tier: layout, allocation and typed views.

Layout (why): the offload tier moves whole snapshots (one slot of every state tensor), so a
staging *entry* holds one slot's rows of all tensors, in the order the tensors are listed,
each row starting on a :data:`STAGING_ALIGN`-byte boundary::

    entry e = staging[e * entry_bytes : (e + 1) * entry_bytes]
    tensor j's row = entry[offsets[j] : offsets[j] + row_bytes[j]]      (raw bytes of the row)

One entry is therefore a self-contained byte string a tier can checksum, store and restore;
64-byte alignment keeps every row on its own cache line and lets the Triton kernel use
16-byte accesses. The layout depends only on the tensors' row byte sizes and their order,
so gather and scatter must be called with the same tensor list (or one with equal row
sizes). The buffer is a 2-D uint8 tensor ``[num_entries, entry_bytes]`` on the host,
pinned when the tensors are on CUDA so device copies can run asynchronously and the Triton
kernel can address it directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .errors import LayoutError
from .layout import byte_rows, check_tensor_list

STAGING_ALIGN = 64


def _align_up(n: int, a: int = STAGING_ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class StagingLayout:
    """Byte layout of one staging entry: per tensor, its row length and offset in the entry."""

    row_bytes: tuple[int, ...]
    offsets: tuple[int, ...]
    entry_bytes: int

    def nbytes(self, num_entries: int) -> int:
        """Bytes a staging buffer needs to hold ``num_entries`` entries."""
        return num_entries * self.entry_bytes

    def capacity(self, staging: torch.Tensor) -> int:
        """How many whole entries ``staging`` holds."""
        return staging.numel() // self.entry_bytes if self.entry_bytes else 0


def row_nbytes(t: torch.Tensor) -> int:
    """Bytes in one slot row of ``t`` (everything after the slot dimension)."""
    return int(np.prod(t.shape[1:], dtype=np.int64)) * t.element_size()


def staging_layout(tensors: Sequence[torch.Tensor]) -> StagingLayout:
    """The entry layout for ``tensors`` (see the module docstring)."""
    tensors = check_tensor_list(tensors, "tensors")
    offsets, pos = [], 0
    sizes = [row_nbytes(t) for t in tensors]
    for size in sizes:
        offsets.append(pos)
        pos = _align_up(pos + size)
    return StagingLayout(tuple(sizes), tuple(offsets), max(pos, STAGING_ALIGN))


def allocate_staging(
    tensors: Sequence[torch.Tensor] | StagingLayout, num_entries: int, *, pin: bool | None = None
) -> torch.Tensor:
    """Allocate a host staging buffer ``[num_entries, entry_bytes]`` (uint8, uninitialised).

    ``pin=None`` pins when CUDA is available and any tensor is on CUDA; pinning on a machine
    without CUDA is refused with :class:`LayoutError` because torch cannot pin there.
    """
    if num_entries < 0:
        raise LayoutError(f"num_entries must be >= 0, got {num_entries}")
    if isinstance(tensors, StagingLayout):
        layout, on_cuda = tensors, False
    else:
        tensors = check_tensor_list(tensors, "tensors")
        layout = staging_layout(tensors)
        on_cuda = any(t.device.type == "cuda" for t in tensors)
    if pin is None:
        pin = on_cuda and torch.cuda.is_available()
    if pin and not torch.cuda.is_available():
        raise LayoutError("cannot pin host memory: CUDA is not available in this process")
    return torch.empty((num_entries, layout.entry_bytes), dtype=torch.uint8, pin_memory=pin)


def staging_entry_rows(layout: StagingLayout, staging: torch.Tensor) -> list[torch.Tensor]:
    """Per tensor, a uint8 view ``[capacity, row_bytes]`` of its rows inside ``staging``."""
    if not isinstance(staging, torch.Tensor) or staging.dtype != torch.uint8:
        raise LayoutError("staging must be a uint8 torch.Tensor (see allocate_staging)")
    if staging.device.type != "cpu":
        raise LayoutError(f"staging must live in host memory, not on {staging.device}")
    if not staging.is_contiguous():
        raise LayoutError("staging must be contiguous")
    cap = layout.capacity(staging)
    entries = staging.reshape(-1)[: cap * layout.entry_bytes].view(cap, layout.entry_bytes)
    return [entries[:, off : off + rb] for off, rb in zip(layout.offsets, layout.row_bytes)]


def staging_views(staging: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Typed views into ``staging``: for tensor j, ``[capacity, *tensors[j].shape[1:]]``.

    Lets the tier (or a test) read an entry as the original dtypes without copying.
    """
    tensors = check_tensor_list(tensors, "tensors")
    layout = staging_layout(tensors)
    views = []
    for rows, t in zip(staging_entry_rows(layout, staging), tensors):
        byte_rows(t, "tensor")  # same layout checks as the copy functions
        views.append(rows.view(t.dtype).view(rows.shape[0], *t.shape[1:]))
    return views
