"""The adaptive policy (hybridcache.adaptive): selection by name, convergence to the best
fixed candidate on stationary workloads, and following a workload that changes kind.

"Best fixed candidate" is measured, not assumed: every candidate setting is replayed as a
fixed policy over the same trace, and the adaptive manager, which starts from the first
candidate and switches on what its shadow caches saw, must end within 0.005 of the best
one's token hit rate.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest

from hybridcache import adaptive, shadow_backlog
from hybridcache.adaptive import AdaptiveManager, candidate_settings, set_weighting, spare_interval
from hybridcache.decision import PairTable
from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.presets import get_preset
from hybridcache.sim.generate import generate, generate_change
from hybridcache.sim.replay import Replay
from hybridcache.sim.traces import Trace

ADAPTIVE = CacheConfig(hash_unit=16, admission="adaptive", eviction="value")


def _second_half(run: Replay) -> float:
    """Token hit rate over the trace's second half (after the adaptation had half of it)."""
    run.advance(len(run.trace.requests) // 2)
    hit, prompt = run.hit_tokens, sum(run.tally.prompt.values())
    run.advance()
    total = sum(run.tally.prompt.values()) - prompt
    return (run.hit_tokens - hit) / total if total else 0.0


def whole_trace(run: Replay) -> float:
    """Token hit rate over the whole trace."""
    run.advance()
    return run.hit_tokens / sum(run.tally.prompt.values())


def fixed_rates(trace: Trace, spec, capacity: int, measure: Callable[[Replay], float] = _second_half) -> dict[str, float]:
    """Token hit rate (second half unless ``measure`` says otherwise) of every candidate
    setting replayed as a fixed policy."""
    out = {}
    for c in candidate_settings(spec, 16):
        run = Replay(trace, spec, capacity, dataclasses.replace(ADAPTIVE, admission=c.admission, min_seen=c.min_seen))
        set_weighting(run.mgr, c.weighting)
        out[c.name] = measure(run)
    return out


def adaptive_rate(trace: Trace, spec, capacity: int) -> tuple[float, Replay]:
    run = Replay(trace, spec, capacity, ADAPTIVE)
    return _second_half(run), run


def test_selected_by_config(kimi):
    m = HybridCacheManager(kimi, 4 << 30, ADAPTIVE)
    assert isinstance(m, AdaptiveManager)
    first = HybridCacheManager(kimi, 4 << 30, CacheConfig(admission=m.candidates[0].admission)).admission
    # The first candidate's rules, with the live cache's spare checkpoints and its spare
    # suffix start (free room, or a demoted snapshot's slot).
    assert m.admission == dataclasses.replace(first, spare_interval=m.spare_interval, spare_suffix_start=True)
    assert first.turn_end and m.admission.tracks_suffixes
    assert type(HybridCacheManager(kimi, 4 << 30, CacheConfig())) is HybridCacheManager


def test_a_model_without_state_runs_with_no_shadows_and_reports_it(kimi):
    """Nothing to choose without state (one candidate): no shadows, nothing sampled, and
    ``adaptive_stats()`` still answers (it raised on the exploration count before)."""
    import numpy as np

    flat = dataclasses.replace(kimi, name="kimi/kv-only", state_groups=())
    m = HybridCacheManager(flat, 1 << 30, ADAPTIVE)
    m.add_request("a", np.arange(1, 401, dtype=np.uint32))
    m.allocate("a", 400)
    m.commit("a", 400)
    m.free("a")
    st = m.adaptive_stats()
    assert st["shadows"] == {} and st["sampled"] == 0 and not st["waiting"] and st["backlog"] == 0
    assert st["explored_at"] is None and st["fed_since_explored"] == 0 and st["credit"] == 0.0


def test_candidates_are_relative_to_the_model(kimi):
    for spec in (kimi, get_preset("qwen3-next-80b")):
        tps = spec.snapshot_bytes / spec.kv_bytes_per_token
        intervals = {int(r.partition(":")[2]) for c in candidate_settings(spec, 16)
                     for r in c.admission.split("+") if r.startswith("interval:")}
        assert intervals == {math.ceil(3 * tps / 16) * 16}
        assert tps / 16 <= spare_interval(spec, 16) < tps / 16 + 16



#: Measured with the final settings: the adaptive manager finds the best candidate on some
#: of these (chat: no-prompt-end at request 72 of 300) but switches late or not at all (a
#: lead must hold 3 evaluations, and beat sampling error) and stays below it over the
#: second half. On 2026-12-02, with ``CONFIRM`` 3 and the corrected z test: docs 2 GiB
#: 0.024 (``seen-twice-recency`` as a fixed policy reaches 0.838, the adaptive manager
#: 0.814); slow cases: agent 0.011 (was 0.035), mixed 0.007 (0.020), chat 4 GiB 0.007;
#: agentic (0.008 before: SGLang's setting now taken at request 128, not 160) and chat at
#: 1 GiB meet the target. On 2026-12-03 a request restoring a spare checkpoint stopped
#: valuing its snapshots from the spare (71 -> 68 of 450 sweep cells behind, the mean up on
#: every seed set), and agent here went 0.011 -> 0.022 (switches at 151 and 191 of 300: the
#: second half has little time on the candidate it ends on). Earlier figures and causes:
#: docs/adaptive.md.
#: On 2026-12-05 ranking first the checkpoints and turn ends a session went past
#: (hybridcache.superseded) moved mixed here from 0.007 to 0.062: the fixed candidates' second
#: halves fell (``checkpoints-none`` 0.682 -> 0.638, ``seen-twice`` 0.680 -> 0.667) and the
#: adaptive manager switched at 56, 88 and 140 where it switched once (0.675 -> 0.605), while
#: the 300 sweep cells gained (docs/results.md, "Checkpoints and turn ends a session went past").
#: On 2026-12-05 the rules' save points took their slots before the step's pages (a save
#: point the room held was lost when the step's own pages left no block to empty; the 300
#: sweep cells gained, docs/results.md, "Save points before the step's pages"): agent
#: 0.022 -> 0.008, mixed 0.062 -> 0.013, chat at 1 GiB 0.008 -> 0.003; agentic 0.0 -> 0.015
#: (SGLang's setting taken at 144 as before, ``checkpoints-none`` at 96 first); docs 0.024 ->
#: 0.080 (never switches: the miniature's ``seen-twice-recency`` trails, 0.670 against 0.685,
#: while as a fixed policy it rose to 0.864; the spare checkpoints cost the starting setting
#: 0.023 of this second half, 0.0005 before: 0.807 against 0.784; over the whole trace
#: that setting with its spares keeps what it kept before, within 0.1 %).
#: On 2026-12-06 the count rule's z bound got its floor of one standard error at every rate
#: (``Z_FLOOR``; docs/results.md, "A floor under the z test"): mixed 0.013 -> -0.035 (the
#: switches at 56 and 88, to ``no-prompt-end`` and back, are no longer made: 0.707 against
#: the best fixed candidate's 0.672), the other cases unchanged (agent 0.008, agentic 0.015,
#: chat at 4 GiB -0.004; chat at 1 GiB 0.003, docs 0.080).
#: On 2026-12-07 a session's turn end stopped being valued at its output alone once its prompt
#: end is ranked first (``CommitRegistrar.register_turn_end``; docs/results.md, "Held-out
#: workload shapes"): agent 0.008 -> 0.005 and agentic 0.015 -> 0.001 (both now within the
#: target), chat at 1 GiB 0.003 -> 0.002, chat at 4 GiB -0.004 -> 0.000, docs 0.080 -> 0.064;
#: mixed -0.035 -> 0.037: every fixed candidate's second half rose (``checkpoints-none`` 0.672
#: -> 0.754) and the adaptive manager's less (0.707 -> 0.717, ``checkpoints-none`` taken at 107).
#: On 2026-12-07 the candidates took the ``seen-branch`` rule (a branch point found in a record
#: of evicted units where the KV is gone; docs/results.md, "Branch points the cache
#: forgot"): docs 0.064 -> 0.028 (the adaptive manager's second half 0.800 -> 0.829),
#: mixed 0.037 -> 0.028 (no switch: 0.717 -> 0.704, the best fixed 0.754 -> 0.732), chat at
#: 1 GiB 0.002 -> -0.008 (the same 0.646; the best fixed candidate fell), agent 0.005 ->
#: 0.008 (``seen-twice`` taken at 127, not 215), agentic 0.001 -> 0.016 (the same switch,
#: at 144 to SGLang's setting, 0.883 -> 0.868 over the second half and 0.8904 over the
#: whole trace either way), chat at 4 GiB 0.000.
#: In the thirty-ninth session vLLM align's rules in the set took value eviction's ranking
#: (``seen-twice-align``, ``gdsf``, in place of ``seen-twice-recency``'s LRU; docs/results.md,
#: "vLLM's rules ranked by value"): docs 0.028 -> 0.005 (the new candidate is the best fixed
#: one, 0.857, taken at request 84: 0.852), the other cases unchanged (chat at 1 GiB -0.008,
#: agent 0.008, mixed 0.028, agentic 0.016, chat at 4 GiB 0.000).
#: Each case asserts that the gap does not grow past its measurement (+0.005), then marks
#: itself an expected failure while the issue's target (within 0.005) is missed; a case
#: that meets the target passes, so a fix shows.
def _check_gap(rate: float, best: float, measured: float, switches: object) -> None:
    assert rate >= best - measured - 0.005, (rate, best, switches)
    if rate < best - 0.005:
        pytest.xfail(f"adaptive {rate:.3f} lags the best fixed candidate {best:.3f} "
                     f"(measured gap {measured}; docs/adaptive.md)")


@pytest.mark.parametrize(("kind", "n", "gib", "gap"), [
    ("chat", 300, 1, 0.0), pytest.param("docs", 200, 2, 0.005, marks=pytest.mark.slow)])
def test_converges_to_best_fixed_candidate(kimi, kind, n, gib, gap):
    trace = Trace(f"<{kind}>", "tokens", generate(kind, n, seed=1, tenants=2))
    best = max(fixed_rates(trace, kimi, gib << 30).values())
    rate, run = adaptive_rate(trace, kimi, gib << 30)
    _check_gap(rate, best, gap, run.mgr.switches)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "n", "gib", "gap"), [
    ("agent", 300, 2, 0.008), ("mixed", 300, 2, 0.028), ("agentic", 300, 2, 0.016), ("chat", 400, 4, 0.0)])
