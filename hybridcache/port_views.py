"""The engine port's read-only views and result records (:mod:`hybridcache.port`): what an
engine reads of a live request (:class:`RequestView`), of a cached hit (:class:`CachedPrefix`,
:class:`DevicePrefix`) and of a pinned snapshot (:class:`SnapshotPin`). Kept apart from the
port's calls so that each module has one job; :mod:`hybridcache.port` re-exports them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import attrgetter
from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.index import UnitHandle
    from hybridcache.requests import Request


def _field(name: str, doc: str | None = None) -> property:
    """A read-only property reading the record's field ``name`` (a C-level getter: the
    engine reads these per request and step)."""
    return property(attrgetter(f"_r.{name}"), doc=doc)


class RequestView:
    """Read-only view of one live request (the manager's record changes underneath it).

    Token counts are tokens; ``registered_units`` are hash units whose KV the request holds
    as cached entries.
    """

    __slots__ = ("_r",)

    def __init__(self, record: Request) -> None:
        self._r = record

    id = _field("id")
    tenant = _field("tenant")
    num_tokens = _field("num_tokens", doc="tokens known (prompt + appended)")
    prompt_len = _field("prompt_len")
    allocated = _field("allocated", doc="the first allocate ran")
    num_allocated = _field("num_allocated")
    num_computed = _field("num_computed", doc="tokens committed")
    hit_tokens = _field("hit_tokens")
    kv_hit_tokens = _field("kv_hit_tokens")
    registered_units = _field("units")
    running_slot = _field("slot")
    rolling_slot = _field("rolling_slot", doc="turn-end save slot (-1: none)")
    rolling_boundary = _field("rolling_boundary")
    step_start = _field("step_start", doc=(
        "first token of the last allocated step (what accept counts from)"))
    num_draft_slots = property(lambda self: len(self._r.draft_slots), doc=(
        "draft slots of the last step (allocate(num_draft=)), freed by accept"))
    duplicate_units = property(lambda self: len(self._r.dup_pages), doc=(
        "units the request recomputed although another request registered them meanwhile: "
        "it keeps its own page of each and holds the cached one too"))

    @property
    def save_slots(self) -> Mapping[int, int]:
        """Pending save points: boundary (tokens) -> slot the engine writes the state to."""
        return MappingProxyType(self._r.saves)

    @property
    def digests(self) -> Sequence[bytes]:
        """Digests of the request's full units, in chain order (a read-only copy)."""
        return tuple(self._r.hasher.digests)

    def __eq__(self, other: object) -> bool:
        """Views are equal when they view the same request record (a request id freed and
        added again is a new record)."""
        return isinstance(other, RequestView) and other._r is self._r

    def __hash__(self) -> int:
        return id(self._r)

    def __repr__(self) -> str:
        r = self._r
        return f"RequestView({r.id!r}, tokens={r.num_tokens}, computed={r.num_computed})"


class CachedPrefix(NamedTuple):
    """The cached entries a hit of ``units`` units reads: KV pages per attention group and
    the snapshot at its end (``-1``: none, or a model without state)."""

    units: int
    block_tables: dict[str, list[int]]
    snapshot_slot: int


class DevicePrefix(NamedTuple):
    """What the device cache holds of a chain (units): KV from unit 0 up to ``kv_units``,
    the deepest snapshot on it ending at ``snapshot_units``, and per unit whether it has
    KV at all (stranded runs past the first gap included)."""

    kv_units: int
    snapshot_units: int
    has_kv: list[bool]
    #: The hit the manager would give now (units): ``kv_units`` (``snapshot_units`` with
    #: state), lowered where a sliding-window group lacks the window before it
    #: (:meth:`~hybridcache.coordinator.GroupCoordinator.longest_hit`).
    hit_units: int = 0


class SnapshotPin(NamedTuple):
    """A pin on a cached snapshot (:meth:`EnginePort.pin_snapshot`)."""

    boundary: int
    slot: int
    handle: UnitHandle
