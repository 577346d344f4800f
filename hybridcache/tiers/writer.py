"""A background writer: puts never block the engine, and memory for pending writes is bounded.

Offloading a 40 MiB snapshot to Redis takes tens of milliseconds; the engine must not wait
for it (the entry is a cache, not a commitment). ``submit`` only appends to a queue and
returns; one worker thread drains the queue in batches (so a batch is one pipelined round
trip). What the writer holds (queued plus being written) is bounded in jobs and in bytes:
when full, a new write is *dropped* (counted by the caller as ``dropped_writes``) rather
than blocking or growing memory without limit. Control jobs (deletes) bypass the bound: they are tiny and must not be lost, or a
deleted entry could survive.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

_log = logging.getLogger("hybridcache.tiers.writer")


class Job(Protocol):
    nbytes: int


J = TypeVar("J", bound=Job)


class BackgroundWriter(Generic[J]):
    """A bounded FIFO drained by one daemon thread in batches.

    Args:
        handler: called by the worker with each batch (a list of jobs, in submit order).
            It must handle its own errors; an exception escaping it is logged and the batch
            is lost, the worker goes on.
        max_jobs: most jobs held, queued or being written (bounded submits beyond it are
            refused).
        max_bytes: most bytes held (sum of ``job.nbytes``); one job larger than this is
            still accepted when nothing is held, so a big entry is never impossible.
        batch_jobs / batch_bytes: most jobs / bytes handed to one ``handler`` call.
        name: thread name.
    """

    def __init__(
        self,
        handler: Callable[[list[J]], None],
        *,
        max_jobs: int = 256,
        max_bytes: int = 1 << 30,
        batch_jobs: int = 64,
        batch_bytes: int = 128 << 20,
        name: str = "hybridcache-tier-writer",
    ) -> None:
        self._handler = handler
        self._max_jobs = max_jobs
        self._max_bytes = max_bytes
        self._batch_jobs = batch_jobs
        self._batch_bytes = batch_bytes
        self._queue: collections.deque[J] = collections.deque()
        self._held_bytes = 0
        self._unfinished = 0
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet handled (queued or in the current batch)."""
        with self._cond:
            return self._unfinished

    def submit(self, job: J, *, bounded: bool = True) -> bool:
        """Queue ``job``; ``False`` (nothing queued) if bounded and the queue is full or closed."""
        with self._cond:
            if self._closed:
                return False
            if (
                bounded
                and self._unfinished
                and (
                    self._unfinished >= self._max_jobs
                    or self._held_bytes + job.nbytes > self._max_bytes
                )
            ):
                return False
            self._queue.append(job)
            self._held_bytes += job.nbytes
            self._unfinished += 1
            self._cond.notify_all()
            return True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted job has been handled; ``False`` on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._unfinished:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout_s: float | None = 10.0) -> bool:
        """Stop accepting jobs, finish the queued ones (up to ``timeout_s``), stop the thread."""
        done = self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        return done

    def _take_batch(self) -> list[J] | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if not self._queue:
                return None
            batch: list[J] = []
            size = 0
            while self._queue and len(batch) < self._batch_jobs:
                job = self._queue[0]
                if batch and size + job.nbytes > self._batch_bytes:
                    break
                self._queue.popleft()
                size += job.nbytes
                batch.append(job)
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            try:
                self._handler(batch)
            except Exception:  # a bug in the handler must not kill the writer
                _log.exception("tier writer: batch of %d jobs failed", len(batch))
            finally:
                with self._cond:
                    self._unfinished -= len(batch)
                    self._held_bytes -= sum(job.nbytes for job in batch)
                    self._cond.notify_all()