def test_converges_to_best_fixed_candidate_slow(kimi, kind, n, gib, gap):
    trace = Trace(f"<{kind}>", "tokens", generate(kind, n, seed=2, tenants=2))
    best = max(fixed_rates(trace, kimi, gib << 30).values())
    rate, run = adaptive_rate(trace, kimi, gib << 30)
    _check_gap(rate, best, gap, run.mgr.switches)


def _changing_kind(first_kind: str, second_kind: str, seed: int) -> tuple[Trace, Trace, int]:
    """150 requests of one kind, then 300 of another under other tenants: the whole trace,
    its second part alone, and where the change is."""
    reqs = generate_change(first_kind, second_kind, (150, 300), seed=seed)
    return Trace("<switch>", "tokens", reqs), Trace("<second>", "tokens", reqs[150:]), 150


def _after_change(trace: Trace, at: int, kimi, cap: int) -> tuple[float, Replay]:
    """The adaptive manager's token hit rate over the requests after the change."""
    run = Replay(trace, kimi, cap, ADAPTIVE)
    run.advance(at)
    hit, prompt = run.hit_tokens, sum(run.tally.prompt.values())
    run.advance()
    return (run.hit_tokens - hit) / (sum(run.tally.prompt.values()) - prompt), run


@pytest.mark.slow
def test_follows_a_workload_that_changes_kind(kimi, monkeypatch):
    """Agentic sessions, then chat at 2 GiB: after the change the adaptive manager detects
    it (hybridcache.shift), switches, and its hit rate on the chat part is within 0.005 of
    the best candidate's replayed on that part alone from a cold cache (0.757 against
    seen-twice's 0.752, measured 2026-12-02; 0.765 against 0.758 since the checkpoints and
    turn ends a session went past are ranked first, 2026-12-05). Without the detection it
    stays on the setting it took for the agentic part: the old savings outweigh the new ones
    in the window, and five of seven candidates are retired (0.685 on 2026-12-02; 0.749
    since that rule, which made the agentic part's setting better on chat too). Since a
    step's save points are taken by priority when the room cannot hold them all
    (2026-12-07) the setting taken for the agentic part (``no-prompt-end``, 0.749 on the
    chat part as a fixed policy, the best 0.755) is as good there: 0.7536 without the
    detection against 0.7541 with it. The test holds what the detection does (the change
    flagged, a switch after it, none without it) and the policy within 0.005 of the best,
    no longer a gain over staying."""
    import hybridcache.adaptive as adaptive

    trace, half, at = _changing_kind("agentic", "chat", seed=3)
    cap = 2 << 30
    best = max(fixed_rates(half, kimi, cap).values())
    rate, run = _after_change(trace, at, kimi, cap)
    mgr = run.mgr
    assert isinstance(mgr, AdaptiveManager)
    assert len(mgr.shifts) == 1 and at < mgr.shifts[0] < at + 50, mgr.shifts
    assert any(n > mgr.shifts[0] for n, _ in mgr.switches), mgr.switches
    assert rate >= best - 0.005, (rate, best, mgr.switches)
    monkeypatch.setattr(adaptive, "SHIFT_DETECTION", False)
    without, stayed = _after_change(trace, at, kimi, cap)
    assert not any(n > at for n, _ in stayed.mgr.switches), stayed.mgr.switches
    assert without < rate, (without, rate, best)


