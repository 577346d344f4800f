"""Errors of the offload tiers.

Two families, on purpose:

* :class:`EntryFormatError` and its subclasses describe a stored entry that must not be used
  (corrupt, truncated, another format version, another model, another key). The tiers catch
  them, count the entry as corrupt, delete it and report a miss: a cache may lose data but
  must never hand back wrong data.
* :class:`TierConfigError` is raised to the caller for bad configuration or bad arguments
  (unknown URL scheme, short secret, invalid tenant name), before anything changes.

Infrastructure failures (Redis down, timeouts) are never raised to the caller at all: they
become misses, a metric and one warning per outage (see :mod:`hybridcache.tiers.health`).
"""

from __future__ import annotations

from hybridcache.errors import HybridCacheError


class TierError(HybridCacheError):
    """Base class of every error raised by :mod:`hybridcache.tiers`."""


class TierConfigError(TierError, ValueError):
    """Invalid tier configuration or argument; the message names the offending value."""


class EntryFormatError(TierError, ValueError):
    """A stored entry failed validation; it is treated as a miss and deleted."""


class TruncatedEntryError(EntryFormatError):
    """A piece or the header is shorter (or longer) than the header says."""


class MissingPieceError(EntryFormatError):
    """The header names a piece (or chunk) that is not stored."""


class ChecksumMismatchError(EntryFormatError):
    """A MAC (of the manifest or of a chunk) does not verify: forged, corrupt or truncated."""


class FormatVersionError(EntryFormatError):
    """The entry was written with a format version this code does not read."""


class FingerprintMismatchError(EntryFormatError):
    """The entry was written for another model layout (``ModelSpec.fingerprint()``)."""


class KeyMismatchError(EntryFormatError):
    """The entry names another tenant or prefix hash than the key it was read under."""


class InvalidEntryError(TierError, ValueError):
    """An entry given to ``put`` cannot be stored (unsupported dtype, device tensor, bad name)."""
