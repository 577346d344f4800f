"""Make vLLM 0.32's Kimi K3 KDA path run on the CPU build (narrow, version-gated patches).

Three things stop a KDA model on vLLM's CPU build; each is fixed here without a fork:

1. **Worker start-up.** Importing the Kimi model pulls in numba / llvmlite; the CPU
   platform's ``register_triton_kernel_overrides`` then scans ``sys.modules`` and touches
   llvmlite's ``_lib_fn_wrapper`` objects, which raise on attribute access.
   :func:`tolerant_kernel_rebind` wraps the dispatcher's rebinding so that a module whose
   attributes cannot be read is skipped (it holds no vLLM kernel).
2. **No CPU forward.** :func:`register_cpu_kda_layer` registers
   :class:`~.kda_layer.KdaCpuForward`'s class out of tree for ``KimiK3DeltaAttention``
   (a ``PluggableLayer``): vLLM instantiates it wherever the model builds the layer.
3. **Metadata.** ``KimiK3KDAMetadataBuilder`` gathers ``align``-mode state columns with a
   Triton kernel behind ``assert block_table.is_cuda``;
   :func:`patch_kda_metadata` gives ``_mamba_get_block_table_tensor`` the PyTorch form the
   builder's own comment states, for CPU tensors only.

All of it applies only on the CPU platform and only to the vLLM releases in
:data:`~.version.SUPPORTED_VLLM`; each function is idempotent.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("hybridcache.adapters.vllm")

_DONE: set[str] = set()


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def aligned_state_indices(
    block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_slots: int
) -> torch.Tensor:
    """Columns ``(seq_len - 1) // block_size + [0, num_slots)`` of each block-table row.

    The PyTorch form of ``_get_aligned_state_indices_kernel`` (clamped at column 0 as the
    kernel's ``maximum``); columns past the table read as block 0, the null block.
    """
    start = ((seq_lens.to(torch.int64) - 1) // block_size).clamp_(min=0)
    cols = start[:, None] + torch.arange(num_slots, dtype=torch.int64, device=start.device)
    width = block_table.shape[1]
    out = torch.gather(block_table, 1, cols.clamp(max=width - 1))
    return out.masked_fill(cols >= width, 0)


def patch_kda_metadata() -> None:
    """CPU tensors take :func:`aligned_state_indices`; device tensors vLLM's kernel."""
    if "metadata" in _DONE:
        return
    from vllm.models.kimi_k3.nvidia import kda_metadata

    original = kda_metadata._mamba_get_block_table_tensor

    def get_block_table_tensor(block_table, seq_lens, kv_cache_spec, mamba_cache_mode):
        if mamba_cache_mode == "none" or block_table.is_cuda:
            return original(block_table, seq_lens, kv_cache_spec, mamba_cache_mode)
        slots = 1 + kv_cache_spec.num_speculative_blocks
        return aligned_state_indices(block_table, seq_lens, kv_cache_spec.block_size, slots)

    kda_metadata._mamba_get_block_table_tensor = get_block_table_tensor
    _DONE.add("metadata")


def register_cpu_kda_layer() -> None:
    """Instantiate :class:`~.kda_layer.KdaCpuForward`'s layer for ``KimiK3DeltaAttention``."""
    if "layer" in _DONE:
        return
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention

    from .kda_layer import make_cpu_kda_class

    if KimiK3DeltaAttention.__name__ not in op_registry_oot:
        KimiK3DeltaAttention.register_oot(make_cpu_kda_class())
    _DONE.add("layer")


def install_cpu_kda() -> None:
    """All CPU fixes for the KDA model path (called when a KDA model class is built)."""
    if not is_cpu_platform():
        return
    patch_kda_metadata()
    register_cpu_kda_layer()
    logger.info("hybridcache: KDA layers run with the torch CPU forward")


def register_kda_model() -> bool:
    """Register :data:`~.kda_model.ARCHITECTURE` with vLLM's model registry (lazily, by name).

    Returns ``True`` when registered. The CPU fixes are installed when vLLM builds the
    model class (:func:`~.kda_model.build_model_class`), not here: importing the Kimi
    model modules in every vLLM process is what the plug-in must avoid.
    """
    try:
        from vllm import ModelRegistry

        from .kda_model import ARCHITECTURE

        if ARCHITECTURE not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(ARCHITECTURE, f"{__package__}.kda_model:{ARCHITECTURE}")
        return True
    except Exception as exc:  # noqa: BLE001 - a plugin must never break vLLM start-up
        logger.debug("hybridcache plugin: KDA model registration failed: %s", exc)
        return False


def register_from_plugin() -> None:
    """What the ``vllm.general_plugins`` entry point adds for KDA and speculative decoding:
    the KDA model architecture and, on the CPU platform, the fused copy kernels and the
    tolerant kernel rebinding (:mod:`.cpu_kernels`). Never raises."""
    register_kda_model()
    try:
        if is_cpu_platform():
            from .cpu_kernels import install

            install()
    except Exception as exc:  # noqa: BLE001 - a plugin must never break vLLM start-up
        logger.debug("hybridcache plugin: CPU kernel overrides failed: %s", exc)
