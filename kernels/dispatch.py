"""Backend choice and execution of validated copy jobs.

``auto`` picks the Triton kernel for CUDA tensors when Triton is importable (one launch for
the whole plan), and the torch path otherwise (CPU). Both backends copy bytes, so results
are bit-identical; forcing one lets tests compare them and lets a benchmark time both.
The Triton module is imported lazily: importing triton is slow, and its ``jit`` decides at
import time whether the kernel is compiled or interpreted (``TRITON_INTERPRET``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import ModuleType
from typing import Literal

import torch

from .errors import BackendError
from .layout import RowCopyJob
from .segments import build_segments, check_disjoint, merge_adjacent
from .torch_copy import copy_torch

Backend = Literal["auto", "torch", "triton"]
BACKENDS = ("auto", "torch", "triton")


@functools.cache
def triton_module() -> ModuleType | None:
    """The Triton backend module, or None when triton is not installed or not importable."""
    try:
        from . import triton_copy
    except ImportError:
        return None
    return triton_copy


def check_backend_name(backend: str) -> None:
    """Raise :class:`BackendError` unless ``backend`` is one of :data:`BACKENDS`."""
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def resolve_backend(
    backend: str, device: torch.device, host: torch.Tensor | None = None
) -> Literal["torch", "triton"]:
    """Map ``backend`` to the backend that will run, or raise :class:`BackendError`.

    ``host`` is the staging buffer of a gather/scatter: on CUDA the kernel addresses it
    directly, which needs pinned memory, so ``auto`` falls back to torch for pageable
    staging and a forced ``triton`` is refused.
    """
    check_backend_name(backend)
    if backend == "torch":
        return "torch"
    tc = triton_module()
    if backend == "auto":
        ok = device.type == "cuda" and tc is not None and tc.unavailable_reason(device) is None
        if ok and host is not None and not host.is_pinned():
            ok = False
        return "triton" if ok else "torch"
    if tc is None:
        raise BackendError("backend 'triton' requested but triton is not importable")
    reason = tc.unavailable_reason(device)
    if reason is not None:
        raise BackendError(f"backend 'triton' cannot run: {reason}")
    if device.type == "cuda" and host is not None and not host.is_pinned():
        raise BackendError(
            "backend 'triton' needs pinned staging memory on CUDA (allocate_staging pins it)"
        )
    return "triton"


def run_jobs(
    jobs: Sequence[RowCopyJob],
    device: torch.device,
    backend: str,
    host: torch.Tensor | None = None,
    *,
    chunk_bytes: int | None = None,
) -> int:
    """Check byte-level disjointness, then copy every job with the chosen backend.

    Returns the number of bytes copied. All checks run before any byte moves.
    """
    chosen = resolve_backend(backend, device, host)
    segs = build_segments(jobs)
    check_disjoint(segs, jobs)
    if len(segs) == 0:
        return 0
    if chosen == "triton":
        tc = triton_module()
        assert tc is not None
        kwargs = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
        tc.copy_segments_triton(merge_adjacent(segs)[0], device, **kwargs)
    else:
        copy_torch(jobs, segs)
    return segs.total_bytes