#: Deterministic (seeded traces, accounting-only managers): strict, so a fix must flip it.
@pytest.mark.slow
@pytest.mark.xfail(reason="the setting taken after the change is not the best one as a fixed policy "
                          "(docs/adaptive.md)", strict=True)
def test_the_setting_taken_after_a_change_of_kind_is_the_best_one(kimi):
    """The stricter reading of following a change: the candidate in force at the end is one
    that does best on the chat part as a fixed policy. The adaptive manager takes SGLang's
    setting at request 214, whose shadow led from the caches the agentic part left (the live
    cache gets 0.757 on chat with it, above), but as a fixed policy from cold it gets 0.443."""
    trace, half, _ = _changing_kind("agentic", "chat", seed=3)
    cap = 2 << 30
    _, run = adaptive_rate(trace, kimi, cap)
    rates = fixed_rates(half, kimi, cap)
    assert rates[run.mgr.current] >= max(rates.values()) - 0.005, (run.mgr.current, rates)


def test_turn_end_rule_follows_whether_outputs_are_known(kimi):
    """Block-level traces never append outputs: a turn-end state would hold a slot while
    the request runs and serve nothing. A request that computed outputs it never appended
    turns the rule off; one that appended them turns it back on."""
    import numpy as np

    m = HybridCacheManager(kimi, 4 << 30, ADAPTIVE)
    prompt = np.arange(1, 3001, dtype=np.uint32)
    for rid, appended, known in (("a", False, False), ("b", True, True)):
        m.add_request(rid, prompt)
        m.allocate(rid, 3100 - m.match(rid).hit_tokens)
        if appended:
            m.append_tokens(rid, np.arange(7000, 7100, dtype=np.uint32))
        m.commit(rid, 3100)
        m.free(rid)
        assert m.outputs_known is known and m.admission.turn_end is known


