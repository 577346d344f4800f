"""Errors raised by the state-copy kernels.

They derive from :class:`hybridcache.errors.HybridCacheError` and ``ValueError`` so a caller
can treat every bad-input case the same way as the rest of the library. Every check runs on
the host before any byte moves, so a rejected call leaves all tensors untouched.
"""

from __future__ import annotations

from hybridcache.errors import HybridCacheError


class PlanError(HybridCacheError, ValueError):
    """A malformed or unsafe copy plan; the message names the offending slots or pairs."""


class LayoutError(HybridCacheError, ValueError):
    """A tensor or staging buffer that does not follow the row layout the kernels assume."""


class BackendError(HybridCacheError, ValueError):
    """An unknown backend name, or a backend that cannot run on the given tensors."""
