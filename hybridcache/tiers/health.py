"""Fail closed: turn a remote store's outages into misses, one warning, and quick recovery.

When Redis is down every call would otherwise wait for a connect timeout, stalling the
engine on a cache that is only an optimisation. :class:`Breaker` remembers the failure and,
for ``retry_interval_s``, answers "unavailable" at once (the caller then reports a miss or
drops the write). After the interval one call is let through as a probe; success closes the
breaker and logs the recovery. A warning is logged once per outage, not once per call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class Breaker:
    """A thread-safe circuit breaker with warn-once-per-outage logging.

    Args:
        name: what is protected, for log messages (e.g. the URL without credentials).
        retry_interval_s: how long to fail fast after a failure before probing again.
        logger: where warnings go.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        name: str,
        retry_interval_s: float,
        logger: logging.Logger,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.retry_interval_s = retry_interval_s
        self._log = logger
        self._clock = clock
        self._lock = threading.Lock()
        self._open_until: float | None = None
        self._outage = False

    @property
    def is_open(self) -> bool:
        """True while a recent failure has not been followed by a success."""
        return self._outage

    def allow(self) -> bool:
        """Whether to try the remote store now (always, unless failing fast after an error)."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._clock() >= self._open_until:
                # Let this call probe; others keep failing fast until it reports back.
                self._open_until = self._clock() + self.retry_interval_s
                return True
            return False

    def failure(self, exc: BaseException) -> None:
        """Record a failure; the first of an outage logs a warning."""
        with self._lock:
            self._open_until = self._clock() + self.retry_interval_s
            first = not self._outage
            self._outage = True
        if first:
            self._log.warning(
                "%s unavailable (%s: %s); serving misses and dropping writes until it is back",
                self.name,
                type(exc).__name__,
                exc,
            )

    def success(self) -> None:
        """Record a success; ends an outage (logged once)."""
        if not self._outage and self._open_until is None:
            return
        with self._lock:
            was_out = self._outage
            self._outage = False
            self._open_until = None
        if was_out:
            self._log.warning("%s is reachable again", self.name)
