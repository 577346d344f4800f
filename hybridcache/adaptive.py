"""A self-tuning cache policy: the live cache follows the best of a few miniature caches.

Where a hybrid model's cache should save state snapshots depends on the workload and on the
budget: dense checkpoints pay off when many requests branch inside long shared prefixes and
memory is plentiful, and waste a third of the cache when prompts only ever extend the
previous turn. No fixed constant is right everywhere, so :class:`AdaptiveManager` measures
instead of guessing:

- a small set of *candidate* settings
  (:func:`~hybridcache.candidates.candidate_settings`) spans checkpoint density (none, and
  one every 3x the model's tokens-per-snapshot, the KV-equivalent of
  one snapshot: densities are relative to the model, not to a trace; denser ones come as
  spare checkpoints, :func:`spare_interval`), the rules (with and without the prompt-end
  snapshot, branch points, ``min_seen=2``) and value eviction's weighting
  (:func:`set_weighting`: GreedyDual-Size-Frequency, without the frequency term, or by
  recency alone), including the settings of the peers that lead;
- each candidate runs as a shadow cache (:mod:`hybridcache.shadow`) over a spatial sample of
  the finished requests (by chain key: :class:`~hybridcache.shadow.ChainKeys`), at the
  sampling rate times the live budget. The rate is the overhead budget split over the
  candidates (``OVERHEAD_BUDGET / candidates``: each candidate replays that share of the
  live work), raised where that would leave a shadow fewer than ``MIN_SHADOW_BLOCKS`` arena
  blocks (a state slot needs a whole block), sample fewer than ``MIN_FAMILIES`` prefix
  families or hold the KV of fewer than ``MIN_FAMILIES`` mean-sized requests. Where it is
  raised the shadows cost more than the budget while they run, so they run in phases: a token bucket earns ``OVERHEAD_BUDGET`` of every live request's
  units, a fed request spends its units once per candidate, the shadows pause when the
  bucket is empty and resume when it is half full again; the budget applies once the
  shadows have been compared on ``EXPLORE_PAIRS`` requests under pressure (a first
  decision, on a short trace too);
- once the current candidate's shadow is under pressure, every ``EVAL_EVERY`` sampled
  requests the live manager adopts, of the shadows under pressure (before, more snapshots
  always look better), the one that saved the most prefill FLOPs over a recent window,
  once it beat the current one by ``SWITCH_MARGIN`` at ``CONFIRM`` evaluations in a row
  (hysteresis: a tie or a short-lived lead never flips the policy back and forth) and,
  by ``Z_SWITCH`` standard errors of its paired per-request lead for miniature shadows
  (with the finite-population correction, ``sqrt(1 - rate)``), and by ``Z_FLOOR`` at any
  rate (exact shadows know the past, not the requests to come).
  Beside that count, after every fed request a sequential test (:mod:`hybridcache.decision`)
  adopts a candidate whose paired lead, counted from its own pressure onset, clears a
  confidence sequence's boundary: a clear lead is taken without waiting out the count. The
  window decays by the KV bytes the requests' prompts would occupy, ``WINDOW_FILLS``
  shadow budgets' worth: long enough to see the cache turn over, short enough to follow a
  shift of the same sizes;
- a change of workload that moves the requests' sizes, or a sustained fall of the live hits
  (:mod:`hybridcache.shift`), makes it forget what it was taught: the retired candidates
  come back, scores and leads start from zero, the shadows explore again (``_after_shift``);
  a fall during the exploration brings the retired candidates back and keeps the evidence,
  which the shadows gathered as the hits fell (``_after_drop``).

Select it with ``CacheConfig(admission="adaptive")``: :class:`HybridCacheManager` returns an
:class:`AdaptiveManager` for that setting, so engines and the simulator get it by name.
What it costs: while the shadows run, every sampled request is replayed once per candidate
(bookkeeping only); the budget holds the long-run average (docs/adaptive.md).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

from hybridcache.adaptive_report import adaptive_stats
from hybridcache.admission import AdmissionPolicy
from hybridcache.adoption import carry_seen, set_weighting
from hybridcache.candidates import BASE_RULES as BASE_RULES
from hybridcache.candidates import MARCONI_CANDIDATE as MARCONI_CANDIDATE
from hybridcache.candidates import SPARE_DENSITY as SPARE_DENSITY
from hybridcache.candidates import Candidate as Candidate
from hybridcache.candidates import candidate_settings, spare_interval
from hybridcache.config import CacheConfig
from hybridcache.decision import PairTable, anytime_threshold, upper_bound
from hybridcache.errors import ConfigError
from hybridcache.manager import HybridCacheManager
from hybridcache.requests import Request
from hybridcache.sample_rate import FAMILY_CHECK_EVERY as FAMILY_CHECK_EVERY
from hybridcache.sample_rate import FOOTPRINT_FIRST_CHECK as FOOTPRINT_FIRST_CHECK
from hybridcache.sample_rate import MAX_COUNTED_FAMILIES as MAX_COUNTED_FAMILIES
from hybridcache.sample_rate import MIN_FAMILIES as MIN_FAMILIES
from hybridcache.sample_rate import SampleRate
from hybridcache.seen_prefixes import fit_record
from hybridcache.shadow import KEY_SPACE, ChainKeys, PairedDifference, ShadowCache
from hybridcache.shadow_backlog import Backlog, Sampled, backlog_for
from hybridcache.shift import DropDetector, ShiftDetector
from hybridcache.spec import ModelSpec

ADAPTIVE = "adaptive"
#: The shadows' bookkeeping as a fraction of the live manager's (in units handled): the
#: issue's bound on added time per request is 15 %; the rest is the manager's own sampling
#: step. It sets the sampling rate (``budget / candidates`` where that leaves a shadow
#: ``MIN_SHADOW_BLOCKS``) and, where the rate must be higher, how often the shadows run.
OVERHEAD_BUDGET = 0.10
#: Arena blocks a shadow keeps at least (a state slot takes a whole block, so a coarser
#: miniature mis-models the KV/state trade: at 16 blocks the shadows of 300 chat requests at
#: 1 GiB missed the lead of the no-prompt-end candidate that 48 blocks found).
MIN_SHADOW_BLOCKS = 48
#: The bucket's size: this many fills of every shadow.
BURST_FILLS = 1
#: The shadows explore outside the budget until they were compared on this many requests
#: under pressure (four rounds of the count rule's confirmations as they were, 6 x 8; two
#: rounds left agent and mixed at 2 GiB, 300 requests, 0.087 and 0.049 below their best
#: candidate): a first decision even on a short trace; its cost amortises over a long one.
EXPLORE_PAIRS = 192
EVAL_EVERY = 8
#: Beside the count rule, a sequential test after every fed request
#: (:meth:`AdaptiveManager._take_clear_lead`): a lead that clears a confidence sequence's
#: boundary at level ``ALPHA`` (:func:`~hybridcache.decision.anytime_threshold`, mixture
#: width ``MIN_PAIRS``) is adopted at once. Off, the manager decides as before (tests).
SEQUENTIAL = True
ALPHA = 0.05
#: ... and, where the shadows are miniatures (rate < 1), the lead must not be sampling
#: noise: its mean per request (a paired sample: every shadow saw the request) this many
#: standard errors above zero over at least MIN_PAIRS requests, with the finite-population
#: correction of sampling without replacement (``Z_SWITCH * sqrt(1 - rate)``): a shadow that
#: sees all but a few of the requests (rate 0.98 at 2 GiB: 48 of 49 blocks) has almost no
#: sampling error (with the full test at rate 1, 300 chat requests at 1 GiB never switched
#: to the candidate that was 0.02 better; the bound never falls below :data:`Z_FLOOR`). Without the
#: test, shadows that hit on a handful of Mooncake's 121 sampled requests at 8 GiB switched
#: on those (0.097 against the fixed setting's 0.109; at that rate, 0.25, the corrected
#: bound is 1.73, and it still does not switch).
Z_SWITCH = 2.0
MIN_PAIRS = 24.0
#: ... and, whatever the rate, the lead must stand one standard error above zero. The
#: correction above is about the requests *seen* (a shadow at rate 1 knows their figures
#: exactly); a switch is a bet on the requests to come, and the spread of the paired
#: per-request difference is the workload's own noise, which no rate removes. Without it,
#: exact shadows switched on any lead over the 0.3 % margin held for 24 requests:
#: qwen3-next-80b mixed:9 at 1 GiB switched five times in 200 requests (to a setting
#: that ends at 0.19 as a fixed policy) and ended at 0.263 against its starting
#: setting's 0.329 (0.314 with the floor). One standard error, not ``Z_SWITCH``: the
#: full test at rate 1 never switched on 300 chat requests at 1 GiB where a candidate was
#: 0.02 better (docs/results.md, "A floor under the z test").
Z_FLOOR = 1.0
#: The count rule's hysteresis: the lead must hold at this many evaluations in a row, over
#: about ``MIN_PAIRS`` fed requests, the sample the z test asks for at least. Six (48
#: requests), with the full z test, decided later than the evidence allowed: 3 with the
#: corrected test gained +0.0030 / +0.0033 / +0.0058 / +0.0023 mean hit on seeds 9-12 /
#: 5-8 / 13-16 / 17-20 (the last never used for choosing), and doubled the switches (0.37
#: -> 0.61 a cell; docs/results.md, "Deciding sooner").
CONFIRM = int(MIN_PAIRS) // EVAL_EVERY
SWITCH_MARGIN = 0.03
#: Racing: a candidate whose paired lead over the current one is negative and has an
#: anytime upper bound (:func:`~hybridcache.decision.upper_bound`, level ``ALPHA``) below
#: what a switch needs is *retired*: no longer replayed, so that the shadows' work goes to
#: the candidates that may still win. It re-enters, with a copy of the current candidate's
#: shadow cache, once the window has turned over (its decay since retirement fell below
#: ``exp(-REENTER_FILLS)``: the evidence that retired it is then mostly forgotten and the
#: workload may have shifted), and competes once it has turned that cache over
#: (:meth:`~hybridcache.shadow.ShadowCache.inherit`). Measured (docs/results.md,
#: "Racing"): the same decisions on all 200 cells of the generated sweeps (195 since
#: ``recency`` ranks by tick; mean hit unchanged on seeds 9-12, +0.0003 on 5-8), the
#: shadows' work cut where they run long (agent at 1 GiB 7.0 -> 2.9 of the live work).
#: Without the sign test, a tie (two caches that held the same so far) was retired and
#: agentic seed 8 at 1 GiB lost 0.085. Off, every candidate is replayed on every sampled
#: request (tests).
RETIRE = True
REENTER_FILLS = 1.0
#: The margin when the shadows see every request (rate 1): no sampling error to allow for;
#: between the two, the margin falls linearly with the rate.
EXACT_MARGIN = 0.003
WINDOW_FILLS = 16.0
#: Whether a change of the requests' sizes or a fall of the live hits (:mod:`hybridcache.shift`)
#: makes the manager forget what it was taught (:meth:`AdaptiveManager._after_shift`).
#: Off, the window, the retirements and the budget carry over a change (tests).
SHIFT_DETECTION = True
class AdaptiveManager(SampleRate, HybridCacheManager):
    """:class:`HybridCacheManager` whose admission rules follow the best shadow candidate.

    ``switches`` lists ``(finished requests, candidate name)`` for every adoption, the
    first one included; ``current`` names the candidate in force.
    """

    def __new__(cls, *args: object, **kwargs: object) -> AdaptiveManager:
        # HybridCacheManager.__new__ picks the class from the config and takes no ``rate``.
        return object.__new__(cls)

    def __init__(self, spec: ModelSpec, capacity_bytes: int, config: CacheConfig | None = None,
                 *, rate: float | None = None):
        """``rate``: the shadows' sampling rate in (0, 1]; ``None`` (the default, what
        ``CacheConfig(admission="adaptive")`` gives) sets it from the overhead budget."""
        if rate is not None and not 0.0 < rate <= 1.0:
            raise ConfigError(f"rate must be in (0, 1], got {rate!r}")
        cfg = config or CacheConfig(admission=ADAPTIVE)
        self.candidates = candidate_settings(spec, cfg.hash_unit)
        first = self.candidates[0]
        super().__init__(spec, capacity_bytes, replace(cfg, admission=first.admission, min_seen=first.min_seen))
        set_weighting(self, self.candidates[0].weighting)
        #: Whether requests' output tokens are known (appended before free). The last
        #: request that computed past its prompt decides; while they are not, the turn-end
        #: rule is off in the live cache: a state after outputs no later prompt can be
        #: matched against (block-level traces) only holds a slot while the request runs,
        #: and the shadows, replaying what was computed and known, never see it. It starts
        #: on, as engines append outputs: starting off cost 0.08 of hit rate on docs at
        #: 1 GiB (one missing turn-end state on the first request changed what a 24-block
        #: cache kept from then on).
        self.outputs_known = True
        self.spare_interval = spare_interval(spec, cfg.hash_unit)
        self._rules = self.admission
        self._use(self._rules)
        self.adaptive_config = cfg
        self.current = first.name
        self.switches: list[tuple[int, str]] = [(0, self.current)]
        self._lead: tuple[str | None, int] = (None, 0)
        self.finished = 0
        self.sampled = 0
        self._since_eval = 0
        self._capacity = int(capacity_bytes)
        blocks = max(1, self.layout.num_blocks)
        k = len(self.candidates)
        self.rate = 1.0 if k < 2 else min(1.0, max(OVERHEAD_BUDGET / k, MIN_SHADOW_BLOCKS / blocks))
        if rate is not None:
            self.rate = float(rate)
        self.keys = ChainKeys()
        self._keys_seen: set[bytes] = set()  # chain keys of finished requests (counted up to a cap)
        self._keys_before = 0  # their count at the last check
        #: Whether the shadows are fed now (the budget's phases) and the bucket's units.
        self.running = True
        self.shadow_units = 0
        self.live_units = 0
        #: CPU seconds spent replaying requests into the shadows (``adaptive_stats``): what
        #: the shadows cost in time, apart from the live cache's own work.
        self.shadow_seconds = 0.0
        #: Finished counts at changes of sizes and at falls of live hits (hybridcache.shift).
        self.shift_detector, self.drop_detector = ShiftDetector(), DropDetector()
        self.shifts: list[int] = []
        self.drops: list[int] = []
        #: Tokens computed by the finished requests (their mean KV sets the rate's
        #: footprint floor, :meth:`_check_footprint`) and when it is checked next.
        self.computed_tokens = 0
        self._footprint_check = FOOTPRINT_FIRST_CHECK
        self.shadows: list[ShadowCache] = []
        self._build_shadows()

    def _build_shadows(self) -> None:
        """Fresh shadows at the current rate (cold: they warm up on the next requests)."""
        self.shadows = []
        self._families: set[bytes] = set()
        self._checked_finished = self.finished
        self._pressured = 0  # requests fed while the current shadow was under pressure
        #: ``(finished, sampled)`` when the exploration last ended (None while it runs).
        self.explored: tuple[int, int] | None = None
        #: Retired shadows (index -> decay of the window since retirement).
        self._retired: dict[int, float] = {}
        self.retirements = self.reentries = 0
        if len(self.candidates) < 2:  # nothing to choose (a model without state): no shadows
            self._backlog, self._burst, self._credit, self._resume_credit = Backlog(0, waiting=False), 0, 0.0, 0.0
            return
        cap = max(int(self._capacity * self.rate), self.layout.block_bytes * 2)
        unit_bytes = self.index.node_kv_bytes or self.index.snap_bytes or 1
        # Unscaled shared prefixes may take a family's share of a shadow (ChainKeys).
        self.keys.budget = (math.inf if self.rate >= 1.0
                            else cap / unit_bytes / MIN_FAMILIES / (1.0 - self.rate))
        self._burst = len(self.candidates) * BURST_FILLS * max(1, cap // unit_bytes)
        self._resume_credit = self._burst / 2  # where paused shadows run again (half the bucket)
        self._under_pressure = False
        self._pairs = PairTable(len(self.candidates))
        #: The window's weight of fed requests (the current shadow's mean saving per
        #: request is its score over this).
        self._fed_weight = 0.0
        self._credit = float(self._burst)
        base = replace(self.adaptive_config, tenant_quotas=None)
        for c in self.candidates:
            shadow = ShadowCache(c.name, self.spec, cap, replace(base, admission=c.admission, min_seen=c.min_seen))
            set_weighting(shadow.mgr, c.weighting)
            shadow.weighting = c.weighting
            self._pair_twin(shadow)
            self.shadows.append(shadow)
        self._backlog = backlog_for([s.admission for s in self.shadows], self._burst, getattr(self, "_backlog", None))
        kv = self.spec.kv_bytes_per_token or 1
        self._decay_per_token = kv / (WINDOW_FILLS * cap)

    def _pair_twin(self, shadow: ShadowCache) -> None:
        """Let ``shadow`` share the cache of an earlier shadow whose setting differs from
        its own only in the interval rule (:meth:`ShadowCache.follow`): one replay instead
        of two until a request is long enough to tell them apart."""
        mine = shadow.admission
        for host in self.shadows:
            theirs = host.admission
            if (host.host is None and host.weighting == shadow.weighting
                    and replace(theirs, interval=0) == replace(mine, interval=0)):
                fork_at = min((n for n in (mine.interval, theirs.interval) if n), default=0)
                if fork_at:
                    shadow.follow(host, fork_at)
                return

    def _release(self, req: Request, finished: bool) -> None:
        """:meth:`free`'s release (the request is out of ``requests``), after a finished
        request is counted for the shadows (:meth:`_sample`), before its entries go."""
        if finished and req.counted and self.shadows:
            if SHIFT_DETECTION and self.drop_detector.add(req.hit_tokens / max(1, req.prompt_len)):
                self._after_drop()  # the live cache saves less: explore again
            digests = req.hasher.digests
            computed, prompt_len = req.num_computed, req.prompt_len
            # A request freed before its prompt was computed (chunked prefill cut short) is
            # not a request the shadows can replay.
            if computed > prompt_len and self.outputs_known != (req.num_tokens > prompt_len):
                self.outputs_known = not self.outputs_known
                self._use(self._rules)
            total = computed if computed < req.num_tokens else req.num_tokens
            if digests and total >= prompt_len:
                self._sample(digests, prompt_len, total, req.tenant)
        super()._release(req, finished)

    def _use(self, rules: AdmissionPolicy) -> None:
        """Make ``rules`` the live admission (turn-end only once outputs are known), with
        spare checkpoints (:func:`spare_interval`) and the spare suffix start (a sibling's
        resume point, :mod:`hybridcache.admission`)."""
        self._rules = rules
        live = rules if self.outputs_known else replace(rules, turn_end=False)
        self.admission = replace(live, spare_interval=self.spare_interval, spare_suffix_start=True)

    def _sample(self, digests: list[bytes], prompt_len: int, total: int, tenant: str | None) -> None:
        """Count a finished request, feed it to the shadows if its chain is sampled and
        the budget allows, and check the sample's families now and then."""
        self.finished += 1
        if SHIFT_DETECTION and self.shift_detector.add(prompt_len) and self.shadows:
            self._after_shift(self.shifts)
        key = self.keys.key(digests)
        seen = self._keys_seen
        if len(seen) < MAX_COUNTED_FAMILIES:
            seen.add(key)
        work = len(digests) + 1
        self.live_units += work
        # Runs for every finished request: min() and sample_key() written out (same values).
        credit, burst = self._credit + OVERHEAD_BUDGET * work, self._burst
        if credit >= burst:
            credit = burst
        self._credit = credit
        if not self.running and credit >= self._resume_credit:
            self.running = True
        exploring = self._pressured < EXPLORE_PAIRS
        if (self.running or exploring) and int.from_bytes(key[:8], "little") / KEY_SPACE < self.rate:
            if len(self._families) < MIN_FAMILIES:
                self._families.add(key)
            self._backlog.push(Sampled(list(digests), prompt_len, total, tenant, work))
        if self._backlog.units:
            for r in self._backlog.release(self.index):
                self._feed(r)
        self.computed_tokens += total
        if self.finished >= self._footprint_check:
            self._check_footprint()
        if self.finished - self._checked_finished >= FAMILY_CHECK_EVERY:
            self._check_families()

    def _feed(self, r: Sampled) -> None:
        """Replay a sampled request into the shadows, out of the budget's bucket."""
        exploring = self._pressured < EXPLORE_PAIRS
        cost = r.units * (len(self.shadows) - len(self._retired))
        self._credit -= cost
        self.shadow_units += cost
        t0 = time.process_time()
        self._observe(r.digests, r.prompt_len, r.total, r.tenant)
        self.shadow_seconds += time.process_time() - t0
        if self._credit < 0 and not exploring:
            self.running = False

    def _observe(self, digests: list[bytes], prompt_len: int, total: int, tenant: str | None) -> None:
        self.sampled += 1
        decay = math.exp(-prompt_len * self._decay_per_token)
        prompt = digests[: prompt_len // self.unit]  # shared by the shadows (only read)
        retired = self._retired
        active = [s for i, s in enumerate(self.shadows) if i not in retired]
        for s in active:
            if s.host is not None and total >= s.fork_at:
                s.fork()
        for s in active:
            if s.host is None:
                s.feed(digests, prompt_len, total, tenant, decay, prompt)
        for s in active:
            if s.host is not None:
                s.mirror(prompt_len, decay)
        for i, s in enumerate(self.shadows):
            if i not in self._pairs.rows and i not in retired and s.evictions:
                self._pairs.start(i)
        idle = frozenset(retired)
        self._pairs.add([s.last for s in self.shadows], decay, idle)
        self._fed_weight = self._fed_weight * decay + 1.0
        if self._under_pressure:
            self._pressured += 1
            if self._pressured == EXPLORE_PAIRS:
                self.explored = (self.finished, self.sampled)
        cur = self._shadow(self.current).last
        for s in active:
            s.pair.add(s.last - cur, decay)
        if RETIRE:
            self._race(decay)
        for s in active:
            if s.inherited_until and s.evicted_bytes >= s.inherited_until:
                self._owns_its_cache(s)
        self._since_eval += 1
        if SEQUENTIAL and self._take_clear_lead():
            return
        if self._since_eval >= EVAL_EVERY:
            self._since_eval = 0
            self._follow_best()

    def _shadow(self, name: str) -> ShadowCache:
        return next(s for s in self.shadows if s.name == name)

    def _current_index(self) -> int:
        """The index in ``shadows`` of the candidate in force."""
        return next(i for i, s in enumerate(self.shadows) if s.name == self.current)

    def _take_clear_lead(self) -> bool:
        """Adopt, after any fed request, the best-scoring candidate whose paired lead over
        the current one clears the confidence sequence's boundary (:mod:`hybridcache.decision`).

        A candidate is compared from its own pressure onset (:class:`PairTable`): before
        its cache is full its savings overstate what it keeps once it must evict, while the
        current candidate's not being under pressure yet only overstates the current one.
        The boundary holds at every sample size at once, so testing after every request
        adds no false switches, and a clear lead is taken without waiting out
        :meth:`_follow_best`'s count of confirmations.
        """
        ci = self._current_index()
        cur = self.shadows[ci]
        best: ShadowCache | None = None
        for i, s in enumerate(self.shadows):
            lead = self._pairs.lead(i, ci) if i not in self._retired and not s.inherited_until else None
            if (lead is None or s.score <= cur.score * (1.0 + self._margin()) or (best is not None and s.score <= best.score)
                    or lead.z(MIN_PAIRS) < anytime_threshold(lead.n, ALPHA, MIN_PAIRS)):
                continue
            best = s
        if best is None:
            return False
        self._adopt(best)
        return True

    def _race(self, decay: float) -> None:
        """Retire the candidates that cannot win on the evidence (:data:`RETIRE`) and bring
        back those retired a window ago.

        A candidate is retired when its paired lead over the current one (from its own
        pressure onset, :class:`PairTable`) is negative and has an anytime upper bound below
        the switch margin times the current candidate's mean saving per request: it can
        reach neither switch rule (both ask for that margin) unless the workload changes.
        Its twin, if one follows it, is forked first. A retired candidate comes back once the window
        decayed by ``exp(-REENTER_FILLS)`` since: with a copy of the current candidate's
        shadow cache (what switching to it now would start from) and the current one's
        score, so that it must earn a lead from there.
        """
        ci = self._current_index()
        cur = self.shadows[ci]
        retired = self._retired
        for i in list(retired):
            retired[i] *= decay
            if retired[i] < math.exp(-REENTER_FILLS):
                self._reenter(i, cur)
        need = self._margin() * cur.score / self._fed_weight if self._fed_weight else 0.0
        for i, s in enumerate(self.shadows):
            if i == ci or i in retired or s is cur.host:
                continue
            lead = self._pairs.lead(i, ci)
            # Behind, not only no better: a lead of zero with no spread is two caches that
            # held the same so far, which says nothing of when they part.
            if lead is None or lead.s1 >= 0 or upper_bound(lead, ALPHA, MIN_PAIRS) >= need:
                continue
            for j, t in enumerate(self.shadows):
                if t.host is s and j not in retired:
                    t.fork()
            retired[i] = 1.0
            self.retirements += 1

    def _reenter(self, i: int, cur: ShadowCache) -> None:
        """Replay shadow ``i`` again, from a copy of the current candidate's cache."""
        del self._retired[i]
        self.reentries += 1
        s = self.shadows[i]
        s.inherit(cur)
        set_weighting(s.mgr, s.weighting)
        s.score, s.last, s.pair = cur.score, cur.last, PairedDifference()
        self._pairs.restart(i)

    def _owns_its_cache(self, s: ShadowCache) -> None:
        """A re-entered shadow has turned its inherited cache over (:meth:`ShadowCache.inherit`):
        from now on it competes, from the current candidate's score and with its paired
        leads counted afresh, as after its re-entry."""
        s.inherited_until = 0.0
        s.score, s.pair = self._shadow(self.current).score, PairedDifference()
        self._pairs.restart(self.shadows.index(s))

    def _after_shift(self, record: list[int], forget: bool = True) -> None:
        """Forget what the old workload taught, once a change is detected
        (:mod:`hybridcache.shift`): every retired candidate comes back from a copy of the
        current one's cache (what switching to it now would start from), every score and
        paired lead starts again from zero (the old workload's savings would outweigh the
        new one's for 16 shadow fills), and the shadows explore again outside the budget.
        The caches stay; the chain keys' budget restarts. ``record``: where to log it.
        ``forget`` False: the retired candidates come back and the shadows run, the scores,
        leads and exploration count stay (:meth:`_after_drop`)."""
        record.append(self.finished)
        cur = self._shadow(self.current)
        for i in list(self._retired):
            self._reenter(i, cur)
        self.running = True
        if not forget:
            return
        self.keys.held = 0
        self._reset_pairs()
        for i, s in enumerate(self.shadows):
            s.score = 0.0
            if i in self._pairs.rows:
                self._pairs.restart(i)
        self._fed_weight = 0.0
        self._lead = (None, 0)
        self._pressured, self.explored = 0, None

    def _after_drop(self) -> None:
        """A sustained fall of the live hits (:class:`~hybridcache.shift.DropDetector`): the
        setting in force may be losing. After the exploration the shadows' evidence is old
        (the budget paused them), so the manager forgets and explores again. During the
        exploration they were fed every sampled request: their scores and paired leads are
        the evidence of the fall itself, and forgetting them only delays the switch it calls
        for, so only the retired candidates come back (nemotron-h-8b, agentic at 2 GiB: a
        fall flagged at request 151, the switch at 155 instead of 178, 0.569 -> 0.618;
        docs/results.md, "Models never swept")."""
        self._after_shift(self.drops, forget=self._pressured >= EXPLORE_PAIRS)

    def _margin(self) -> float:
        return EXACT_MARGIN + (SWITCH_MARGIN - EXACT_MARGIN) * (1.0 - self.rate)

    def _z_needed(self) -> float:
        """The count rule's z bound: :data:`Z_SWITCH` with the finite-population correction
        (a sample of ``rate`` of the requests, drawn without replacement), never below
        :data:`Z_FLOOR` (the requests to come are not in any sample)."""
        return max(Z_SWITCH * math.sqrt(1.0 - self.rate), Z_FLOOR)

    def _follow_best(self) -> None:
        """Adopt the leading candidate once it led by the margin at ``CONFIRM`` evaluations
        in a row (an early lead on a few requests, before the cache is full, is noise).

        Only shadows under pressure (that evicted) compare, and only once the current
        candidate's is: until a cache must evict, more snapshots always look better. A
        shadow that does not fill (``seen-twice-recency`` saves few states: at 8 GiB on
        agent it first evicted after 250 sampled requests, the others by 50) takes part
        once it does, and does not hold the others' comparison back: waiting on every
        shadow doubled the exploration there (233 -> 425 sampled requests).

        It must also be significant: each shadow keeps the paired per-request difference
        against the current candidate (:class:`~hybridcache.shadow.PairedDifference`), and
        the leader's must be :meth:`_z_needed` standard errors above zero (at least
        :data:`Z_FLOOR`, for exact shadows too). As the only rule (at
        3 standard errors) it never switched on 300 chat requests at 1 GiB where the
        margin rule does; as a second condition it stops switches on a handful of hits.
        """
        cur = self._shadow(self.current)
        self._under_pressure = bool(cur.evictions)
        if not self._under_pressure:
            # A switch to dense checkpoints before pressure, measured: 0.009 lost on chat at
            # 8 GiB once pressure came (the entries a setting made stay after it is left).
            # Comparing without pressure (with a clear paired lead adopted at once) was
            # tried and measured on unseen seeds (docs/results.md, "Adaptive policy"): it
            # did not help on either seed set (behind 25 -> 26 and 24 -> 26 of 100 cells),
            # losing most where an early lead before the cache fills was adopted (agentic
            # at 1 GiB).
            self._lead = (None, 0)
            self._reset_pairs()
            return
        best = max((s for i, s in enumerate(self.shadows)
                    if i not in self._retired and not s.inherited_until and s.evictions),
                   key=lambda s: s.score)
        if best is cur or best.score <= cur.score * (1.0 + self._margin()):
            self._lead = (None, 0)
            return
        name, times = self._lead
        self._lead = (best.name, times + 1 if name == best.name else 1)
        if self._lead[1] >= CONFIRM and best.pair.z(MIN_PAIRS) >= self._z_needed():
            self._adopt(best)

    def _adopt(self, best: ShadowCache) -> None:
        """Make ``best``'s setting the live one (cached entries stay)."""
        self._lead = (None, 0)
        self._reset_pairs()
        self._use(best.admission)
        fit_record(self, keep_unused=True)
        set_weighting(self, best.weighting)
        self.config = replace(self.config, admission=best.config.admission, min_seen=best.config.min_seen)
        self.current = best.name
        self.switches.append((self.finished, best.name))
        if best.config.min_seen > 1:
            carry_seen(self, (best.host or best).mgr)

    def _reset_pairs(self) -> None:
        for s in self.shadows:
            s.pair = PairedDifference()

    def _lead_z(self, i: int) -> float:
        """Shadow ``i``'s paired lead over the current candidate, in standard errors."""
        ci = self._current_index()
        lead = self._pairs.lead(i, ci) if i != ci else None
        return lead.z(1.0) if lead is not None else 0.0

    def check_invariants(self) -> None:
        """The manager's invariants (:mod:`hybridcache.invariants`) and the backlog's."""
        super().check_invariants()
        self._backlog.sanity_check()
        assert (self.explored is None) == (self._pressured < EXPLORE_PAIRS), "exploration end"

    def adaptive_stats(self) -> dict[str, object]:
        """What the adaptation did (:func:`hybridcache.adaptive_report.adaptive_stats`)."""
        return adaptive_stats(self)
