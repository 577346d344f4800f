"""Fail closed: turn a remote store's outages into misses, one warning, and quick recovery.

When Redis is down every call would otherwise wait for a connect timeout, stalling the
engine on a cache that is only an optimisation. :class:`Breaker` remembers the failure and
answers "unavailable" at once (the caller then reports a miss or drops the write) until the
store answers again. A black-holed server (paused, a dropped route) is the worst case: every
request waits the full socket timeout. So with a ``probe`` the breaker never lets a caller's
call through while open: once ``retry_interval_s`` has passed, ``allow`` starts the probe on
a background thread (at most one at a time) and returns ``False`` at once; the probe's
success closes the breaker, its failure keeps it open for another interval. A caller's
thread is blocked by the breaker only for a lock and, every interval, a thread start
(microseconds). A warning is logged once per outage, not once per call.
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
        probe: called on a background thread to test the store while the breaker is open
            (raise on failure). ``None``: the first call after the interval probes, in the
            caller's thread (only for stores whose failures are quick).
    """

    def __init__(
        self,
        name: str,
        retry_interval_s: float,
        logger: logging.Logger,
        clock: Callable[[], float] = time.monotonic,
        probe: Callable[[], object] | None = None,
    ) -> None:
        self.name = name
        self.retry_interval_s = retry_interval_s
        self._log = logger
        self._clock = clock
        self._lock = threading.Lock()
        self._open_until: float | None = None
        self._outage = False
        self._probe = probe
        self._probing = False
        self.probes = 0

    @property
    def is_open(self) -> bool:
        """True while a recent failure has not been followed by a success."""
        return self._outage

    def allow(self) -> bool:
        """Whether to try the remote store now (always, unless failing fast after an error)."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._clock() < self._open_until or self._probing:
                return False
            self._open_until = self._clock() + self.retry_interval_s
            if self._probe is None:
                return True  # this call probes; others fail fast until it reports back
            self._probing = True
            self.probes += 1
        threading.Thread(target=self._run_probe, name="hybridcache-tier-probe", daemon=True).start()
        return False

    def _run_probe(self) -> None:
        """Background thread: test the store; close the breaker if it answers."""
        assert self._probe is not None
        try:
            self._probe()
        except Exception as exc:  # any failure keeps the breaker open for an interval
            self.failure(exc)
        else:
            self.success()
        finally:
            with self._lock:
                self._probing = False

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
