"""Whole-page block copies in vLLM 0.32's worker (``copy_kv_cache_blocks_inplace``).

vLLM's copy-on-write channel (``SchedulerOutput.kv_cache_block_copies``: a partial
attention page or a Mamba state block copied from a cached block into a private one)
runs ``vllm.v1.worker.utils.copy_kv_cache_blocks_inplace`` over the runner's per-layer
cache views. It skips a view whose ``data_ptr`` it has already seen, to copy layers that
share one allocation only once. In a hybrid model one allocation is shared by an
attention layer and a Gated DeltaNet (or KDA / Mamba) layer, and both views start at the
same address, but the state view covers fewer bytes per block (the state is padded up to
the attention page). When the state view comes first in the runner's list (it does for
Qwen3-Next: layer 0 is a GDN layer), the attention view is skipped and only the first
``state bytes`` of every attention page are copied: the tail of the V half of a
copied-on-write page keeps stale data, and outputs after a fine-grained hit drift.

:func:`whole_page_copy` wraps the function so that, among views starting at the same
address, the one that spans the most bytes per block is copied (vLLM's own de-duplication
then skips the narrower ones): whole pages, whatever the views' order. Nothing else
changes: distinct addresses are all copied as before, and the arguments are vLLM's.

:func:`install` applies it for vLLM 0.32.0 only (the plug-in checks the version first), in
``vllm.v1.worker.utils`` and in the already-imported modules that bound the function by
name (a module imported later binds the patched one). Set ``HYBRIDCACHE_VLLM_COPY_FIX=0``
to leave vLLM's original in place (to measure what the fix changes).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

#: Environment variable that disables the fix (``0``); anything else keeps it on.
COPY_FIX_ENV = "HYBRIDCACHE_VLLM_COPY_FIX"

#: Modules of vLLM 0.32.0 that import ``copy_kv_cache_blocks_inplace`` by name.
_BINDERS = (
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.gpu.model_runner",
    "vllm.distributed.kv_transfer.kv_connector.v1.hisparse.worker",
)
_MARK = "_hybridcache_whole_page"


def block_span_bytes(view: Any) -> int:
    """Bytes one block of ``view`` spans from its first element (dim 0 indexes blocks)."""
    if view.dim() == 0 or view.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(view.shape[1:], view.stride()[1:]))
    return (last + 1) * view.element_size()


def widest_first(kv_caches: Iterable[Any]) -> list[Any]:
    """The views, each address's widest view moved to that address's first occurrence."""
    views = list(kv_caches)
    widest: dict[tuple[Any, int], Any] = {}
    for v in views:
        key = (v.device, v.data_ptr())
        best = widest.get(key)
        if best is None or block_span_bytes(v) > block_span_bytes(best):
            widest[key] = v
    out: list[Any] = []
    placed: set[tuple[Any, int]] = set()
    for v in views:
        key = (v.device, v.data_ptr())
        if key not in placed:
            placed.add(key)
            out.append(widest[key])
        out.append(v)  # vLLM skips the repeats itself
    return out


def whole_page_copy(original: Callable[..., None]) -> Callable[..., None]:
    """``original`` (vLLM's ``copy_kv_cache_blocks_inplace``) given the widest views first."""
    if getattr(original, _MARK, False):
        return original

    @functools.wraps(original)
    def copy_kv_cache_blocks_inplace(kv_caches: Iterable[Any], num_blocks: int,
                                     kv_cache_block_copies: Any) -> None:
        if not kv_cache_block_copies:
            return
        original(widest_first(kv_caches), num_blocks, kv_cache_block_copies)

    setattr(copy_kv_cache_blocks_inplace, _MARK, True)
    return copy_kv_cache_blocks_inplace


def install() -> bool:
    """Patch vLLM's block copy (see module docstring); ``True`` if the fix is in place."""
    if os.environ.get(COPY_FIX_ENV, "1") == "0":
        return False
    import vllm.v1.worker.utils as utils

    original = utils.copy_kv_cache_blocks_inplace
    patched = whole_page_copy(original)
    utils.copy_kv_cache_blocks_inplace = patched
    for name in _BINDERS:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "copy_kv_cache_blocks_inplace", None) is original:
            module.copy_kv_cache_blocks_inplace = patched
    return True
