"""What a prefetch moved (:class:`LoadPlan`) and the coordinator's counters.

Kept apart from the coordinator so engines and tests can import the result types alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class LoadPlan:
    """The outcome of one :meth:`OffloadCoordinator.prefetch` that gained tokens.

    The loaded units and snapshot are registered in the manager's index as cached,
    evictable entries by the time the plan is returned, so the manager's next ``match`` /
    first ``allocate`` hits ``hit_tokens`` as if they had been computed on the device.

    Attributes:
        request_id: the request it was made for.
        device_hit_tokens: what the device alone would have served.
        hit_tokens: what the device serves now (a multiple of the hash unit, at a snapshot).
        planned_tokens: what the probe promised; ``hit_tokens`` is lower when a piece turned
            out missing or corrupt, memory ran out, or a tier failed mid-load.
        kv_units: unit indices whose KV was loaded (units below ``hit_tokens``).
        snapshot_boundary: the token boundary whose snapshot was loaded; ``None`` when the
            snapshot was already on the device (only KV below it was missing).
        bytes_loaded: payload bytes copied into the arena (discarded partial loads count
            in the metrics, not here).
        entries_by_tier: tier name -> entries loaded from it.
        seconds: wall time of the prefetch (probe, transfers, registration).
    """

    request_id: str
    device_hit_tokens: int
    hit_tokens: int
    planned_tokens: int
    kv_units: tuple[int, ...]
    snapshot_boundary: int | None
    bytes_loaded: int
    entries_by_tier: dict[str, int]
    seconds: float

    @property
    def gained_tokens(self) -> int:
        """Tokens the tiers added to the device hit."""
        return self.hit_tokens - self.device_hit_tokens

    @property
    def complete(self) -> bool:
        """Whether everything the probe found was loaded."""
        return self.hit_tokens == self.planned_tokens


@dataclass
class OffloadMetrics:
    """Cumulative counters of one coordinator (``as_dict`` for JSON).

    Demotion (device eviction -> first tier): ``demoted_*`` were handed to the tier,
    ``demote_skipped_policy`` were not worth keeping, ``demote_skipped_stored`` were already
    in a tier (loaded from it, or demoted before), ``demote_dropped`` were refused by the
    tier (queue full, too big), ``demote_errors`` raised (logged). ``spilled_entries``:
    HostTier victims passed down to the next tier. ``demote_skipped_sliding``: sliding-window
    pages, never stored (:mod:`.offload_windows`).

    Loading: ``prefetch_calls``; ``prefetch_hits`` gained tokens, ``prefetch_partial`` of
    them gained fewer than planned; ``prefetch_hit_tokens`` sums the gains;
    ``loaded_entries`` / ``loaded_bytes`` were copied and registered; ``load_discarded``
    entries were copied but dropped again (no complete snapshot above them);
    ``tier_hits`` / ``tier_misses`` count gets per tier name (a probe said present, the
    get then missed: eviction, expiry, corruption or an outage in between);
    ``load_invalid`` entries passed the tier's checks but not the layout's;
    ``prefetch_errors`` unexpected exceptions caught (logged; the request just misses);
    ``prefetch_window_limited`` prefetches lowered to an end whose sliding window is on
    the device (:mod:`.offload_windows`).
    """

    demoted_kv: int = 0
    demoted_snapshots: int = 0
    demoted_bytes: int = 0
    demote_skipped_policy: int = 0
    demote_skipped_stored: int = 0
    demote_dropped: int = 0
    demote_errors: int = 0
    demote_skipped_sliding: int = 0
    spilled_entries: int = 0
    prefetch_calls: int = 0
    prefetch_hits: int = 0
    prefetch_partial: int = 0
    prefetch_hit_tokens: int = 0
    prefetch_errors: int = 0
    prefetch_window_limited: int = 0
    probed_keys: int = 0
    loaded_kv: int = 0
    loaded_snapshots: int = 0
    loaded_bytes: int = 0
    load_discarded: int = 0
    load_invalid: int = 0
    tier_hits: dict[str, int] = field(default_factory=dict)
    tier_misses: dict[str, int] = field(default_factory=dict)

    @property
    def demoted_entries(self) -> int:
        return self.demoted_kv + self.demoted_snapshots

    @property
    def loaded_entries(self) -> int:
        return self.loaded_kv + self.loaded_snapshots

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["tier_hits"] = dict(self.tier_hits)
        out["tier_misses"] = dict(self.tier_misses)
        out["demoted_entries"] = self.demoted_entries
        out["loaded_entries"] = self.loaded_entries
        return out
