"""A warning when tiers shared beyond this process run under an empty hash seed.

The chain digests that name prefixes are salted with ``CacheConfig.hash_seed``. With the
default empty seed they are a public function of the token ids, so anyone who learns one
(a log, a metrics label, another engine's memory) can confirm a guessed prompt offline.
The tiers store only values keyed by the tier secret (key names and the manifest's prefix
digest, see :mod:`hybridcache.tiers.auth`), which is the wall that holds even then; but a
deployment sharing a cache across machines should also set a secret seed, and is told so
once per process (a log line and a :class:`UnseededCacheWarning`).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Sequence

from hybridcache.tiers.base import Tier
from hybridcache.tiers.host import HostTier

_log = logging.getLogger("hybridcache.tiers")
_lock = threading.Lock()
_warned = False


class UnseededCacheWarning(UserWarning):
    """A shared tier runs under an empty ``hash_seed``."""


def warn_if_unseeded(hash_seed: object, tiers: Sequence[Tier]) -> bool:
    """Warn (once per process) if ``hash_seed`` is empty and a tier is shared beyond this
    process (any tier but :class:`HostTier`); returns whether this call warned."""
    global _warned
    if hash_seed or all(isinstance(t, HostTier) for t in tiers):
        return False
    with _lock:
        if _warned:
            return False
        _warned = True
    message = (
        "hybridcache: a shared tier runs with an empty CacheConfig.hash_seed; prefix digests "
        "are then a public function of the prompt. Set a secret hash_seed (the same on every "
        "engine) in deployments that share a cache."
    )
    _log.warning(message)
    warnings.warn(message, UnseededCacheWarning, stacklevel=3)
    return True


def reset_warning() -> None:
    """Let the next unseeded coordinator warn again (tests)."""
    global _warned
    with _lock:
        _warned = False