def test_chain_keys_sample_sessions_behind_a_shared_prefix():
    """Sessions behind one system prompt get their own keys, stable across their turns;
    a root that never split (one session extending itself) is one family."""
    from hybridcache.shadow import ChainKeys

    keys = ChainKeys()
    sys_prompt = [b"s0", b"s1"]
    a1, b1 = sys_prompt + [b"a2"], sys_prompt + [b"b2", b"b3"]
    assert keys.key(a1) == b"s0"  # nothing to split on yet
    assert keys.key(a1 + [b"a3"]) == b"s0"  # an extension
    assert keys.key(b1) == b"b2"  # split at depth 2
    assert keys.key(a1 + [b"a3", b"a4"]) == b"a2"
    assert keys.key(b1 + [b"b4"]) == b"b2"
    assert keys.key(sys_prompt) == b"s0"  # no unit of its own
    assert keys.key([b"x0", b"x1"]) == b"x0" and keys.key([b"x0", b"x1", b"x2"]) == b"x0"


def test_paired_difference_needs_a_consistent_lead():
    from hybridcache.shadow import PairedDifference

    steady, noisy = PairedDifference(), PairedDifference()
    for i in range(40):
        steady.add(1.0 + (i % 2) * 0.1, 1.0)
        noisy.add(10.0 if i % 2 else -9.0, 1.0)
    assert steady.z(24) > 3.0 > noisy.z(24)
    assert PairedDifference().z(1) == 0.0


