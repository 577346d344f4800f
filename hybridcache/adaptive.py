"""A self-tuning cache policy: the live cache follows the best of a few miniature caches.

Where a hybrid model's cache should save state snapshots depends on the workload and on the
budget: dense checkpoints pay off when many requests branch inside long shared prefixes and
memory is plentiful, and waste a third of the cache when prompts only ever extend the
previous turn. No fixed constant is right everywhere, so :class:`AdaptiveManager` measures
instead of guessing:

- a small set of *candidate* settings (:func:`candidate_settings`) spans
  checkpoint density (none, and one every 3x, 1x and 1/16x the model's tokens-per-snapshot,
  the KV-equivalent of one snapshot: densities are relative to the model, not to a trace)
  and the rules (with and without the prompt-end snapshot), and value eviction with and
  without its frequency term (:func:`set_frequency_weighting`);
- each candidate runs as a shadow cache (:mod:`hybridcache.shadow`) over a spatial sample of
  the finished requests, at the sampling rate times the live budget. The rate is set so a
  shadow holds at least ``MIN_SHADOW_BLOCKS`` arena blocks (a state slot needs a whole
  block, so coarser shadows would mis-model the KV/state trade), and raised when the sample
  is skewed (few prefix families: a spatial sample of two system prompts is all or nothing);
- once every shadow is under pressure (before, more snapshots always look better), every
  ``EVAL_EVERY`` sampled requests the live manager adopts the candidate whose shadow
  saved the most prefill FLOPs over a recent window, once it beat the current one by
  ``SWITCH_MARGIN`` at ``CONFIRM`` evaluations in a row (hysteresis: a tie or a short-lived
  lead never flips the policy back and forth). The window
  decays by the KV bytes the requests' prompts would occupy, ``WINDOW_FILLS`` shadow
  budgets' worth: long enough to see the cache turn over, short enough to follow a shift.

Select it with ``CacheConfig(admission="adaptive")``: :class:`HybridCacheManager` returns an
:class:`AdaptiveManager` for that setting, so engines and the simulator get it by name.
What it costs: every sampled request is replayed once per candidate (bookkeeping only).
"""

from __future__ import annotations

import math
from dataclasses import replace

from hybridcache.manager import HybridCacheManager
from hybridcache.plans import CacheConfig
from hybridcache.shadow import ShadowCache, sample_key
from hybridcache.spec import ModelSpec

ADAPTIVE = "adaptive"
#: The rules every candidate but one keeps (prompt end, turn end, branch points).
BASE_RULES = "last-token+turn-end+branch-point"
#: Checkpoint spacings of the candidates, in the model's tokens-per-snapshot (0 = none).
DENSITIES = (3.0, 0.0, 1.0, 1.0 / 16)
MIN_SHADOW_BLOCKS = 48
EVAL_EVERY = 8
CONFIRM = 6
SWITCH_MARGIN = 0.03
#: The margin when the shadows see every request (rate 1): no sampling error to allow for;
#: between the two, the margin falls linearly with the rate.
EXACT_MARGIN = 0.003
WINDOW_FILLS = 16.0
#: How often (finished requests) the sample's share is checked against the rate, and the
#: factor by which it may stray before the rate is raised.
SKEW_CHECK_EVERY = 256
SKEW_FACTOR = 2.0
#: ... and at least this many sampled requests are expected in the span (below it, a
#: Poisson count strays by a factor of 2 too often to mean anything).
SKEW_MIN_EXPECTED = 32.0
#: A sample drawn from fewer than MIN_FAMILIES prefix families (first unit digests) after
#: FAMILY_CHECK_AFTER sampled requests is not a sample of the workload: the rate is raised.
#: SHARDS scales the budget by the rate, which holds for many families; a family shared by
#: every request (one system prompt) costs the shadow its full size whatever the rate.
MIN_FAMILIES = 8
FAMILY_CHECK_AFTER = 32


