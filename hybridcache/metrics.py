"""Counters of one manager, as a dataclass and as Prometheus text.

``kv_hit_state_miss_tokens`` is the number hybrid users of vLLM cannot see: prompt tokens
whose KV was cached but that had to be recomputed because no state snapshot covered them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridcache.arena import ArenaStats


@dataclass
class CacheMetrics:
    """Cumulative counters (tokens, requests, entries, bytes, FLOPs)."""

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    hit_requests: int = 0
    kv_hit_tokens: int = 0
    kv_hit_state_miss_tokens: int = 0
    prefill_flops: float = 0.0
    prefill_flops_saved: float = 0.0
    snapshot_copies: int = 0
    snapshots_saved: int = 0
    snapshots_skipped: int = 0
    snapshots_rejected: int = 0
    kv_pages_registered: int = 0
    evictions_kv: int = 0
    evictions_state: int = 0
    evicted_bytes_kv: int = 0
    evicted_bytes_state: int = 0
    quota_rejections: int = 0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def request_hit_rate(self) -> float:
        return self.hit_requests / self.requests if self.requests else 0.0

    @property
    def prefill_flops_saved_frac(self) -> float:
        return self.prefill_flops_saved / self.prefill_flops if self.prefill_flops else 0.0

    def as_dict(self) -> dict[str, float]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["token_hit_rate"] = self.token_hit_rate
        out["request_hit_rate"] = self.request_hit_rate
        out["prefill_flops_saved_frac"] = self.prefill_flops_saved_frac
        return out

    def prometheus(self, prefix: str = "hybridcache", labels: dict[str, str] | None = None) -> str:
        """Prometheus exposition text: counters end in ``_total``, ratios are gauges."""
        lab = ""
        if labels:
            inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
            lab = "{" + inner + "}"
        counters = [f.name for f in fields(self)]
        gauges = ["token_hit_rate", "request_hit_rate", "prefill_flops_saved_frac"]
        return _exposition(self, prefix, lab, counters, gauges)


@dataclass
class SlidingMetrics:
    """Sliding-window counters (models with sliding-window groups only; see
    :mod:`hybridcache.coordinator`). ``sliding_pages_cached`` and ``sliding_pages_held``
    are occupancy now (gauges); the rest are cumulative.

    ``window_limited_tokens`` are hit tokens lost because a window cache lacked a unit of
    the window before a longer end that full KV (and, with state, a snapshot) reached; they
    are part of ``kv_hit_state_miss_tokens`` (KV hit, usable hit shorter).
    """

    sliding_pages_cached: int = 0
    sliding_pages_held: int = 0
    sliding_pages_released_by_window: int = 0
    sliding_evictions: int = 0
    sliding_quota_rejections: int = 0
    window_limited_requests: int = 0
    window_limited_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def prometheus(self, prefix: str = "hybridcache", labels: dict[str, str] | None = None) -> str:
        lab = ""
        if labels:
            lab = "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items())) + "}"
        gauges = ["sliding_pages_cached", "sliding_pages_held"]
        counters = [f.name for f in fields(self) if f.name not in gauges]
        return _exposition(self, prefix, lab, counters, gauges)


def _exposition(obj: object, prefix: str, lab: str, counters: list[str], gauges: list[str]) -> str:
    """Prometheus text: counters end in ``_total``, gauges keep their name."""
    lines: list[str] = []
    for c in counters:
        name = f"{prefix}_{c}_total"
        lines.append(f"# TYPE {name} counter")
        lines.append(f"{name}{lab} {_num(getattr(obj, c))}")
    for g in gauges:
        name = f"{prefix}_{g}"
        lines.append(f"# TYPE {name} gauge")
        lines.append(f"{name}{lab} {_num(getattr(obj, g))}")
    return "\n".join(lines) + "\n"


def _num(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(v)


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def stats_dict(
    metrics: CacheMetrics, arena: ArenaStats, cached_nodes: int, sliding: SlidingMetrics | None = None
) -> dict[str, object]:
    """Counters plus arena occupancy as one JSON-friendly dict (``HybridCacheManager.stats``);
    with ``sliding`` (a model with sliding-window groups) its counters too, else none of
    them (a model without sliding windows reports exactly what it did before they existed)."""
    out: dict[str, object] = dict(metrics.as_dict())
    if sliding is not None:
        out.update(sliding.as_dict())
    out.update(
        capacity_bytes=arena.capacity_bytes,
        used_bytes=arena.used_bytes,
        kv_bytes=arena.kv_bytes,
        state_bytes=arena.state_bytes,
        padding_bytes=arena.padding_bytes,
        fragmentation_bytes=arena.fragmentation_bytes,
        utilisation=arena.utilisation,
        cached_nodes=cached_nodes,
    )
    return out
