"""Moved: the arena's tensors live in :mod:`hybridcache.kernels.storage`.

The core is bookkeeping only and imports no torch (engines with their own tensors use it
as it is), so the torch-backed :class:`ArenaStorage` moved next to the copy kernels in
0.3.0. This module forwards the old names on first use, with a ``DeprecationWarning``, and
imports nothing itself: ``import hybridcache.storage`` still loads no torch.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_MOVED = ("ArenaStorage", "SlotPlan", "TORCH_DTYPES", "page_shape")


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module 'hybridcache.storage' has no attribute {name!r}")
    warnings.warn(
        f"hybridcache.storage.{name} moved to hybridcache.kernels.storage.{name}",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module("hybridcache.kernels.storage"), name)
