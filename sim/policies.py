"""Policies of the simulator: each one is a setting of :class:`HybridCacheManager`.

Baselines are emulated with the same manager so that every difference in the results comes
from *where* states are saved, *what* is evicted and *how finely* prefixes are hashed, not
from two code bases. ``vllm-native`` is the exception: it drives vLLM's own manager
(:mod:`hybridcache.sim.vllm_native`).

=============  ==========================================================================
policy         manager settings
=============  ==========================================================================
hybridcache    unit = trace resolution (16 tokens for token traces); snapshots at the
               prompt's last token, the turn end, branch points and every
               ``3 x tokens-per-snapshot`` tokens; value eviction (GreedyDual: hits x
               FLOPs saved per byte, aged) over KV and states together.
hybridcache-   hybridcache's unit and eviction; admission chosen online among a few candidate
adaptive       settings by shadow caches over a sample of the requests (hybridcache.adaptive).
vllm-align     unit = vLLM's inflated attention block (:func:`vllm_align_block`); states
               at the last block boundary before the prompt end and at the shared-prefix
               junction, saved only for a boundary seen before (``min_seen=2``); LRU
               without the stranded-KV rule (``lru-plain``: vLLM has none).
sglang         states at the prompt's last token and the turn end; LRU (SGLang keeps
               separate KV/state LRU lists, emulated by the manager's two queues; a KV
               tail past the last state goes first, as SGLang deletes tombstone leaves).
sglang-extra   sglang + branch points + a 256-token track interval (rounded up to the unit).
marconi        states at the last token and branch points; Marconi utility eviction,
               alpha tuned on a window of the trace once the cache has filled.
kv-only        the model without state groups (states free): the upper bound.
=============  ==========================================================================
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hybridcache.candidates import round_up
from hybridcache.errors import UnknownNameError
from hybridcache.manager import CacheConfig
from hybridcache.spec import ModelSpec
from hybridcache.vllm_block import vllm_align_block

POLICIES = ("hybridcache", "vllm-align", "sglang", "sglang-extra", "marconi", "kv-only", "vllm-native",
            "vllm-native-best")
#: Policies that replay through the real vLLM rather than our manager.
NATIVE_POLICIES = ("vllm-native", "vllm-native-best")
#: Known but not in ``all``: the adaptive policy replays a sample of the requests once per
#: candidate beside the live cache (hybridcache.adaptive), several times the cost of a
#: fixed policy on small caches; name it to compare it.
OPTIONAL_POLICIES = ("hybridcache-adaptive",)
#: Marconi's alpha grid; the tuning replay picks the best on a window of the trace. Both
#: utility terms are min-max normalised, so alpha is the weight of FLOP efficiency against
#: recency and its order of magnitude is what matters: recency only, balanced, efficiency
#: first. Each candidate costs one window replay; a finer grid (0.5 and 2 as well) costs
#: twice as much and on Mooncake its window winner did no better over the whole trace.
MARCONI_ALPHAS = (0.0, 1.0, 4.0)
#: hybridcache checkpoints a long prompt every this many snapshot-equivalents of KV, so
#: the checkpoints' bytes stay under a third of the KV they cover.
CHECKPOINT_FACTOR = 3
SGLANG_TRACK_INTERVAL = 256


@dataclass(frozen=True)
class PolicySetup:
    """What one policy replays with: the spec, the manager settings, and how to tune."""

    name: str
    spec: ModelSpec
    config: CacheConfig
    tune_marconi: bool = False
    native: bool = False

    def describe(self) -> dict[str, object]:
        c = self.config
        return {
            "hash_unit": c.hash_unit,
            "admission": c.admission,
            "eviction": c.eviction,
            "min_seen": c.min_seen,
            "states": self.spec.has_state,
        }


def parse_policies(text: str) -> list[str]:
    """``"all"`` or a comma-separated list of known names (order kept, duplicates dropped)."""
    names = list(POLICIES) if text.strip() == "all" else [p.strip() for p in text.split(",") if p.strip()]
    for n in names:
        if n not in POLICIES and n not in OPTIONAL_POLICIES:
            known = ", ".join((*POLICIES, *OPTIONAL_POLICIES))
            raise UnknownNameError(f"unknown policy {n!r}; known: {known}, all")
    if not names:
        raise UnknownNameError(f"no policy given; known: {', '.join(POLICIES)}, all")
    return list(dict.fromkeys(names))


def not_applicable(name: str, spec: ModelSpec) -> str | None:
    """Why policy ``name`` cannot model ``spec`` (``None`` when it can)."""
    if name == "kv-only" and not spec.attention_groups:
        return f"kv-only: {spec.name!r} has no attention layers"
    if name in NATIVE_POLICIES and not (spec.attention_groups and spec.state_groups):
        return f"{name}: models hybrid attention + state models only, not {spec.name!r}"
    return None


def checkpoint_interval(spec: ModelSpec, unit: int) -> int:
    """hybridcache's checkpoint interval: ``CHECKPOINT_FACTOR`` snapshots' worth of KV tokens.

    A checkpoint lets the second request sharing a prefix (before any branch point is
    known) resume close to where it diverges; spacing them by a multiple of the snapshot's
    KV-equivalent bounds their memory at ``1/CHECKPOINT_FACTOR`` of the KV they cover.
    """
    if not spec.has_state or not spec.kv_bytes_per_token:
        return round_up(4096, unit)
    tokens = spec.snapshot_bytes / spec.kv_bytes_per_token
    return round_up(int(math.ceil(CHECKPOINT_FACTOR * tokens)), unit)


def stateless(spec: ModelSpec) -> ModelSpec:
    """The same model with free states: no state groups, same KV and FLOP model."""
    if not spec.attention_groups:
        raise UnknownNameError(f"kv-only needs attention layers; {spec.name!r} has none")
    return dataclasses.replace(spec, name=f"{spec.name}/kv-only", state_groups=())


def build_policy(name: str, spec: ModelSpec, unit: int, outputs_known: bool = True) -> PolicySetup:
    """Settings of policy ``name`` for ``spec`` at the replay's default hash unit ``unit``.

    ``outputs_known=False`` (block-level traces: no output token ids) drops the ``turn-end``
    rule from every policy: a state after output tokens that no later prompt can be matched
    against would only hold a slot while the request runs.
    """
    setup = _build(name, spec, unit)
    if outputs_known or "turn-end" not in setup.config.admission:
        return setup
    rules = [r for r in setup.config.admission.split("+") if r != "turn-end"]
    cfg = dataclasses.replace(setup.config, admission="+".join(rules) or "none")
    return dataclasses.replace(setup, config=cfg)


def _build(name: str, spec: ModelSpec, unit: int) -> PolicySetup:
    if name == "hybridcache":
        n = checkpoint_interval(spec, unit)
        adm = f"last-token+turn-end+seen-branch+interval:{n}"
        return PolicySetup(name, spec, CacheConfig(hash_unit=unit, admission=adm, eviction="value"))
    if name == "hybridcache-adaptive":  # hybridcache.adaptive: admission follows shadow caches
        return PolicySetup(name, spec, CacheConfig(hash_unit=unit, admission="adaptive", eviction="value"))
    if name == "vllm-align":
        block = vllm_align_block(spec)
        # lru-plain: vLLM's free-block queue ages KV past the last cached state like any other.
        cfg = CacheConfig(hash_unit=block, admission="last-token+branch-point", eviction="lru-plain", min_seen=2)
        return PolicySetup(name, spec, cfg)
    if name == "sglang":
        return PolicySetup(name, spec, CacheConfig(hash_unit=unit, admission="last-token+turn-end", eviction="lru"))
    if name == "sglang-extra":
        n = round_up(SGLANG_TRACK_INTERVAL, unit)
        adm = f"last-token+turn-end+branch-point+interval:{n}"
        return PolicySetup(name, spec, CacheConfig(hash_unit=unit, admission=adm, eviction="lru"))
    if name == "marconi":
        cfg = CacheConfig(hash_unit=unit, admission="last-token+branch-point", eviction="marconi")
        return PolicySetup(name, spec, cfg, tune_marconi=True)
    reason = not_applicable(name, spec)
    if reason:
        raise UnknownNameError(reason)
    if name == "kv-only":
        return PolicySetup(name, stateless(spec), CacheConfig(hash_unit=unit, admission="none", eviction="lru"))
    if name == "vllm-native":
        block = vllm_align_block(spec)
        return PolicySetup(name, spec, CacheConfig(hash_unit=block, eviction="lru"), native=True)
    if name == "vllm-native-best":
        # The hash unit below the block is what selects vLLM's fine-grained mode in
        # replay_native (vllm_native_best); a block that is one unit is the default.
        return PolicySetup(name, spec, CacheConfig(hash_unit=unit, eviction="lru"), native=True)
    raise UnknownNameError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
