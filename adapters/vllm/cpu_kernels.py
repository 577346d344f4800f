"""CPU stand-ins for vLLM 0.32's fused Mamba ``align``-mode copy kernels, and a start-up fix.

With speculative decoding and prefix caching, vLLM's V1 worker moves recurrent states
between block columns with two Triton kernels (``vllm/v1/worker/mamba_utils.py``):

* ``precopy_mamba_align_fused_kernel`` before the forward pass: a request that enters a
  new block column gets the state of its previous column (the accepted token's state:
  column ``src_col + token_bias`` for temporal states, the history shifted by
  ``token_bias`` tokens for conv states);
* ``postprocess_mamba_fused_kernel`` after sampling: when the accepted tokens end past a
  block boundary, the state at the last boundary before them is copied into that
  boundary's column.

The CPU build has no override for either (it registers ``batch_memcpy_kernel`` and a few
others in ``CpuPlatform.register_triton_kernel_overrides``), so the engine dies at the
first step. The functions here do the same byte copies as the kernels' shared
``_copy_mamba_state_block`` body, reading the same flattened metadata (state base
addresses, block strides, element and inner sizes, conv widths, group indices, raw block
table pointers), with ``ctypes.memmove`` (overlap-safe, as the kernel's low-to-high
per-token loop is for a left shift).

Start-up fix: ``register_kernels`` rebinds kernel references across ``sys.modules`` and
calls ``vars(value).get`` on every attribute; llvmlite's ``_lib_fn_wrapper`` (loaded with
numba by the Kimi model modules) answers ``vars()`` with an object that has no ``get``,
so the platform's registration raises. :func:`tolerant_rebind` is the same scan with
unreadable values skipped.

:func:`install` wraps ``CpuPlatform.register_triton_kernel_overrides`` (called at worker
start) so that both apply there; only for the vLLM releases the adapter supports.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from typing import Any

logger = logging.getLogger("hybridcache.adapters.vllm")

MAMBA_UTILS = "vllm.v1.worker.mamba_utils"
FUSED_KERNELS = ("precopy_mamba_align_fused_kernel", "postprocess_mamba_fused_kernel")


def _i64(t: Any) -> list[int]:
    return [int(x) for x in t.tolist()]


class _StateLayout:
    """The kernels' flattened per-(layer, state) metadata, read once per launch."""

    def __init__(self, bt_ptrs, bt_stride, bases, strides, elems, inners, widths, groups,
                 rows, row_strides) -> None:
        self.bt_ptrs, self.bt_stride = _i64(bt_ptrs), int(bt_stride)
        self.bases, self.strides = _i64(bases), _i64(strides)
        self.elems, self.inners, self.widths = _i64(elems), _i64(inners), _i64(widths)
        self.groups, self.rows, self.row_strides = _i64(groups), _i64(rows), _i64(row_strides)

    def __len__(self) -> int:
        return len(self.bases)

    def block(self, state: int, req: int, col: int) -> int:
        """Block id in column ``col`` of ``req``'s row of the state's group block table."""
        addr = self.bt_ptrs[self.groups[state]] + 4 * (req * self.bt_stride + col)
        return ctypes.c_int32.from_address(addr).value

    def copy(self, state: int, req: int, src_col: int, dst_col: int, bias: int,
             dim_first: bool) -> None:
        """One ``_copy_mamba_state_block``: conv window shift or temporal column copy."""
        base, stride, elem = self.bases[state], self.strides[state], self.elems[state]
        width = self.widths[state]
        dst = base + self.block(state, req, dst_col) * stride
        if width <= 0:  # temporal state: the accepted column's block, whole
            src = base + self.block(state, req, src_col + bias) * stride
            ctypes.memmove(dst, src, self.inners[state] * elem)
            return
        src = base + self.block(state, req, src_col) * stride
        if not dim_first:  # (state_len, dim): tokens are contiguous rows
            token = self.inners[state] * elem
            ctypes.memmove(dst, src + bias * token, (width - bias) * token)
            return
        for row in range(self.rows[state]):  # (dim, state_len): shift each row
            r = row * self.row_strides[state]
            ctypes.memmove(dst + r, src + r + bias * elem, (width - bias) * elem)


