"""Entry point for vLLM's ``vllm.general_plugins`` group (declared in pyproject.toml).

vLLM calls :func:`register` in every process it starts, whether or not hybridcache is
used, so it does no heavy work and never raises. The scheduler needs no registration
(``--scheduler-cls`` takes its qualified name); ``register`` only reports, once, whether
this vLLM is one the adapter supports, so a mismatch is visible before anyone selects it.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("hybridcache.adapters.vllm")

SCHEDULER_CLS = "hybridcache.adapters.vllm.HybridCacheScheduler"


def register() -> None:
    """Harmless hook: log support status; never import the adapter or raise."""
    try:
        from .version import SUPPORTED_VLLM, installed_vllm_version, is_supported

        version = installed_vllm_version()
        if version is not None and not is_supported(version):
            logger.warning(
                "hybridcache: vLLM %s is not supported (supported: %s); %s will refuse to load",
                version,
                ", ".join(SUPPORTED_VLLM),
                SCHEDULER_CLS,
            )
    except Exception as exc:  # noqa: BLE001 - a plugin must never break vLLM start-up
        logger.debug("hybridcache plugin: version probe failed: %s", exc)
