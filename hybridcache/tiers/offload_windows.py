"""Sliding-window groups and the offload tiers: which loaded prefix a hit could use.

Tiers store and load a unit's **full-attention KV and snapshots only**: a sliding-window
group's pages (event kind ``"sliding"``) are never demoted, as they are not a unit's KV
(a unit's entry holds one page per full-attention group; storing a sliding page under the
unit's key would load it as full KV later), and the window a hit needs is short-lived.

A hit that ends at unit ``e`` needs the sliding pages of units ``[e - reach, e)``
(:mod:`hybridcache.sliding`), and those exist only on the device, only for units whose full
KV is on the device (the cache drops a unit's sliding pages with its full KV). So a load
is worth doing only up to an end whose last ``reach`` units all have device KV: for
example a gap in the middle of a cached conversation, whose tail (and its windows) stayed
on the device. :func:`device_window_end` finds that end before anything is loaded; the
coordinator's rule (:meth:`~hybridcache.coordinator.GroupCoordinator.longest_hit`)
still decides the hit after the import, so a window evicted meanwhile only shortens it.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridcache.spec import AttentionKind, ModelSpec


def full_attention_groups(spec: ModelSpec) -> list[str]:
    """The groups a unit's KV entry holds, in the manager's order (sliding ones left out)."""
    return [g.name for g in spec.attention_groups if g.kind is not AttentionKind.SLIDING]


def window_reach(spec: ModelSpec, unit: int) -> int:
    """Units before a hit end whose sliding pages the hit needs (the widest window's);
    0 without sliding-window groups (or with one-token windows only)."""
    windows = [g.window for g in spec.attention_groups if g.kind is AttentionKind.SLIDING]
    return max((-(-(w - 1) // unit) for w in windows if w is not None), default=0)


def device_window_end(end: int, floor: int, reach: int, has_kv_on_device: Sequence[bool]) -> int:
    """The largest ``e <= end`` whose units ``[e - reach, e)`` all have KV on the device
    (so their sliding pages may be there too), scanned as the window cache scans its own
    entries; ``floor`` (the device hit) when that is no deeper."""
    if not reach:
        return end
    run, e = 0, end
    for u in range(end - 1, -1, -1):
        if has_kv_on_device[u]:
            run += 1
            if run >= reach:
                break
        else:
            run, e = 0, u
    return e if e > floor else floor  # a scan that reached unit 0: the window is cut there


def device_window_ends(ends: Sequence[int], reach: int, has_kv_on_device: Sequence[bool]) -> set[int]:
    """The ends among ``ends`` whose last ``reach`` units all have KV on the device."""
    if not reach:
        return set(ends)
    return {e for e in ends if all(has_kv_on_device[u] for u in range(max(e - reach, 0), e))}
