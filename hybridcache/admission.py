"""Admission: at which hash-unit boundaries of a request the engine saves a state snapshot.

Admission decides at which hash-unit boundaries of a request the engine saves a state
snapshot. Snapshots are large (41 MiB for Kimi Linear 48B), so saving one everywhere wastes
memory, and saving too few makes KV hits unusable on hybrid models. Rules (combine with
``+``):

- ``last-token``: the last unit boundary before the prompt's last token, the deepest point an
  identical prompt can reuse (the last token is always recomputed).
- ``turn-end``: the last unit boundary of the finished turn (prompt + output), which the next
  turn of a multi-turn session or agent extends.
- ``branch-point``: the point where the request leaves the cached KV path (Marconi): every
  later request that shares the prefix up to there can use it.
- ``seen-branch``: the point where the request leaves the prefix earlier requests went past,
  cached or not: the branch point where the KV is still cached, and where it is gone, the
  deepest unit of the prompt whose KV the cache evicted lately (:mod:`hybridcache.seen_prefixes`,
  a record of evicted units as large as the cache), unless a recent prompt or turn ended
  there (a session's next turn extends it: nothing branched). The second question on a
  document whose KV went before it came saves the document's end, which ``branch-point``
  never finds. Counted as seen twice by ``min_seen`` (an earlier request went past it).
- ``last-block:N``: the last multiple of N tokens before the prompt's last token (N a
  multiple of the hash unit), where vLLM's align mode saves the prompt-end state (N its
  inflated block). A sibling (another question on the same document) shares that point when
  it lies inside the document, where ``last-token``'s point lies inside the question, which
  no sibling shares: with ``min_seen=2`` the second question saves a state there, where
  ``branch-point`` needs the first question's KV still cached to find the branch.
- ``interval:N``: every N tokens (N a multiple of the hash unit), as SGLang's track interval.
- ``chunk-end``: the end of every scheduled prefill chunk, where the engine has the state
  for free.
- ``suffix-start``: where the request's own suffix is predicted to start, below its prompt's
  end, from where recent requests left the prefixes they shared with earlier prompts
  (:mod:`hybridcache.suffix_starts`): the point its next sibling (another question on the
  same document, a sub-agent of the same context) resumes from. Nothing while most requests
  extend earlier prompts or turns.
- ``spare-interval:N``: every N tokens as well, but only into free room (a slot the arena has
  without evicting anything) and ranked first to evict (:func:`spare_points`): while memory
  is unused an extra checkpoint costs nothing, and under pressure it goes before any entry
  the other rules made, so the cache falls back to what they alone would keep.
- ``spare-suffix-start``: the ``suffix-start`` point as a spare one: into free room, or else
  into the slot of a demoted snapshot (a spare, or a prompt-end state ranked first to
  evict) when that is the entry the next eviction would take anyway
  (:meth:`Evictor.slot_from_demoted <hybridcache.eviction.Evictor.slot_from_demoted>`: the
  default victim chooser names it; a policy's own chooser, free room only), and
  ranked first to evict itself. A predicted sibling's resume point is worth more than an
  interval spare, and taking the slot another wish holds costs the rules' own entries
  nothing. Not for a batching engine (``allow_save_withdrawal``), which may yet drop the
  save: there it takes free room only. The adaptive policy's live cache uses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from hybridcache.errors import UnknownNameError

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.requests import Request

ADMISSION_RULES = ("last-token", "last-block", "turn-end", "branch-point", "seen-branch", "interval", "chunk-end",
                   "suffix-start", "spare-interval", "spare-suffix-start")


@dataclass(frozen=True)
class AdmissionPolicy:
    """Parsed admission rules (see module docstring)."""

    last_token: bool = False
    turn_end: bool = False
    branch_point: bool = False
    #: ``seen-branch``: the branch point found in the record of evicted units as well
    #: (``Request.seen_branch``, the boundary the manager works out once, at the first
    #: allocation, from :mod:`hybridcache.seen_prefixes`).
    seen_branch: bool = False
    interval: int = 0
    #: ``last-block:N``: a state at the last multiple of N before the prompt's last token
    #: (0 = off); with ``last-token`` as well, both points are saved.
    last_block: int = 0
    chunk_end: bool = False
    #: ``suffix-start``: a snapshot where the request's own suffix is predicted to start
    #: (``Request.suffix_start``, set by the manager from :mod:`hybridcache.suffix_starts`).
    suffix_start: bool = False
    #: Save a snapshot only once the same point was wanted ``min_seen`` times (vLLM's align
    #: mode does not save a prefix seen for the first time). 1 = always.
    min_seen: int = 1
    #: ``spare-interval:N``: checkpoints every N tokens taken only into free room, ranked
    #: first to evict (0 = none).
    spare_interval: int = 0
    #: ``spare-suffix-start``: the ``suffix-start`` point taken as a spare one (only into
    #: free room, ranked first to evict).
    spare_suffix_start: bool = False
    #: Whether the manager keeps the suffix-start estimate (either rule uses it): a field,
    #: not a property, as the manager reads it for every request.
    tracks_suffixes: bool = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tracks_suffixes", self.suffix_start or self.spare_suffix_start)

    def saves_within(self, other: AdmissionPolicy) -> bool:
        """Whether, while nothing is evicted, ``other`` saves every point these rules save.

        Why: the adaptive policy's shadows wait for the live cache's pressure only where
        every candidate saves within the setting the live cache starts from
        (:mod:`hybridcache.shadow_backlog`). ``branch-point`` and ``seen-branch`` save the
        same points until something is evicted (the record of evicted units is empty); the
        spare rules are left out (they only ever add points, into free room)."""
        o = other
        return ((not self.last_token or o.last_token) and (not self.turn_end or o.turn_end)
                and (not (self.branch_point or self.seen_branch) or o.branch_point or o.seen_branch)
                and (not self.interval or (o.interval > 0 and self.interval % o.interval == 0))
                and (not self.last_block or self.last_block == o.last_block)
                and (not self.chunk_end or o.chunk_end) and (not self.suffix_start or o.suffix_start)
                and self.min_seen >= o.min_seen)

    @classmethod
    def parse(cls, text: str, hash_unit: int) -> AdmissionPolicy:
        """Parse ``"last-token+turn-end+interval:256"``; unknown rules list the known ones."""
        kw: dict[str, object] = {}
        for raw in filter(None, (p.strip() for p in text.split("+"))):
            name, _, arg = raw.partition(":")
            if name in ("interval", "spare-interval", "last-block"):
                try:
                    n = int(arg)
                except ValueError:
                    raise UnknownNameError(f"admission rule {raw!r}: {name} needs tokens, e.g. {name}:256") from None
                if n <= 0 or n % hash_unit:
                    raise UnknownNameError(
                        f"admission rule {raw!r}: {name} must be a positive multiple of the hash unit {hash_unit}"
                    )
                kw[name.replace("-", "_")] = n
            elif name in ("last-token", "turn-end", "branch-point", "seen-branch", "chunk-end", "suffix-start",
                          "spare-suffix-start") and not arg:
                kw[name.replace("-", "_")] = True
            elif name == "none":
                continue
            else:
                raise UnknownNameError(
                    f"unknown admission rule {raw!r}; known: {', '.join(ADMISSION_RULES)} "
                    "(interval, spare-interval and last-block take :TOKENS; combine with '+', or 'none')"
                )
        return cls(**kw)  # type: ignore[arg-type]


def admission_points(
    policy: AdmissionPolicy, req: Request, start: int, end: int, unit: int
) -> list[tuple[int, bool]]:
    """Boundaries in ``(start, end]`` where ``policy`` wants a snapshot.

    Returns:
        ``(boundary, rolling)`` pairs in increasing order. ``rolling`` marks the turn-end
        save, which the engine overwrites at every boundary it passes while decoding and
        which is registered only when the request finishes.
    """
    p = req.prompt_len
    last_in_prompt = (p - 1) // unit * unit
    wanted: list[int] = []
    if policy.last_token:
        wanted.append(last_in_prompt)
    if policy.last_block:
        wanted.append((p - 1) // policy.last_block * policy.last_block)
    if policy.branch_point and req.kv_hit_tokens > req.hit_tokens:
        wanted.append(min(req.kv_hit_tokens, last_in_prompt))
    if policy.seen_branch and req.seen_branch:
        wanted.append(req.seen_branch)
    if policy.suffix_start and req.suffix_start:
        wanted.append(req.suffix_start)
    if policy.interval:
        n = policy.interval
        wanted += range((start // n + 1) * n, end + 1, n)
    if policy.chunk_end and end <= p:
        wanted.append(end // unit * unit)
    if len(wanted) > 1:
        wanted = sorted(set(wanted))
    out = [(b, False) for b in wanted if start < b <= end and b > 0]
    if policy.turn_end and end > p:
        b = end // unit * unit
        if b > start and b > last_in_prompt:
            out.append((b, True))
    return out


def points_by_priority(
    policy: AdmissionPolicy, req: Request, wanted: list[tuple[int, bool]], start: int, end: int, unit: int
) -> list[tuple[int, bool]]:
    """``wanted`` (:func:`admission_points` of the step ``(start, end]``) in the order a step
    takes their slots when the room cannot hold them all: the turn end, then the points the
    rules name (the prompt's end, the last block, the branch points, the suffix start, the
    chunk end), deepest first, then the ``interval`` checkpoints in boundary order. A point
    the turn end's rolling slot already serves is left out. The named points are the rules'
    points without the ``interval`` rule, so the rules are written once, in
    :func:`admission_points`, whose every-step path this leaves as it was.

    Why: a checkpoint below the prompt's end serves only a request that leaves this path
    below it, while the prompt's end and the turn end serve every request that repeats or
    extends the path, and a deeper one saves more of it. Taken in boundary order, a prompt
    that nearly filled the cache gave its few free slots to its first checkpoints and
    skipped its own end, so the next turn of the session resumed from the second
    checkpoint (qwen3-next-80b, an agentic session of 168k-token turns in a 175k-token
    cache: 9,664 tokens hit instead of 168,256).
    """
    named = {b for b, _ in admission_points(replace(policy, interval=0), req, start, end, unit)}
    turn = wanted[-1][0] if wanted and wanted[-1][1] else 0
    head = [(b, False) for b, rolling in reversed(wanted) if not rolling and b in named and b != turn]
    tail = [(b, False) for b, rolling in wanted if not rolling and b not in named and b != turn]
    return ([(turn, True)] if turn else []) + head + tail


def spare_points(policy: AdmissionPolicy, start: int, end: int) -> range:
    """Boundaries in ``(start, end]`` of the ``spare-interval`` rule (empty without it).

    They are wishes, not plans: the manager serves one only while the arena has a free slot
    (it never evicts for one) and ranks what it registers first to evict, so they are not
    part of :func:`admission_points` (an engine counting the slots a step needs must not
    count them).
    """
    n = policy.spare_interval
    if not n:
        return range(0)
    return range((start // n + 1) * n, end + 1, n)