def _round_up(n: float, unit: int) -> int:
    return max(unit, -(-int(math.ceil(n)) // unit) * unit)


def candidate_settings(spec: ModelSpec, unit: int) -> list[tuple[str, str, bool]]:
    """``(name, admission, frequency weighting)`` of the candidates; the first is where the
    live cache starts (the fixed policy's setting).

    Densities are in the model's tokens-per-snapshot (the KV-equivalent of one snapshot);
    eviction is value eviction with or without frequency weighting (without it, KV runs of
    equal cost rank by recency: LRU-like over whole contexts, which long agent contexts with
    heavy-tailed think times favour).
    """
    if not spec.has_state or not spec.kv_bytes_per_token:
        return [("no-state", BASE_RULES, True)]
    tps = spec.snapshot_bytes / spec.kv_bytes_per_token

    def every(d: float) -> str:
        return BASE_RULES if d == 0 else f"{BASE_RULES}+interval:{_round_up(d * tps, unit)}"

    grid = ((3.0, True), (3.0, False), (0.0, True), (1.0, False), (1.0 / 16, False))
    out: list[tuple[str, str, bool]] = []
    for d, freq in grid:
        adm = every(d)
        name = ("checkpoints-none" if d == 0 else f"checkpoints-{d:g}x") + ("" if freq else "-recency")
        if (adm, freq) not in ((a, f) for _, a, f in out):
            out.append((name, adm, freq))
    out.append(("no-prompt-end", f"turn-end+branch-point+interval:{_round_up(3.0 * tps, unit)}", True))
    return out


def set_frequency_weighting(mgr: HybridCacheManager, freq: bool) -> None:
    """Turn value eviction's frequency term on or off (no-op for other policies): entries
    queued already keep their rank until they are touched again."""
    for q in (mgr.index.kv_q, mgr.index.snap_q):
        if hasattr(q, "freq"):
            q.freq = freq


class AdaptiveManager(HybridCacheManager):
    """:class:`HybridCacheManager` whose admission rules follow the best shadow candidate.

    ``switches`` lists ``(finished requests, candidate name)`` for every adoption, the
    first one included; ``current`` names the candidate in force.
    """

    def __init__(self, spec: ModelSpec, capacity_bytes: int, config: CacheConfig | None = None):
        cfg = config or CacheConfig(admission=ADAPTIVE)
        self.candidates = candidate_settings(spec, cfg.hash_unit)
        super().__init__(spec, capacity_bytes, replace(cfg, admission=self.candidates[0][1]))
        set_frequency_weighting(self, self.candidates[0][2])
        self.adaptive_config = cfg
        self.current = self.candidates[0][0]
        self.switches: list[tuple[int, str]] = [(0, self.current)]
        self.finished = 0
        self.sampled = 0
        self._since_eval = 0
        self._lead: tuple[str | None, int] = (None, 0)
        self._capacity = int(capacity_bytes)
        blocks = max(1, self.layout.num_blocks)
        self.rate = 1.0 if len(self.candidates) < 2 else min(1.0, MIN_SHADOW_BLOCKS / blocks)
        self.shadows: list[ShadowCache] = []
        self._build_shadows()

    def _build_shadows(self) -> None:
        """Fresh shadows at the current rate (cold: they warm up on the next requests)."""
        self.shadows = []
        self._families: set[bytes] = set()
        self._checked_finished = self.finished
        self._checked_sampled = self.sampled
        if len(self.candidates) < 2:
            return
        cap = max(int(self._capacity * self.rate), self.layout.block_bytes * 2)
        base = replace(self.adaptive_config, tenant_quotas=None)
        for name, adm, freq in self.candidates:
            shadow = ShadowCache(name, self.spec, cap, replace(base, admission=adm))
            set_frequency_weighting(shadow.mgr, freq)
            shadow.freq = freq
            self.shadows.append(shadow)
        kv = self.spec.kv_bytes_per_token or 1
        self._decay_per_token = kv / (WINDOW_FILLS * cap)

    def free(self, request_id: str, *, finished: bool = True) -> None:
        req = self.requests.get(request_id)
        if finished and req is not None and req.counted and self.shadows:
            self.finished += 1
            digests = req.hasher.digests
            total = min(req.num_computed, req.num_tokens)
            # A request freed before its prompt was computed (chunked prefill cut short) is
            # not a request the shadows can replay.
            if digests and total >= req.prompt_len and sample_key(digests[0]) < self.rate:
                if len(self._families) < MIN_FAMILIES:
                    self._families.add(digests[0])
                self._observe(digests, req.prompt_len, total, req.tenant)
                if self.sampled - self._checked_sampled >= FAMILY_CHECK_AFTER and len(self._families) < MIN_FAMILIES:
                    self._raise_rate()
            if self.finished - self._checked_finished >= max(SKEW_CHECK_EVERY, SKEW_MIN_EXPECTED / self.rate):
                self._check_skew()
        super().free(request_id, finished=finished)

    def _observe(self, digests: list[bytes], prompt_len: int, total: int, tenant: str | None) -> None:
        self.sampled += 1
        decay = math.exp(-prompt_len * self._decay_per_token)
        digests = list(digests)
        for s in self.shadows:
            s.feed(digests, prompt_len, total, tenant, decay)
        self._since_eval += 1
        if self._since_eval >= EVAL_EVERY:
            self._since_eval = 0
            self._follow_best()

    def _follow_best(self) -> None:
        """Adopt the leading candidate once it led by the margin at ``CONFIRM`` evaluations
        in a row (an early lead on a few requests, before the cache is full, is noise)."""
        if not all(s.mgr.index.evictions["kv"] + s.mgr.index.evictions["state"] for s in self.shadows):
            # Until every shadow is under pressure more snapshots always look better; a
            # switch to dense checkpoints then, measured: 0.009 lost on chat at 8 GiB once
            # pressure came (the entries a setting made stay after it is left).
            self._lead = (None, 0)
            return
        cur = next(s for s in self.shadows if s.name == self.current)
        best = max(self.shadows, key=lambda s: s.score)
        margin = EXACT_MARGIN + (SWITCH_MARGIN - EXACT_MARGIN) * (1.0 - self.rate)
        if best is cur or best.score <= cur.score * (1.0 + margin):
            self._lead = (None, 0)
            return
        name, times = self._lead
        self._lead = (best.name, times + 1 if name == best.name else 1)
        if self._lead[1] >= CONFIRM:
            self._lead = (None, 0)
            self.admission = best.admission
            set_frequency_weighting(self, best.freq)
            self.config = replace(self.config, admission=best.config.admission)
            self.current = best.name
            self.switches.append((self.finished, best.name))

    def _check_skew(self) -> None:
        """Raise the rate when the sampled share strays from it (too few prefix families
        for a spatial sample); the shadows restart cold at the new rate."""
        n = self.finished - self._checked_finished
        got = self.sampled - self._checked_sampled
        self._checked_finished, self._checked_sampled = self.finished, self.sampled
        expect = n * self.rate
        if self.rate < 1.0 and not expect / SKEW_FACTOR <= got <= expect * SKEW_FACTOR:
            self._raise_rate()

    def _raise_rate(self) -> None:
        if self.rate < 1.0:
            self.rate = min(1.0, self.rate * 4)
            self._build_shadows()

    def adaptive_stats(self) -> dict[str, object]:
        """What the adaptation did: the rate, the candidate in force, the shadows' figures."""
        return {
            "rate": self.rate,
            "current": self.current,
            "switches": list(self.switches),
            "sampled": self.sampled,
            "shadows": {s.name: {"admission": s.config.admission, "score": s.score,
                                 "hit_rate": s.hit_tokens / s.prompt_tokens if s.prompt_tokens else 0.0}
                        for s in self.shadows},
        }
