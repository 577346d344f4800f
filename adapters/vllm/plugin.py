"""Entry point for vLLM's ``vllm.general_plugins`` group (declared in pyproject.toml).

vLLM calls :func:`register` in every process it starts, whether or not hybridcache is
used, so it does no heavy work and never raises. The scheduler needs no registration
(``--scheduler-cls`` takes its qualified name). ``register`` reports, once, whether this
vLLM is one the adapter supports, and registers ``HybridCacheConnector`` by name with
vLLM's ``KVConnectorFactory`` (lazily: the connector module is imported only when a
``kv_transfer_config`` names it), so ``kv_connector_module_path`` may be omitted, and
fixes vLLM 0.32's block copy so that copy-on-write copies whole pages (:mod:`.copy_fix`).

The work is a list of patches (:data:`PATCHES`), each applied in turn and guarded on its
own: one that fails is logged and skipped, and the others still run. Add a patch by
appending a function that returns whether it applied.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger("hybridcache.adapters.vllm")

SCHEDULER_CLS = "hybridcache.adapters.vllm.HybridCacheScheduler"
CONNECTOR_NAME = "HybridCacheConnector"
CONNECTOR_MODULE = "hybridcache.adapters.vllm.connector"


def register() -> None:
    """Harmless hook: log support status, then apply :data:`PATCHES`; never raise."""
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
            return
    except Exception as exc:  # noqa: BLE001 - a plugin must never break vLLM start-up
        logger.debug("hybridcache plugin: version probe failed: %s", exc)
        return
    for patch in PATCHES:
        _apply(patch)


def _apply(patch: Callable[[], bool]) -> bool:
    try:
        return bool(patch())
    except Exception as exc:  # noqa: BLE001 - a plugin must never break vLLM start-up
        logger.debug("hybridcache plugin: %s failed: %s", patch.__name__, exc)
        return False


def install_copy_fix() -> bool:
    """Whole-page copy-on-write block copies in the worker (see :mod:`.copy_fix`)."""
    from .copy_fix import install

    return install()


def register_kda_cpu() -> bool:
    """KDA layers (Kimi Linear / K3) and speculative decoding on vLLM's CPU build (see
    :mod:`.kda_cpu`)."""
    from .kda_cpu import register_from_plugin

    register_from_plugin()
    return True


def register_connector() -> bool:
    """Register ``HybridCacheConnector`` with vLLM's factory; ``True`` if it is registered."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        registry = getattr(KVConnectorFactory, "_registry", {})
        if CONNECTOR_NAME not in registry:
            KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
        return True
    except Exception as exc:  # noqa: BLE001 - a plugin must never break vLLM start-up
        logger.debug("hybridcache plugin: connector registration failed: %s", exc)
        return False


#: What :func:`register` applies, in order, on a supported vLLM.
PATCHES: list[Callable[[], bool]] = [register_connector, install_copy_fix, register_kda_cpu]
