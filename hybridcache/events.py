"""The cache's event stream: what was stored in, removed from or cleared out of the device
cache, taken out by the engine (:meth:`hybridcache.port.EnginePort.take_events`).

The index appends events to an :class:`EventLog` while a call runs and the engine takes
them out once the call returned (vLLM's ``take_events()``, SGLang's ``take_events``); each
consumer has its own :class:`EventQueue` (:meth:`~hybridcache.port.EnginePort.subscribe`),
so one consumer's take never steals another's events. A consumer that must act inside the
call (an offload tier copying a victim's bytes before the same call hands its pages to
another request) passes an observer in at the port's construction instead. A removed entry's pages or slot stay intact
until the engine next writes the arena (the bytes of a victim are only overwritten by a
step the engine runs later), so a tier can copy them out from the event before it runs the
step. Recording is off until an :class:`~hybridcache.port.EnginePort` asks for it: the
manager's hot path pays one ``is None`` test per entry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

STORED = "stored"
REMOVED = "removed"
CLEARED = "cleared"
DEVICE = "device"


class CacheEvent(NamedTuple):
    """One change of the device cache.

    Attributes:
        action: ``"stored"`` (registered, now matchable), ``"removed"`` (evicted) or
            ``"cleared"`` (``clear()`` ran; its removals come as ``removed`` events first).
        kind: ``"kv"`` (KV pages of units) or ``"state"`` (one snapshot); ``""`` for cleared.
        medium: where the entry lives (``"device"``: the manager's arena).
        digests: the units' digests, in chain order (one for a snapshot or an evicted unit).
        depth: unit index of the first digest in its chain (the unit covers tokens
            ``[depth * unit, (depth + 1) * unit)``).
        groups: the attention groups (KV: one page per group per unit, in this order) or
            the state groups a snapshot holds.
        tenant: the cache domain of the entries (``None``: the shared one).
        locations: KV: per unit, its page ids (one per group); state: ``(slot,)``.
        flops: prefill FLOPs one entry saves (per unit for KV), the value eviction ranks.
        hits: requests that reused the entry (0 when stored); a tier may rank by it.
    """

    action: str
    kind: str
    medium: str
    digests: tuple[bytes, ...]
    depth: int
    groups: tuple[str, ...]
    tenant: str | None
    locations: tuple
    flops: float = 0.0
    hits: int = 0


def cleared_event() -> CacheEvent:
    return CacheEvent(CLEARED, "", DEVICE, (), 0, (), None, ())


class EventQueue:
    """One consumer's queue of the event stream (:meth:`EventLog.subscribe`).

    Each queue sees every event appended after it was opened, independently of the other
    consumers: taking from one never takes from another. Close it when done (an open queue
    nobody takes from keeps growing)."""

    __slots__ = ("_log", "_events")

    def __init__(self, log: EventLog) -> None:
        self._log: EventLog | None = log
        self._events: list[CacheEvent] = []

    def take(self) -> list[CacheEvent]:
        """Events since the last take, oldest first."""
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    def close(self) -> None:
        """Stop receiving events (idempotent)."""
        if self._log is not None:
            self._log.unsubscribe(self)
            self._log = None
        self._events = []


Observer = Callable[[CacheEvent], None]


class EventLog:
    """Where the index appends events: fans each one out to the open queues and to the
    observers.

    Observers are called synchronously, inside the cache call, right as the event happens:
    for a ``removed`` event the entry's pages or slot are already free in the arena but
    nothing has reused them, so an observer can copy the bytes out even when the same call
    hands those pages to another request (an engine writes them only after the call
    returned). An observer must not call back into the cache, and must not raise (it would
    abort the cache call half way); an offload tier catches and counts its own errors.
    """

    __slots__ = ("_queues", "_observers", "_default")

    def __init__(self) -> None:
        self._queues: list[EventQueue] = []
        self._observers: list[Observer] = []
        self._default: EventQueue | None = None

    def default_queue(self) -> EventQueue:
        """The queue :meth:`~hybridcache.port.EnginePort.take_events` takes from (one per
        manager, shared by its ports)."""
        if self._default is None:
            self._default = self.subscribe()
        return self._default

    @property
    def has_default(self) -> bool:
        return self._default is not None

    def append(self, event: CacheEvent) -> None:
        for q in self._queues:
            q._events.append(event)  # noqa: SLF001 - the queue's producer side
        for observe in self._observers:
            observe(event)

    def subscribe(self) -> EventQueue:
        q = EventQueue(self)
        self._queues.append(q)
        return q

    def unsubscribe(self, queue: EventQueue) -> None:
        self._queues = [q for q in self._queues if q is not queue]

    def observe(self, observer: Observer) -> None:
        self._observers.append(observer)

    def unobserve(self, observer: Observer) -> None:
        self._observers = [o for o in self._observers if o is not observer]
