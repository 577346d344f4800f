"""Bulk moves between device slots and one host staging buffer (the offload tier's path).

A gather copies listed slots of every tensor into staging entries; a scatter copies entries
back into slots. The entry layout is defined in :mod:`staging`. Plans:

* a 1-D list of slots: slot ``slots[k]`` <-> entry ``k``;
* a pair plan (object with ``.src``/``.dst``, pairs, or ``(n, 2)`` array): for a gather
  ``src`` are device slots and ``dst`` staging entries, for a scatter the reverse.

Destinations must be distinct (two copies may not write the same slot or entry); sources
may repeat. On CUDA, ``auto`` uses the Triton kernel when the staging buffer is pinned (the
kernel reads and writes pinned host memory directly over the bus, one launch for all
tensors), else per-row torch copies. ``synchronize=True`` (default) waits for the copy, so
the staging bytes are ready to read (gather) or free to reuse (scatter) on return.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .dispatch import Backend, check_backend_name, run_jobs
from .layout import RowCopyJob, byte_rows, check_tensor_list, common_device
from .plan import PlanLike, SlotsLike, check_range, check_unique_destinations, normalize_transfer
from .staging import staging_entry_rows, staging_layout


def _transfer(
    plan: PlanLike | SlotsLike,
    tensors: Sequence[torch.Tensor],
    staging: torch.Tensor,
    *,
    to_host: bool,
    backend: str,
    synchronize: bool,
    chunk_bytes: int | None,
) -> int:
    """Shared body of gather and scatter: validate, build one job per tensor, run."""
    check_backend_name(backend)
    tensors = check_tensor_list(tensors, "tensors")
    layout = staging_layout(tensors)
    entry_rows = staging_entry_rows(layout, staging)
    capacity = layout.capacity(staging)
    pairs = normalize_transfer(plan, to_host=to_host)
    slots, entries = (pairs.src, pairs.dst) if to_host else (pairs.dst, pairs.src)
    slot_role, entry_role = ("source", "destination") if to_host else ("destination", "source")
    check_range(entries, capacity, f"staging {entry_role}", "the staging buffer (entries)")
    rows = [byte_rows(t, f"tensors[{j}]") for j, t in enumerate(tensors)]
    for j, r in enumerate(rows):
        check_range(slots, r.shape[0], slot_role, f"tensors[{j}] (slots)")
    check_unique_destinations(pairs)
    if not tensors or len(pairs) == 0:
        return 0
    device = common_device(tensors, "tensors")
    jobs = []
    for j, (r, e) in enumerate(zip(rows, entry_rows)):
        src_rows, dst_rows = (r, e) if to_host else (e, r)
        nbytes = np.full(len(pairs), r.shape[1], np.int64)
        jobs.append(RowCopyJob(src_rows, dst_rows, pairs.src, pairs.dst, nbytes, f"tensors[{j}]"))
    copied = run_jobs(jobs, device, backend, host=staging, chunk_bytes=chunk_bytes)
    if synchronize and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return copied


def gather_to_host(
    plan: PlanLike | SlotsLike,
    tensors: Sequence[torch.Tensor],
    staging: torch.Tensor,
    *,
    backend: Backend = "auto",
    synchronize: bool = True,
    chunk_bytes: int | None = None,
) -> int:
    """Copy device slots of every tensor into staging entries; returns the bytes copied.

    ``staging`` is a host uint8 buffer from :func:`allocate_staging` (or any contiguous uint8
    host tensor of at least ``entries * entry_bytes``); see :mod:`staging` for the layout.
    """
    return _transfer(
        plan,
        tensors,
        staging,
        to_host=True,
        backend=backend,
        synchronize=synchronize,
        chunk_bytes=chunk_bytes,
    )


def scatter_from_host(
    plan: PlanLike | SlotsLike,
    tensors: Sequence[torch.Tensor],
    staging: torch.Tensor,
    *,
    backend: Backend = "auto",
    synchronize: bool = True,
    chunk_bytes: int | None = None,
) -> int:
    """Copy staging entries back into device slots of every tensor; returns the bytes copied.

    The inverse of :func:`gather_to_host` with the same tensor list (or one with equal row
    byte sizes, in the same order).
    """
    return _transfer(
        plan,
        tensors,
        staging,
        to_host=False,
        backend=backend,
        synchronize=synchronize,
        chunk_bytes=chunk_bytes,
    )
