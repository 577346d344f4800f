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
start) so that both apply there, together with :func:`patch_gdn_spec_conv` (the CPU GDN
speculative step's conv roll, and every state column's own conv window,
:func:`spread_conv_windows`, which sub-block tails after a step with drafts rely on); only
for the vLLM releases the adapter supports.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from typing import Any

import torch

logger = logging.getLogger("hybridcache.adapters.vllm")

MAMBA_UTILS = "vllm.v1.worker.mamba_utils"
#: vLLM's own ``dispatcher._rebind_kernels``, once :func:`install` has replaced it.
vllm_rebind: Any = None
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
    global vllm_rebind
    if dispatcher._rebind_kernels is not tolerant_rebind:
        vllm_rebind = dispatcher._rebind_kernels
    dispatcher._rebind_kernels = tolerant_rebind

    def register_triton_kernel_overrides(cls) -> None:
        current(cls)
        from vllm.triton_utils import HAS_TRITON

        if not HAS_TRITON:
            register_fused_copy_overrides()
            patch_gdn_spec_conv()

    register_triton_kernel_overrides._hybridcache = True  # type: ignore[attr-defined]
    platform.register_triton_kernel_overrides = classmethod(register_triton_kernel_overrides)
    return True


# --------------------------------------------------------------------------- GDN
GDN_CPU = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"


def gdn_spec_forward(layer, md, mixed_qkv_spec, b_spec, a_spec, conv_buf, ssm_state,
                     width: int, state_len: int):
    """vLLM 0.32's CPU GDN ``_spec_forward`` with the conv buffer rolled as the Triton
    ``causal_conv1d_update`` rolls it.

    The CPU original (torch path, CPUs without AMX) keeps ``state_len - q`` history
    columns from ``num_accepted`` on and appends the step's ``q`` inputs at the end, which
    matches the kernel only when every step has ``1 + num_spec`` tokens; with an n-gram
    drafter the count varies, and the slice comes up short (the engine dies) or the next
    step reads the wrong history. Here, as in the kernel: the history read is columns
    ``[a - 1, a - 1 + W - 1)``; the buffer becomes that history minus its oldest column,
    then the step's inputs, from column 0; then every later column of the step gets its
    own window (:func:`spread_conv_windows`). The recurrent part is vLLM's own op,
    unchanged.
    """
    import torch.nn.functional as F
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as gdn

    n = md.num_spec_decodes
    qsl = md.spec_query_start_loc[: n + 1].tolist()
    indices = md.spec_state_indices_tensor[:n]
    accepted = md.num_accepted_tokens[:n]
    w = gdn._unpacked_conv_weight(layer).unsqueeze(1)
    dim = mixed_qkv_spec.size(-1)
    conv_out = torch.empty_like(mixed_qkv_spec)
    for i in range(n):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        buf = conv_buf[int(indices[i, 0])]  # (dim, state_len)
        off = int(accepted[i]) - 1
        x = mixed_qkv_spec[start:end].transpose(0, 1).to(buf.dtype)
        hist = buf[:, off : off + width - 1].clone()
        out = F.conv1d(torch.cat([hist, x], dim=-1).unsqueeze(0), w, layer.conv1d.bias, groups=dim)[0]
        if layer.activation == "silu":
            out = F.silu(out)
        conv_out[start:end] = out.transpose(0, 1).to(conv_out.dtype)
        rolled = torch.cat([hist[:, 1:], x], dim=-1)
        buf[:, : rolled.shape[1]] = rolled
        spread_conv_windows(conv_buf, [int(c) for c in indices[i, : end - start]], width)
    query, key, value = (t.squeeze(0) for t in layer.rearrange_mixed_qkv(conv_out))
    return ops.fused_sigmoid_gating_delta_rule_update_spec_cpu(
        A_log=layer.A_log, dt_bias=layer.dt_bias, q=query, k=key, v=value, a=a_spec, b=b_spec,
        initial_state_source=ssm_state,
        spec_state_indices=indices.to(torch.int32).contiguous(),
        num_accepted_tokens=accepted.to(torch.int32).contiguous(),
        cu_seqlens=md.spec_query_start_loc[: n + 1].to(torch.int32).contiguous(),
        use_qk_l2norm_in_kernel=True,
    )


def spread_conv_windows(conv_buf: torch.Tensor, cols: list[int], width: int) -> None:
    """Give every state column of a speculative step its own conv state.

    After a speculative step the conv history sits in column ``cols[0]`` only: the window
    after the step's ``t + 1``-th input is its columns ``[t, t + W - 1)``, read at the
    accepted-count offset by the next step, while the recurrent state after that input is
    in block ``cols[t]``. A block of column ``cols[t]`` is therefore not a state of its
    own: copying it whole (a sub-block tail through ``kv_cache_block_copies``) pairs the
    right recurrent state with a stale conv window. Here the window after input ``t + 1``
    is also written into ``[0, W - 1)`` of block ``cols[t]``, where a prefill or a
    zero-offset read takes it; vLLM never reads the conv part of those blocks (the next
    step reads column ``cur``'s, and a request entering a later column gets column
    ``cur``'s shifted by ``precopy``), so its own computation is unchanged.

    ``conv_buf``: ``[blocks, dim, state_len]`` (dim first); ``cols``: the step's column
    blocks, one per scheduled input; block 0 (the null block) is never written.
    """
    src = conv_buf[cols[0]]
    for t in range(1, len(cols)):
        if cols[t] > 0 and cols[t] != cols[0]:
            conv_buf[cols[t], :, : width - 1] = src[:, t : t + width - 1]


def torch_gdn_spec_path() -> bool:
    """Whether vLLM's CPU GDN speculative step takes its torch path here (no AMX, no Arm
    bf16), which :func:`patch_gdn_spec_conv` routes to :func:`gdn_spec_forward`."""
    import importlib

    gdn = importlib.import_module(GDN_CPU)
    return not (torch.cpu._is_amx_tile_supported() or gdn.is_arm_bf16())


def speculative_columns_whole() -> bool:
    """Whether every state column of a speculative step holds a whole state (conv window
    included) in this engine: the step runs this plug-in's forwards (vLLM's CPU build
    without Triton, the torch GDN path; the KDA forward of :mod:`.kda_layer` does the same
    on every CPU), which call :func:`spread_conv_windows`. The scheduler asks it to decide
    where sub-block tails may be made after a step with drafts
    (:meth:`.spec_decode.SpecDecodeKVCacheManager._tell_tails`); it is ``False`` on GPUs,
    where vLLM's kernels keep the conv history in column ``cur`` only."""
    try:
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON

        return bool(current_platform.is_cpu()) and not HAS_TRITON and torch_gdn_spec_path()
    except Exception:  # noqa: BLE001 - unknown platform: the safe answer
        return False


def patch_gdn_spec_conv() -> None:
    """Route the CPU GDN speculative step to :func:`gdn_spec_forward` on CPUs whose path is
    the torch one (no AMX, no Arm bf16); idempotent."""
    import importlib

    gdn = importlib.import_module(GDN_CPU)
    if getattr(gdn._spec_forward, "_hybridcache", False):
        return
    original = gdn._spec_forward

    def spec_forward(layer, md, *args):
        if not torch_gdn_spec_path():
            return original(layer, md, *args)
        return gdn_spec_forward(layer, md, *args)

    spec_forward._hybridcache = True  # type: ignore[attr-defined]
    gdn._spec_forward = spec_forward
