"""Slot-to-slot copies on one device: recurrent-state snapshots and KV pages.

``copy_states`` is what copy-on-extend runs: the manager hands out a private running slot
and asks for the cached snapshot to be copied into it, for every state tensor of every
layer. ``copy_kv_pages`` is the page-level copy-on-write for KV, optionally only the first
``n`` tokens of a page (the shared part of a partially filled last page).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .dispatch import Backend, check_backend_name, run_jobs
from .errors import PlanError
from .layout import RowCopyJob, byte_rows, check_tensor_list, common_device
from .plan import CopyPairs, PlanLike, check_range, normalize_plan, validate_same_space


def _prepare(
    plan: PlanLike, tensors: Sequence[torch.Tensor], what: str, unit: str
) -> tuple[CopyPairs, np.ndarray, list[torch.Tensor], torch.device | None]:
    """Validate layout and plan; returns kept pairs, keep mask, byte-row views and device."""
    tensors = check_tensor_list(tensors, what)
    pairs = normalize_plan(plan)
    rows = [byte_rows(t, f"{what}[{j}]") for j, t in enumerate(tensors)]
    for j, r in enumerate(rows):
        owner = f"{what}[{j}] ({unit})"
        check_range(pairs.src, r.shape[0], "source", owner)
        check_range(pairs.dst, r.shape[0], "destination", owner)
    kept, keep = validate_same_space(pairs)
    device = common_device(tensors, what) if tensors else None
    return kept, keep, rows, device


def copy_states(
    plan: PlanLike,
    tensors: Sequence[torch.Tensor],
    *,
    backend: Backend = "auto",
    chunk_bytes: int | None = None,
) -> int:
    """Copy slot ``src[i]`` to slot ``dst[i]`` in every tensor, for every pair of ``plan``.

    ``tensors`` are ``[num_slots, ...]`` tensors (each row contiguous, any dtype, may be
    strided views over one arena); every plan index must be valid for every tensor. On CUDA
    with Triton the whole plan is one kernel launch. A pair with ``src == dst`` is a no-op;
    plans whose destinations repeat or are also sources raise :class:`PlanError`. Returns
    the bytes copied (0 for an empty plan). ``chunk_bytes`` tunes the Triton split size.
    """
    check_backend_name(backend)
    pairs, _, rows, device = _prepare(plan, tensors, "tensors", "slots")
    if device is None:
        return 0
    jobs = [
        RowCopyJob(
            r, r, pairs.src, pairs.dst, np.full(len(pairs), r.shape[1], np.int64), f"tensors[{j}]"
        )
        for j, r in enumerate(rows)
    ]
    return run_jobs(jobs, device, backend, chunk_bytes=chunk_bytes)


def _token_counts(
    num_tokens: int | Sequence[int] | np.ndarray | None, n_pairs: int
) -> np.ndarray | None:
    """Per-pair token counts as int64, or None for whole pages."""
    if num_tokens is None:
        return None
    if isinstance(num_tokens, (int, np.integer)) and not isinstance(num_tokens, bool):
        counts = np.full(n_pairs, int(num_tokens), np.int64)
    else:
        counts = np.asarray(num_tokens)
        if counts.dtype.kind not in "iu" and counts.size:
            raise PlanError(f"num_tokens must hold integers, got dtype {counts.dtype}")
        counts = counts.astype(np.int64).reshape(-1)
        if counts.shape[0] != n_pairs:
            raise PlanError(f"num_tokens has {counts.shape[0]} entries for {n_pairs} pairs")
    if (counts < 0).any():
        raise PlanError(f"num_tokens must be >= 0, got {int(counts.min())}")
    return counts


def copy_kv_pages(
    plan: PlanLike,
    kv_tensors: Sequence[torch.Tensor],
    *,
    num_tokens: int | Sequence[int] | np.ndarray | None = None,
    backend: Backend = "auto",
    chunk_bytes: int | None = None,
) -> int:
    """Copy page ``src[i]`` to page ``dst[i]`` in every KV tensor ``[num_pages, page_size, ...]``.

    ``num_tokens`` (an int for all pairs, or one per pair) limits each copy to the first
    ``n`` tokens of the page, i.e. the first ``n * token_bytes`` bytes of the row, where
    dimension 1 is the token dimension. ``None`` copies whole pages (then tensors may have
    any shape ``[num_pages, ...]``). Same plan rules and return value as :func:`copy_states`.
    """
    check_backend_name(backend)
    tensors = check_tensor_list(kv_tensors, "kv_tensors")
    pairs, keep, rows, device = _prepare(plan, tensors, "kv_tensors", "pages")
    counts = _token_counts(num_tokens, len(keep))
    if counts is not None:
        for j, t in enumerate(tensors):
            if t.dim() < 2:
                raise PlanError(
                    f"kv_tensors[{j}] has no token dimension; num_tokens needs "
                    "[num_pages, page_size, ...]"
                )
            if counts.size and int(counts.max()) > t.shape[1]:
                raise PlanError(
                    f"num_tokens {int(counts.max())} exceeds the page size "
                    f"{t.shape[1]} of kv_tensors[{j}]"
                )
        counts = counts[keep]
    if device is None:
        return 0
    jobs = []
    for j, (t, r) in enumerate(zip(tensors, rows)):
        if counts is None:
            nbytes = np.full(len(pairs), r.shape[1], np.int64)
        else:
            nbytes = counts * (r.shape[1] // t.shape[1] if t.shape[1] else 0)
        jobs.append(RowCopyJob(r, r, pairs.src, pairs.dst, nbytes, f"kv_tensors[{j}]"))
    return run_jobs(jobs, device, backend, chunk_bytes=chunk_bytes)
