"""Exceptions raised by hybridcache.

Every error that bad input can cause is a subclass of :class:`HybridCacheError` and is
raised before any state changes, so a caller can catch it and go on with an intact cache.
"""


class HybridCacheError(Exception):
    """Base class of every error raised by hybridcache."""


class SpecError(HybridCacheError, ValueError):
    """An invalid model spec; the message names the offending field."""


class InvalidRequestError(HybridCacheError, ValueError):
    """Bad request input: token ids, lengths, unknown request ids, over-commits."""


class UnknownNameError(HybridCacheError, KeyError):
    """An unknown preset or policy name; the message lists the known ones."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ConfigError(HybridCacheError, ValueError):
    """An invalid setting (a :class:`~hybridcache.config.CacheConfig` field, a manager or
    hasher argument); raised at construction and the message names the field."""


class CapacityError(HybridCacheError, ValueError):
    """The budget cannot hold what the spec needs (for example one snapshot)."""


class OutOfSpaceError(HybridCacheError, RuntimeError):
    """No space can be freed for an allocation right now (every page is in use).

    Raised by ``allocate`` with nothing changed; the engine preempts a request and retries.
    """
