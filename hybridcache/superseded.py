"""Checkpoints a session went past: ranked first to evict once its next turn resumes above them.

Why: value eviction ranks a snapshot by the prefill FLOPs it saves over the snapshot below
it on its request's path, per byte (GreedyDual). A session that extends its own turn ends
leaves, at every turn, the checkpoints its request saved inside that turn's new content (the
``interval`` rule's, and a prompt end whose turn end was not cached), and the turn end it
resumed from. The next turn resumes from the newest turn end, above them; from then on they
serve only a branch below it (a retried turn, a sub-agent forked mid-context). A checkpoint's
value is up to ``interval`` tokens of context at depth, several times a turn end's (one turn
of tokens), so GreedyDual kept them over the live sessions' turn ends and they piled up
through a long trace. Measured (agent seed 0, 4 GiB, 1,000 requests, ``checkpoints-3x`` as a
fixed setting), token hit rate per quarter: 0.907 / 0.906 / 0.870 / 0.819 without the rule,
0.907 / 0.917 / 0.914 / 0.916 with the checkpoints ranked first, 0.911 / 0.918 / 0.923 /
0.920 with the old turn ends too; SGLang's recency order does not degrade.

The rule, one request at a time:

- A request's registered snapshots form its *cohort* (:data:`Cohort`, in the order they
  were registered; ``CommitRegistrar.register_snapshot`` adds each).
- A request *extends* a cohort when its first allocation restores that cohort's deepest
  snapshot still cached (:func:`supersede`): it continues the request that saved it where
  it stopped (a session's next turn), not a branch inside it.
- When a request extends cohort ``C`` and ``C``'s own request extended a cohort too (its
  new content was a session's own turn), ``C``'s other snapshots below the restored one
  that no request has restored, and the turn end ``C``'s request resumed from if that
  request was its only restore, are marked gone past: ranked first to evict, as a
  prompt-end snapshot is once its turn end is cached (``CommitRegistrar.register_turn_end``),
  and still served while they are cached. A snapshot restored by another request since
  (a retried turn, a sibling) keeps its rank.

The second condition keeps the checkpoints of a first request: a document's first question
saves checkpoints inside the document, and its follow-up extends it, but a second question
on the document branches at the document's end and resumes from the deepest of them (without
the condition, docs at 1 GiB lost 0.064 on one seed). It ranks under value eviction only
(:meth:`PrefixIndex.supersede_snapshot <hybridcache.index.PrefixIndex.supersede_snapshot>`):
a recency order ages such entries out by itself, and the peers' emulations stay as their
systems are; under any policy it is recorded (``UnitHandle.snap_superseded``), so that a
switch into value eviction ranks them as a manager that had run it all along. The marking
is made by a first allocation after its count (which rules out a refusal), so a refused
allocation changes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.index import PrefixIndex
    from hybridcache.unit_handle import UnitHandle


#: The snapshots one request registered: ``[resumed, digest, digest, ...]``, where
#: ``resumed`` is the digest of the snapshot that request resumed from when it extended a
#: cohort itself (None: it did not; :func:`supersede`) and the digests come in registration
#: order. A plain list, made once per request that registers a snapshot, so that the
#: bookkeeping costs one allocation and no call.
#: Invariant: a digest's handle belongs to the cohort while its ``snap_cohort`` is this very
#: list and its snapshot is cached; a later registration by another request, or an
#: eviction, ends that (the digest stays here and is skipped).
Cohort = list


def _unmarked(n: UnitHandle) -> bool:
    """A cached, queued snapshot not ranked first yet (neither demoted nor gone past)."""
    return n.snap >= 0 and not n.snap_demoted and not n.snap_superseded and not n.snap_ref


def supersede(index: PrefixIndex, restore: UnitHandle) -> Cohort | None:
    """What a first allocation restoring ``restore`` does (module docstring), in one pass
    over ``restore``'s cohort: returns the cohort it extends (None: a branch inside it, or
    no cohort). If that cohort's request extended one itself, its cached snapshots below
    ``restore`` that were never restored, and the snapshot it resumed from if that request
    was its only restore (one hit), are marked gone past (ranked first under value
    eviction). A snapshot being restored now (``snap_ref``) is not queued and keeps its
    rank. The manager calls it only for a ``restore`` with a cohort."""
    cohort = restore.snap_cohort
    get, depth, resumed = index.handles.get, restore.depth, cohort[0]
    below = []
    for d in cohort[1:]:
        n = get(d)
        if n is None or n.snap < 0 or n.snap_cohort is not cohort:
            continue
        if n.depth > depth:
            return None  # a deeper one is cached: a branch inside the turn
        if resumed is not None and n.depth < depth and not n.snap_hits and _unmarked(n):
            below.append(n)
    if resumed is not None:
        prev = get(resumed)  # where the cohort's request resumed: the turn before
        if prev is not None and prev.snap_hits == 1 and prev.depth < depth and _unmarked(prev):
            below.append(prev)
        for n in below:
            index.supersede_snapshot(n)
    return cohort