def test_request_freed_before_its_prompt_is_computed_is_not_replayed(kimi, monkeypatch):
    """Chunked prefill cut short: the shadows skip it, and free() still works."""
    import numpy as np

    monkeypatch.setattr(shadow_backlog, "WAIT_FOR_PRESSURE", False)  # fed at once
    m = HybridCacheManager(kimi, 4 << 30, ADAPTIVE)
    m.rate = 1.0
    prompt = np.arange(1, 3001, dtype=np.uint32)
    m.add_request("a", prompt)
    m.allocate("a", 1000)
    m.commit("a", 1000)
    m.free("a")
    assert m.sampled == 0
    m.add_request("b", prompt)
    m.allocate("b", 3000 - m.match("b").hit_tokens)
    m.commit("b", 3000)
    m.free("b")
    assert m.sampled == 1 and all(s.prompt_tokens == 3000 for s in m.shadows)


def test_a_shadow_hits_the_output_of_a_request_it_replayed(kimi):
    """A shadow replays a request's prompt and output units; the next turn (the whole
    history plus a new message) must hit past the first prompt, into its output. Fails
    when the output's digests are registered unsalted while lookups are salted (the
    shadows then never hit and the adaptive manager never switches)."""
    from hybridcache.hashing import TokenHasher
    from hybridcache.shadow import ShadowCache

    cfg = CacheConfig(admission="last-token+turn-end")
    shadow = ShadowCache("x", kimi, 4 << 30, cfg)
    h = TokenHasher(cfg.hash_unit)
    h.extend(list(range(1, 3201)))  # a 3,000-token prompt and 200 output tokens
    shadow.feed(h.digests, 3000, 3200, "t", 1.0)
    assert shadow.hit_tokens == 0
    h.extend(list(range(5000, 5300)))  # the next turn's new message
    shadow.feed(h.digests, 3500, 3500, "t", 1.0)
    assert shadow.hit_tokens == 3200, shadow.hit_tokens


