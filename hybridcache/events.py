"""The cache's event stream: what was stored in, removed from or cleared out of the device
cache, taken out by the engine (:meth:`hybridcache.port.EnginePort.take_events`).

Observers are not called back from inside the cache: the index appends events to a list
while a call runs and the engine takes them once the call returned (vLLM's
``take_events()``, SGLang's ``take_events``). A removed entry's pages or slot stay intact
until the engine next writes the arena (the bytes of a victim are only overwritten by a
step the engine runs later), so a tier can copy them out from the event before it runs the
step. Recording is off until an :class:`~hybridcache.port.EnginePort` asks for it: the
manager's hot path pays one ``is None`` test per entry.
"""

from __future__ import annotations

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
