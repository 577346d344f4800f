"""Copy plans: one normaliser for every accepted form, and the safety rules they must obey.

The core manager hands the kernels plans in whatever shape is handy for it (an object with
``.src``/``.dst`` arrays, a list of pairs, an ``(n, 2)`` array). Everything downstream works
on one form only, :class:`CopyPairs`, so the rules below are written once.

Safety rules (why): the Triton kernel runs every copy of a plan at the same time, in any
order, so a plan is only well defined when no copy reads bytes another copy writes, and no
two copies write the same bytes. Within one slot space (state slot to state slot, page to
page) that means:

* every destination slot appears once;
* no destination slot of a real copy is the source of any pair;
* a pair whose source equals its destination is a no-op: it is accepted and dropped. It
  still counts as a write of that slot, so another pair may not also write it, but other
  pairs may read it (the value they read is the same either way).

A source may be copied to several destinations (fan-out), which a prefix cache needs when
several requests extend the same snapshot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from .errors import PlanError


class SrcDstPlan(Protocol):
    """Anything with equal-length integer sequences ``src`` and ``dst`` (slot indices)."""

    src: Any
    dst: Any


PlanLike = SrcDstPlan | Sequence[Sequence[int]] | np.ndarray | torch.Tensor
SlotsLike = Sequence[int] | np.ndarray | torch.Tensor


@dataclass(frozen=True)
class CopyPairs:
    """A plan in canonical form: two int64 arrays of equal length, pair ``i`` is src[i] -> dst[i]."""

    src: np.ndarray
    dst: np.ndarray

    def __len__(self) -> int:
        return int(self.src.shape[0])

    def pair_text(self, i: int) -> str:
        """Human-readable form of pair ``i`` for error messages."""
        return f"pair {i} ({int(self.src[i])} -> {int(self.dst[i])})"


def _as_index_array(value: Any, what: str) -> np.ndarray:
    """Turn a sequence, numpy array or tensor into an int64 numpy array; reject non-integers."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as exc:  # ragged nested sequences
        raise PlanError(f"{what} is not a rectangular array of integers: {exc}") from None
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise PlanError(f"{what} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.max() > np.iinfo(np.int64).max:
        raise PlanError(f"{what} holds an index larger than int64")
    return arr.astype(np.int64, copy=False)


def normalize_plan(plan: PlanLike) -> CopyPairs:
    """Return ``plan`` as :class:`CopyPairs`.

    Accepts an object with ``.src`` and ``.dst`` (equal-length 1-D integer sequences), a
    sequence of ``(src, dst)`` pairs, or an ``(n, 2)`` integer array or tensor. An empty
    sequence is an empty plan. Raises :class:`PlanError` for anything else.
    """
    if isinstance(plan, CopyPairs):
        return plan
    if hasattr(plan, "src") and hasattr(plan, "dst"):
        src = _as_index_array(plan.src, "plan.src")
        dst = _as_index_array(plan.dst, "plan.dst")
        if (src.ndim != 1 and src.size) or (dst.ndim != 1 and dst.size):
            raise PlanError("plan.src and plan.dst must be one-dimensional")
        src, dst = src.reshape(-1), dst.reshape(-1)
        if src.shape != dst.shape:
            raise PlanError(f"plan.src has {src.shape[0]} entries but plan.dst has {dst.shape[0]}")
        return CopyPairs(src, dst)
    arr = _as_index_array(plan, "plan")
    if arr.size == 0:
        return CopyPairs(np.zeros(0, np.int64), np.zeros(0, np.int64))
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise PlanError(f"plan must be (src, dst) pairs, an (n, 2) array; got shape {arr.shape}")
    return CopyPairs(np.ascontiguousarray(arr[:, 0]), np.ascontiguousarray(arr[:, 1]))


def normalize_transfer(plan: PlanLike | SlotsLike, *, to_host: bool) -> CopyPairs:
    """Normalise a gather/scatter plan into pairs of (source index, destination index).

    A one-dimensional list of device slots is shorthand for "slot ``slots[k]`` <-> staging
    entry ``k``". Anything else is a pair plan: for a gather (``to_host=True``) ``src`` is a
    device slot and ``dst`` a staging entry; for a scatter ``src`` is a staging entry and
    ``dst`` a device slot.
    """
    if not (hasattr(plan, "src") and hasattr(plan, "dst")) and not isinstance(plan, CopyPairs):
        arr = _as_index_array(plan, "slots")
        if arr.ndim == 1 and arr.size > 0:
            entries = np.arange(arr.shape[0], dtype=np.int64)
            return CopyPairs(arr, entries) if to_host else CopyPairs(entries, arr)
    return normalize_plan(plan)  # type: ignore[arg-type]


def check_range(indices: np.ndarray, limit: int, role: str, owner: str) -> None:
    """Raise :class:`PlanError` unless every index lies in ``[0, limit)``."""
    if indices.size == 0:
        return
    bad = np.flatnonzero((indices < 0) | (indices >= limit))
    if bad.size:
        i = int(bad[0])
        raise PlanError(
            f"{role} index {int(indices[i])} (pair {i}) is out of range for {owner}, "
            f"which has {limit} slots"
        )


def check_unique_destinations(pairs: CopyPairs) -> None:
    """Raise :class:`PlanError` if two pairs write the same destination."""
    if len(pairs) < 2:
        return
    order = np.argsort(pairs.dst, kind="stable")
    sorted_dst = pairs.dst[order]
    dup = np.flatnonzero(sorted_dst[1:] == sorted_dst[:-1])
    if dup.size:
        a, b = int(order[dup[0]]), int(order[dup[0] + 1])
        raise PlanError(
            f"plan destinations overlap: slot {int(pairs.dst[a])} is written by "
            f"{pairs.pair_text(a)} and {pairs.pair_text(b)}"
        )


def check_no_read_after_write(pairs: CopyPairs) -> None:
    """Raise :class:`PlanError` if a real copy writes a slot that some pair reads."""
    real = np.flatnonzero(pairs.src != pairs.dst)
    if real.size == 0:
        return
    if len(pairs) <= 256:  # typical plans: a set lookup is ~10x cheaper than np.isin
        sources = set(pairs.src.tolist())
        hit = np.array([d in sources for d in pairs.dst[real].tolist()], dtype=bool)
    else:
        hit = np.isin(pairs.dst[real], pairs.src)
    if hit.any():
        i = int(real[np.flatnonzero(hit)[0]])
        slot = int(pairs.dst[i])
        j = int(np.flatnonzero(pairs.src == slot)[0])
        raise PlanError(
            f"plan destination slot {slot} of {pairs.pair_text(i)} is also the source of "
            f"{pairs.pair_text(j)}; copies run concurrently, so split the plan in two"
        )


def validate_same_space(pairs: CopyPairs) -> tuple[CopyPairs, np.ndarray]:
    """Check a slot-to-slot plan against the module's rules and drop no-op pairs.

    Returns the pairs that really copy and the boolean mask that selected them from
    ``pairs`` (callers with per-pair data, such as partial-page token counts, apply it too).
    """
    check_unique_destinations(pairs)
    check_no_read_after_write(pairs)
    keep = pairs.src != pairs.dst
    if keep.all():
        return pairs, keep
    return CopyPairs(pairs.src[keep], pairs.dst[keep]), keep