def _branching_requests(m: HybridCacheManager, n: int, doc_tokens: int, seed: int) -> None:
    """``n`` requests that share a prefix of one document up to a random cut, then a
    question of their own: every cut is a fresh branch, so the deeper the nearest state
    below it, the more a request hits (denser checkpoints win while memory lasts)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    doc = np.arange(1, doc_tokens + 1, dtype=np.uint32)
    for i in range(n):
        cut = int(rng.integers(doc_tokens // 20, doc_tokens))
        own = np.arange(10**6 + 100 * i, 10**6 + 100 * i + 64, dtype=np.uint32)
        prompt = np.concatenate([doc[:cut], own])
        rid = f"r{i}"
        m.add_request(rid, prompt)
        m.allocate(rid, len(prompt) - m.match(rid).hit_tokens)
        m.commit(rid, len(prompt))
        m.free(rid)


def test_rate_out_of_range_is_refused(kimi):
    from hybridcache.errors import ConfigError

    for bad in (0.0, 1.5, -1.0):
        with pytest.raises(ConfigError):
            AdaptiveManager(kimi, 4 << 30, ADAPTIVE, rate=bad)


@pytest.mark.parametrize("kind", ["chat", "docs"])
def test_twin_shadows_replay_exactly_as_separate_ones(kimi, kind):
    """Settings that differ only in their interval share one replay until a request reaches
    the interval (ShadowCache.follow): the adaptation must be the one separate shadows give.
    docs has requests past the 3x interval (the twin forks midway), chat has none."""
    trace = Trace(f"<{kind}>", "tokens", generate(kind, 300, seed=1, tenants=2))
    runs = []
    for separate in (False, True):
        run = Replay(trace, kimi, 1 << 30, ADAPTIVE)
        twins = [s for s in run.mgr.shadows if s.host is not None]
        assert twins, "the candidate set has settings that differ only in their interval"
        if separate:
            for s in twins:
                s.fork()  # a copy of the still empty host: from here on fed on its own
        run.advance()
        runs.append(run)
    shared, separate = (r.mgr.adaptive_stats() for r in runs)
    assert shared["switches"] == separate["switches"]
    assert shared["shadows"] == separate["shadows"]
    assert runs[0].hit_tokens == runs[1].hit_tokens
    forked = [s for s in runs[0].mgr.shadows if s.fork_at and s.host is None]
    assert bool(forked) == (kind == "docs")


def test_anytime_threshold_refuses_a_few_samples_and_grows_slowly():
    """The confidence sequence's boundary: no lead on a handful of requests, tightest near
    its mixture width, then growing like sqrt(log n) (the price of testing after every
    request); a stricter level asks more everywhere."""
    import math

    from hybridcache.decision import anytime_threshold

    t = [anytime_threshold(n, 0.05, 24.0) for n in (1, 6, 24, 96, 10_000)]
    assert t[0] > t[1] > t[2] and t[3] < t[4] < t[2] + 1.0, t
    assert t[2] > math.sqrt(2 * math.log(1 / 0.05)) > 2.0  # stricter than a one-off z test
    assert anytime_threshold(24, 0.01, 24.0) > t[2] and anytime_threshold(0, 0.05, 24.0) == math.inf


def test_pair_table_rows_start_at_each_shadows_onset():
    """Row i holds shadow i's lead from its own onset on: what it saved before (its cache
    not yet full) is left out, and a row once opened is never reset."""
    table = PairTable(3)
    for _ in range(10):
        table.add([5.0, 0.0, 1.0], 1.0)  # shadow 0 leads before its onset: not counted
    assert table.lead(0, 1) is None
    table.start(0)
    table.start(1)
    for i in range(30):
        table.add([1.0 + (i % 2), 1.0, 0.5], 1.0)
    table.start(0)  # already open: kept
    lead = table.lead(0, 1)
    assert abs(lead.s1 / lead.w - 0.5) < 1e-12 and lead.n == 30.0
    assert table.lead(1, 0).s1 < 0 and table.lead(1, 1).w == 0.0


def test_clear_lead_is_taken_before_the_count_of_confirmations(kimi):
    """The sequential test (:meth:`AdaptiveManager._take_clear_lead`) adopts a candidate
    whose paired lead over the current one clears the confidence sequence's boundary at
    once, where the count rule (:meth:`_follow_best`) would wait for ``CONFIRM``
    evaluations in a row; a lead within the noise is not taken.

    Built by hand since 2026-12-05: with the rules' save points taken before the step's
    pages, the path no longer fires first on any generated cell swept (agentic seeds 0-29
    at 1 GiB; agent, mixed, docs and chat seeds 0-9 at 1-2 GiB; agentic seeds 0-9 at 2
    GiB), where it fired first on four agentic cells at 1 GiB before (seed 25: 171 against
    184 of 200, 0.774 against 0.717), the cells this test replayed until then."""
    m = AdaptiveManager(kimi, 1 << 30, ADAPTIVE)
    _branching_requests(m, 12, 6000, seed=3)
    cur = m._shadow(m.current)
    assert cur.evictions, "the current shadow is under pressure"
    m._retired.clear()
    ci = m._current_index()
    ch = next(i for i, s in enumerate(m.shadows) if i != ci and s.evictions)
    challenger = m.shadows[ch]

    def feed(pairs: int, lead: float) -> None:
        m._pairs = PairTable(len(m.shadows))
        m._pairs.start(ch)
        for k in range(pairs):  # the challenger saves ``lead`` more, give or take 0.5
            saved = [1.0] * len(m.shadows)
            saved[ch] += lead + (0.5 if k % 2 else -0.5)
            m._pairs.add(saved, 1.0)
        for s in m.shadows:
            s.score = 1.0
        challenger.score = 1.0 + lead

    feed(40, 0.05)  # a lead well inside the noise
    assert not m._take_clear_lead() and m.current == cur.name
    feed(40, 1.0)
    m._lead = (None, 0)
    m._follow_best()  # the count rule: the first of CONFIRM confirmations
    assert adaptive.CONFIRM > 1 and m._lead == (challenger.name, 1) and m.current == cur.name
    assert m._take_clear_lead() and m.current == challenger.name


def test_near_exact_shadows_are_not_held_to_the_full_z_test(kimi, monkeypatch):
    """At 2 GiB a shadow keeps 48 of the live cache's 49 blocks (rate 0.98): it sees almost
    every request, so its lead has almost no sampling error, and the count rule's z bound
    is corrected for that (``Z_SWITCH * sqrt(1 - rate)``, 0.28 here; the full bound at rate
    0), though never below ``Z_FLOOR`` (1: the requests to come are in no sample). Agent
    sessions, seed 11, 200 requests: the bound of 1 takes ``no-prompt-end`` at request 96;
    held to the full bound of 2, at 136. Until 2026-12-06 the earlier switch kept more
    (0.8046 against 0.7907); since a session's turn end is valued past its prompt end
    (2026-12-07) the starting setting keeps as much as ``no-prompt-end`` here, and the two
    end level (0.7872 against 0.7896; on seeds 12 and 16 too: 0.846 / 0.851, 0.866 / 0.866).
    The switch timing fails without the correction; the hit rates may not part by more than
    0.005 either way."""
    import hybridcache.adaptive as adaptive

    m = AdaptiveManager(kimi, 2 << 30, ADAPTIVE)
    assert 0.9 < m.rate < 1.0 and m._z_needed() == adaptive.Z_FLOOR
    m.rate = 0.25
    assert m._z_needed() == pytest.approx(adaptive.Z_SWITCH * math.sqrt(0.75))
    assert m._z_needed() > adaptive.Z_FLOOR
    m.rate = 1.0
    assert m._z_needed() == adaptive.Z_FLOOR > 0.0
    trace = Trace("<agent:11>", "tokens", generate("agent", 200, seed=11, tenants=2))
    runs = {}
    for corrected in (True, False):
        if not corrected:
            monkeypatch.setattr(AdaptiveManager, "_z_needed", lambda self: adaptive.Z_SWITCH)
        run = Replay(trace, kimi, 2 << 30, ADAPTIVE)
        runs[corrected] = (run.mgr.switches, whole_trace(run))
    (fast, fast_hit), (slow, slow_hit) = runs[True], runs[False]
    assert fast[1][1] == "no-prompt-end" and fast[1][0] + 16 <= slow[1][0], (fast, slow)
    assert abs(fast_hit - slow_hit) < 0.005, (fast_hit, slow_hit)


def test_adopting_a_seen_twice_setting_takes_the_counts_its_shadow_kept(kimi):
    """``min_seen=2`` saves a state only at a boundary seen before. The live cache, on a
    setting without the rule, counts nothing; the candidate's shadow counted every boundary
    it replayed. Adopting the candidate must carry those counts over
    (:func:`hybridcache.adoption.carry_seen`), or the adopted setting saves nothing until
    every boundary came round again, which is not what its shadow measured. A count the
    live cache has of its own is never lowered."""
    m = AdaptiveManager(kimi, 1 << 30, ADAPTIVE)
    assert m.rate == 1.0 and m.candidates[0].min_seen == 1
    _branching_requests(m, 12, 6000, seed=3)
    assert not m._seen  # the live setting never counts
    shadow = m._shadow("seen-twice")
    assert shadow.config.min_seen == 2 and shadow.mgr._seen
    own = next(iter(shadow.mgr._seen))
    m._seen[own] = 99
    m._adopt(shadow)
    assert m.current == "seen-twice" and m.admission.min_seen == 2
    assert m._seen[own] == 99
    assert all(m._seen[d] >= n for d, n in shadow.mgr._seen.items())


def test_the_live_cache_keeps_a_seen_branch_record_whatever_it_adopts(kimi):
    """The live cache keeps its record of evicted units (``seen-branch``) while it runs a
    setting without the rule, so the record is current if the rule comes back; where it
    has none (a candidate set whose first setting lacks the rule), adopting a setting
    with the rule starts one (:func:`hybridcache.seen_prefixes.fit_record`)."""
    m = AdaptiveManager(kimi, 1 << 30, ADAPTIVE)
    _branching_requests(m, 12, 6000, seed=3)
    record = m.index.seen
    assert record is not None and m.admission.seen_branch
    m._adopt(m._shadow("prompt-turn-recency"))
    assert not m.admission.seen_branch and m.index.seen is record
    m.index.seen = None
    m._adopt(m._shadow("no-prompt-end"))
    assert m.admission.seen_branch and m.index.seen is not None
    m.check_invariants()


def test_a_shadow_that_never_fills_does_not_hold_the_comparison_back(kimi, monkeypatch):
    """The count rule compares once the current candidate's shadow is under pressure, and
    only the shadows that are: a shadow that has not evicted (``seen-twice-align`` saves
    few states and may never fill) neither blocks the comparison, as waiting on every
    shadow did, nor wins it with savings it has not had to defend. Fails with the old rule
    (every shadow under pressure) and with the unfilled shadow allowed to lead."""
    from hybridcache.shadow import ShadowCache

    m = AdaptiveManager(kimi, 1 << 30, ADAPTIVE)
    _branching_requests(m, 12, 6000, seed=3)
    cur = m._shadow(m.current)
    assert cur.evictions, "the current shadow is under pressure"
    idle = m._shadow("seen-twice-align")
    others = [s for s in m.shadows if s is not cur and s is not idle]
    full = next(s for s in reversed(others) if s.evictions)
    real = ShadowCache.evictions.fget
    monkeypatch.setattr(ShadowCache, "evictions", property(lambda s: 0 if s is idle else real(s)))
    m._retired.clear()
    for s in others:
        s.score = 1.5
    cur.score, full.score, idle.score = 1.0, 2.0, 10.0
    m._lead = (None, 0)
    m._follow_best()
    assert m._under_pressure
    assert m._lead == (full.name, 1), m._lead