def precopy_mamba_align_fused(
    mamba_state_idx, src_col, token_bias, *layout_and_rest: Any, **constexprs: Any
) -> None:
    """``precopy_mamba_align_fused_kernel`` (same positional arguments)."""
    layout = _StateLayout(*layout_and_rest[:10])
    idx_mapping, num_reqs = layout_and_rest[10], int(layout_and_rest[11])
    dim_first = bool(constexprs.get("CONV_STATE_DIM_FIRST", False))
    has_map = bool(constexprs.get("HAS_IDX_MAPPING", True)) and idx_mapping is not None
    mapping = _i64(idx_mapping) if has_map else None
    dst_cols, src_cols, biases = _i64(mamba_state_idx), _i64(src_col), _i64(token_bias)
    for b in range(num_reqs):
        req = mapping[b] if mapping is not None else b
        if req < 0 or src_cols[req] < 0 or src_cols[req] == dst_cols[req]:
            continue
        for s in range(len(layout)):
            layout.copy(s, req, src_cols[req], dst_cols[req], biases[req], dim_first)


def postprocess_mamba_fused(
    num_accepted, mamba_state_idx, num_scheduled, num_computed, num_draft,
    *layout_and_rest: Any, **constexprs: Any,
) -> None:
    """``postprocess_mamba_fused_kernel`` (same positional arguments)."""
    layout = _StateLayout(*layout_and_rest[:10])
    accepted_out, idx_mapping, num_reqs = layout_and_rest[10], layout_and_rest[11], int(layout_and_rest[12])
    block_size = int(constexprs["block_size"])
    dim_first = bool(constexprs.get("CONV_STATE_DIM_FIRST", False))
    precomputed = bool(constexprs.get("PRECOMPUTED_NEW_COMPUTED", False))
    mapping = _i64(idx_mapping) if constexprs.get("HAS_IDX_MAPPING") else None
    acc, src_idx, computed = _i64(num_accepted), _i64(mamba_state_idx), _i64(num_computed)
    sched = None if precomputed else _i64(num_scheduled)
    draft = None if precomputed else _i64(num_draft)
    for b in range(num_reqs):
        req = mapping[b] if mapping is not None else b
        if req < 0:
            continue
        if precomputed:
            new_computed = computed[req]
            running = new_computed - acc[req] + 1
        else:
            running = computed[req] + sched[req] - draft[req]
            new_computed = running + acc[req] - 1
        aligned = new_computed // block_size * block_size
        if aligned < running:
            continue
        bias, dst_col = aligned - running, aligned // block_size - 1
        if src_idx[req] == dst_col:
            accepted_out[req] = 1
            if bias == 0:
                continue
        for s in range(len(layout)):
            layout.copy(s, req, src_idx[req], dst_col, bias, dim_first)


def tolerant_rebind(overrides: list[tuple[Any, Any]]) -> None:
    """``dispatcher._rebind_kernels`` skipping values whose attributes cannot be read."""
    originals = {id(o): w for o, w in overrides}
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            wrapper = originals.get(id(value))
            if wrapper is not None:
                setattr(module, attr, wrapper)
                continue
            try:
                inner = vars(value).get("kernel") if hasattr(value, "__dict__") else None
            except Exception:  # noqa: BLE001 - e.g. llvmlite's _lib_fn_wrapper
                continue
            wrapper = originals.get(id(inner)) if inner is not None else None
            if wrapper is None:
                continue
            value.kernel = wrapper
            if not isinstance(value, type):
                value.__dict__.pop("_kernel_arg_names", None)


def register_fused_copy_overrides() -> None:
    """Route the two fused copy kernels to the functions above (CPU platform only)."""
    from vllm.triton_utils.dispatcher import _registry, register_kernels

    names = {f"{MAMBA_UTILS}.{k}": f for k, f in zip(
        FUSED_KERNELS, (precopy_mamba_align_fused, postprocess_mamba_fused))}
    todo = {n: f for n, f in names.items() if n not in _registry}
    if todo:
        register_kernels(todo)


def install() -> bool:
    """Wrap ``CpuPlatform.register_triton_kernel_overrides`` (idempotent); ``True`` if done."""
    from vllm.platforms import cpu as cpu_platform
    from vllm.triton_utils import dispatcher

    platform = cpu_platform.CpuPlatform
    current = platform.__dict__["register_triton_kernel_overrides"].__func__
    if getattr(current, "_hybridcache", False):
        return True
    dispatcher._rebind_kernels = tolerant_rebind

    def register_triton_kernel_overrides(cls) -> None:
        current(cls)
        from vllm.triton_utils import HAS_TRITON

        if not HAS_TRITON:
            register_fused_copy_overrides()

    register_triton_kernel_overrides._hybridcache = True  # type: ignore[attr-defined]
    platform.register_triton_kernel_overrides = classmethod(register_triton_kernel_overrides)
    return True
