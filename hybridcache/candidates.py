"""The settings the adaptive policy (:mod:`hybridcache.adaptive`) chooses among.

Each candidate is a setting a fixed cache could run: admission rules, value eviction's
weighting (or an eviction policy of its own) and ``min_seen``. Densities are in the model's
tokens-per-snapshot (the KV-equivalent of one snapshot), so nothing here comes from a
trace; the set holds our fixed policy's setting and its variations, and the settings of
the peers that lead somewhere, so that following the best candidate can reach them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from hybridcache.spec import ModelSpec
from hybridcache.vllm_block import vllm_align_block

#: The rules every candidate but one keeps (prompt end, turn end, branch points: those the
#: cached KV shows and those the record of evicted units shows, ``seen-branch``).
BASE_RULES = "last-token+turn-end+seen-branch"
#: Spacing of the live cache's spare checkpoints (:func:`spare_interval`), in the model's
#: tokens-per-snapshot: the dense candidate's that spares replaced (SGLang's idea of dense
#: checkpoints, which lead where memory is plentiful, at the model's scale: 352 tokens for
#: Kimi Linear 48B, where ``sglang-extra`` tracks every 256).
SPARE_DENSITY = 1.0 / 16


def round_up(n: float, unit: int) -> int:
    """``n`` tokens rounded up to a whole number of hash units, at least one: a density or a
    block the rules can use (an interval or a block must be a multiple of the unit). The
    simulator's policies round with it too."""
    return max(unit, -(-int(math.ceil(n)) // unit) * unit)


def _tokens_per_snapshot(spec: ModelSpec) -> float | None:
    """The KV-equivalent of one snapshot in tokens, the scale of every density here;
    ``None`` for a model without state (nothing to checkpoint)."""
    if not spec.has_state or not spec.kv_bytes_per_token:
        return None
    return spec.snapshot_bytes / spec.kv_bytes_per_token


class Candidate(NamedTuple):
    """One setting the adaptive manager can follow: admission rules, the eviction ranking
    (:data:`hybridcache.adoption.RANKINGS`: value eviction's weighting, or an eviction
    policy: ``lru``, ``marconi``) and ``min_seen``."""

    name: str
    admission: str
    weighting: str = "gdsf"
    min_seen: int = 1


#: Marconi's setting as a candidate: its admission (prompt end, branch points) and its
#: utility eviction (the ``marconi`` ranking, alpha 1: the middle of the simulator's tuning
#: grid), which the live cache switches to when it adopts it (set_weighting). Not in the
#: default set: in place of ``checkpoints-1/16x-recency`` (never adopted, since replaced
#: by ``seen-twice-recency``) it left the
#: generated sweep where it was (docs/results.md, "Adaptive policy: a Marconi candidate"):
#: 18 -> 19 cells behind on seeds 5-8 (development; mean hit -0.0001), 18 -> 17 on 9-12
#: (+0.0010); agentic gains (up to +0.073 in a cell), agent loses (up to -0.032). It is
#: adopted late (requests 96-191 of 200): its shadow finds the lead, the entries the
#: setting before it made stay. ``candidate_settings(..., marconi=True)`` adds it.
MARCONI_CANDIDATE = Candidate("marconi", "last-token+branch-point", "marconi")


def candidate_settings(spec: ModelSpec, unit: int, *, marconi: bool = False,
                       align_blocks: bool = False) -> list[Candidate]:
    """The candidates; the first is where the live cache starts (the fixed policy's setting).
    ``marconi``: also :data:`MARCONI_CANDIDATE`; ``align_blocks``: also vLLM's rules at its
    own block boundaries (:func:`align_blocks_candidate`). Neither by default, see there.

    Densities are in the model's tokens-per-snapshot (the KV-equivalent of one snapshot),
    so nothing here comes from a trace. Beside the fixed policy's setting and its
    variations (no frequency term, no checkpoints, no prompt-end snapshot), the set holds
    the settings of the peers that lead somewhere, so that following the best candidate can
    reach them: SGLang's (prompt end and turn end, LRU: ``recency`` weighting, which long
    agent contexts with heavy-tailed think times favour) and vLLM's align mode's admission
    (a state only for a boundary seen twice) with our checkpoints and with vLLM's own rules
    (``seen-twice-align``: prompt end and branch points at our unit, which leads on
    documents branching under a tight budget, where few states fit and KV that has none
    yet is what finds the branch). SGLang with dense checkpoints (``sglang-extra``: free
    hits with memory to spare) comes as spare checkpoints (:func:`spare_interval`); as a
    candidate (``checkpoints-1/16x-recency``) it was never adopted.

    ``seen-twice-align`` ranks by value (``gdsf``), not by vLLM's LRU: until the
    thirty-ninth session it was ``seen-twice-recency``, and on documents its lead was
    short-lived. Forked from the live cache at request 300 of a 1,000-request trace
    (falcon-h1-7b, docs at 4 GiB), the same rules with ``gdsf`` hit 0.084 more of the
    next 700 requests' prompt tokens (likely: the few states these rules save leave the
    cache mostly KV, and GreedyDual keeps the KV that served hits where LRU keeps the
    newest). As a candidate it took the cells behind the best other policy from 65 to 51
    of 600 and raised the mean hit on all nine sweep sets (docs/results.md, "vLLM's rules
    ranked by value"). vLLM's exact setting comes back with ``align_blocks=True`` where its
    block is the unit.
    """
    tps = _tokens_per_snapshot(spec)
    if tps is None:
        return [Candidate("no-state", BASE_RULES)]

    def every(d: float) -> str:
        return BASE_RULES if d == 0 else f"{BASE_RULES}+interval:{round_up(d * tps, unit)}"

    grid = [
        Candidate("checkpoints-3x", every(3.0)),
        Candidate("checkpoints-3x-gds", every(3.0), "gds"),
        Candidate("checkpoints-none", every(0.0)),
        Candidate("no-prompt-end", f"turn-end+seen-branch+interval:{round_up(3.0 * tps, unit)}"),
        Candidate("prompt-turn-recency", "last-token+turn-end", "recency"),
        Candidate("seen-twice", every(3.0), "gdsf", 2),
        Candidate("seen-twice-align", "last-token+seen-branch", "gdsf", 2),
        *([align_blocks_candidate(spec, unit)] if align_blocks else []),
        *([MARCONI_CANDIDATE] if marconi else []),
    ]
    out: list[Candidate] = []
    for c in grid:
        if all(c[1:] != o[1:] for o in out):
            out.append(c)
    return out


def align_blocks_candidate(spec: ModelSpec, unit: int) -> Candidate:
    """vLLM's align-mode rules at its own block boundaries (``seen-twice-blocks``): the
    prompt-end state at the last multiple of its inflated block (:func:`vllm_align_block`,
    rounded up to the unit; the ``last-block`` rule) and at branch points, for a point
    wanted twice, LRU. Where questions on one document are shorter than the block, that
    point lies inside the document, and the second question saves the state every later
    one resumes from. As a fixed setting it leads every default candidate on documents with
    memory to spare (1,000 requests: qwen3-next-80b, docs seed 0 at 8 GiB, 0.817 against
    0.783; Kimi Linear 48B, every docs cell at 4 GiB of seeds 0-3, by up to 0.012), while
    ``seen-twice-recency`` (the same rules at our unit with LRU, then in the set) keeps its
    lead at 1-2 GiB, where its fewer states leave the KV room. Not in the default set: as an
    eighth candidate it left the sweeps where they were (Kimi seeds 5-8: 10 -> 12 cells
    behind, mean hit -0.0001; qwen3-next-80b seeds 9-10: 13 -> 12, +0.0010; Kimi long cells
    -0.0006) for 1 % more instructions (chat, 64 GiB): the shadows rarely adopt it where it
    leads (docs/results.md, "vLLM's save points at its block boundaries"). Measured again on
    2026-12-07 (nine sets): cells behind 99 -> 95 of 600 and the mean hit up on seven sets,
    but down on kimi-k3 (-0.0031, an early lead taken and then lost), flat on nemotron-h-8b,
    for 1.9 % more instructions ("A session's turn end valued when it is registered").
    Where the block is the unit, its admission is ``seen-twice-align``'s, with vLLM's LRU:
    vLLM's own setting."""
    block = round_up(vllm_align_block(spec), unit)
    admission = f"last-block:{block}+seen-branch" if block > unit else "last-token+seen-branch"
    return Candidate("seen-twice-blocks", admission, "recency", 2)


def spare_interval(spec: ModelSpec, unit: int) -> int:
    """Spacing of the live cache's spare checkpoints: :data:`SPARE_DENSITY` of the model's
    tokens-per-snapshot, rounded up to the unit.

    Free room is free: while the arena has a free slot an extra checkpoint costs nothing,
    and ranked first to evict (the ``spare-interval`` rule, :mod:`hybridcache.admission`) it
    leaves under pressure before any entry the candidate in force made, so the cache falls
    back to that candidate's. The shadows compare settings only under pressure and cannot
    tell a dense setting's lead while nothing is evicted (at 16 GiB, 200 requests, no
    shadow ever evicts); this takes that lead without a decision. Switching to the dense
    candidate instead lost 0.009 on chat at 8 GiB once pressure came (its entries rank as
    any other). 0 for a model without state.
    """
    tps = _tokens_per_snapshot(spec)
    return 0 if tps is None else round_up(SPARE_DENSITY * tps, unit)
