"""The adaptive policy's sampling rate, raised where the sample cannot stand for the workload.

The rate starts at the overhead budget's share (:mod:`hybridcache.adaptive`); two checks
raise it (the shadows then restart cold, at the new rate): too few sampled families (a
sample of one or two sessions is not one of the workload), and a miniature too small for
the requests it must hold (one that holds one or two long contexts ranks settings by which
of them it happened to keep). Kept apart from the adaptive manager: these run every few
hundred requests and change only the rate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: How often (finished requests) the sample's families are counted: with fewer than
#: MIN_FAMILIES sampled families the sample is not one of the workload, and the rate is
#: raised to ``2 x MIN_FAMILIES / families seen`` (SHARDS scales the budget by the rate,
#: which holds for many families; one family shared by every request costs the shadow its
#: full size whatever the rate).
FAMILY_CHECK_EVERY = 256
MIN_FAMILIES = 8
#: Families counted at most (the count only has to reach ``2 x MIN_FAMILIES / rate``).
MAX_COUNTED_FAMILIES = 1 << 16
#: A miniature must also hold the KV of ``MIN_FAMILIES`` requests of the mean size computed
#: so far (what ``MIN_SHADOW_BLOCKS`` is in blocks, in requests): a shadow that holds one or
#: two long contexts ranks settings by which of them it happened to keep. Measured: agentic
#: sessions, ``qwen3-next-80b`` at 4 GiB, rate 0.44 (48 of 108 blocks): the shadows ranked
#: ``checkpoints-3x`` first (0.900 against 0.893), while at full size ``checkpoints-none``
#: leads (0.920 against 0.867) and the policy never switched. Checked after 16, 32, 64, ...
#: finished requests; where it is short the rate is raised (shadows rebuilt cold) to twice
#: the floor, as the family check does, so that growing requests do not restart them at
#: every check, and only where that at least doubles the rate: a rebuild costs the
#: shadows' warm-up, and above one half there is little resolution to gain (at 2 GiB, 48 of
#: 49 blocks, a raise to 1 cost the kind-switch test's chat part 0.757 -> 0.667).
FOOTPRINT_FIRST_CHECK = 16


class SampleRate:
    """Raise the sampling rate where the sample is too thin (mixed into the adaptive
    manager, which provides the fields below and :meth:`_build_shadows`)."""

    rate: float
    finished: int
    computed_tokens: int
    spec: Any
    index: Any
    _capacity: int
    _checked_finished: int
    _keys_seen: set[bytes]
    _keys_before: int
    _families: set[bytes]
    _footprint_check: int
    _build_shadows: Callable[[], None]

    def _check_families(self) -> None:
        """Raise the rate when the sample holds fewer than ``MIN_FAMILIES`` families: to
        ``2 x MIN_FAMILIES`` of the families seen so far (the shadows restart cold).

        Only once the live cache has evicted (before, there is nothing to decide) and the
        family count has levelled off (it grew by less than a quarter over the last span):
        while new families keep coming (sessions) the sample fills up at the same rate."""
        self._checked_finished = self.finished
        seen, before = len(self._keys_seen), self._keys_before
        self._keys_before = seen
        if self.rate >= 1.0 or len(self._families) >= MIN_FAMILIES:
            return
        if not self.index.evictions["kv"] + self.index.evictions["state"] or seen - before > before / 4:
            return
        want = min(1.0, 2.0 * MIN_FAMILIES / max(1, seen))
        if want > self.rate:
            self._raise_rate(want)

    def _raise_rate(self, rate: float) -> None:
        """Sample at ``rate`` from now on: the shadows are rebuilt at it, cold (a sample
        of other chain keys cannot be grown into from the old one's caches)."""
        self.rate = rate
        self._build_shadows()

    def _check_footprint(self) -> None:
        """Raise the rate when a shadow holds the KV of fewer than ``MIN_FAMILIES`` mean
        requests: to twice that (the shadows restart cold), where that at least doubles
        it. Checked at doubling request counts: the mean settles, and each check that
        raises costs the shadows' warm-up."""
        self._footprint_check *= 2
        mean_bytes = self.computed_tokens / self.finished * (self.spec.kv_bytes_per_token or 1)
        want = min(1.0, 2.0 * MIN_FAMILIES * mean_bytes / self._capacity)
        if self.rate * self._capacity < MIN_FAMILIES * mean_bytes and want >= 2.0 * self.rate:
            self._raise_rate(want)
