"""Byte segments: the flat form of a copy that both backends execute and validate.

A segment is ``nbytes`` bytes from address ``src`` to address ``dst``; one per (tensor, pair).
The Triton kernel's address table and the overlap check both read segments, so both
backends reject exactly the same plans. Segments also remember which storage (allocation)
each address lies in, so adjacent segments can be merged into one run and the torch path
can still address a run through a view of that storage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .errors import PlanError
from .layout import RowCopyJob


@dataclass(frozen=True)
class Segments:
    """Flat byte segments of a list of jobs: ``nbytes[k]`` bytes from ``src[k]`` to ``dst[k]``.

    ``job`` and ``pair`` point back to the job and the pair inside it (for error messages
    and the torch path's batching); ``src_store``/``dst_store`` are the base addresses of
    the storages the bytes live in (0 when unknown). Zero-byte copies are left out.
    """

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    job: np.ndarray
    pair: np.ndarray
    src_store: np.ndarray | None = None
    dst_store: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.src.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())


def storage_address(rows: torch.Tensor) -> int:
    """Base address of the allocation behind ``rows`` (the key for :func:`storage_bytes`)."""
    return int(rows.untyped_storage().data_ptr())


def storage_bytes(rows: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of the whole allocation behind ``rows``, starting at its base."""
    return torch.empty(0, dtype=torch.uint8, device=rows.device).set_(rows.untyped_storage())


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
                np.full(keep.size, storage_address(job.src_rows), np.int64),
                np.full(keep.size, storage_address(job.dst_rows), np.int64),
            )
        )
    if not parts:
        empty = np.zeros(0, np.int64)
        return Segments(empty, empty, empty, empty, empty, empty, empty)
    return Segments(*(np.concatenate(cols) for cols in zip(*parts)))


def merge_adjacent(segs: Segments) -> tuple[Segments, np.ndarray]:
    """Merge segments that continue each other in both source and destination memory.

    Why: in a slot-major arena the rows of one slot (all layers' state tensors) lie back to
    back, and so do a staging entry's rows, so a whole snapshot copy collapses from one
    segment per tensor into one run. Segments are ordered by destination (destinations are
    disjoint once :func:`check_disjoint` passed), so fan-out plans merge too. A run never
    crosses storages. Returns the runs (``job``/``pair`` of their first segment) and how
    many segments each run merged.
    """
    n = len(segs)
    if n == 0:
        return segs, np.zeros(0, np.int64)
    order = np.argsort(segs.dst, kind="stable")
    cols = {f: getattr(segs, f)[order] for f in ("src", "dst", "nbytes", "job", "pair")}
    stores = [
        np.zeros(n, np.int64) if a is None else a[order] for a in (segs.src_store, segs.dst_store)
    ]
    src, dst, nb = cols["src"], cols["dst"], cols["nbytes"]
    cont = (
        (src[1:] == src[:-1] + nb[:-1])
        & (dst[1:] == dst[:-1] + nb[:-1])
        & (stores[0][1:] == stores[0][:-1])
        & (stores[1][1:] == stores[1][:-1])
    )
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    counts = np.diff(np.append(starts, n))
    merged = Segments(
        src[starts],
        dst[starts],
        np.add.reduceat(nb, starts),
        cols["job"][starts],
        cols["pair"][starts],
        stores[0][starts],
        stores[1][starts],
    )
    return merged, counts


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
