"""Checkpoints a session went past: ranked first to evict once its next turn resumes above them.

Why: value eviction ranks a snapshot by the prefill FLOPs it saves over the snapshot below
it on its request's path, per byte (GreedyDual). A session that extends its own turn ends
leaves, at every turn, the checkpoints its request saved inside that turn's new content (the
``interval`` rule's, and a prompt end whose turn end was not cached). The next turn resumes
from the turn end, above them; from then on they serve only a branch below that end. Their
value is up to ``interval`` tokens of context at depth, several times a turn end's (one turn
of tokens), so GreedyDual keeps them over the live sessions' turn ends and they pile up
through a long trace. Measured (agent seed 0, 4 GiB, 1,000 requests, ``checkpoints-3x`` as
a fixed setting), token hit rate per quarter: 0.907 / 0.906 / 0.870 / 0.819 without this
rule, 0.907 / 0.917 / 0.914 / 0.916 with it; SGLang's recency order does not degrade.

The rule, one request at a time:

- A request's registered snapshots form its *cohort* (:data:`Cohort`, in the order they
  were registered; ``CommitRegistrar.register_snapshot`` adds each).
- A request *extends* a cohort when its first allocation restores that cohort's deepest
  snapshot still cached (:func:`supersede`): it continues the request that saved it
  where it stopped (a session's next turn), not a branch inside it.
- When a request extends cohort ``C``, and ``C``'s own request extended a cohort too (the cohort's ``extends`` flag: its new content was a session's own turn), ``C``'s
  other snapshots below the restored one that no request has restored are marked gone
  past (:func:`supersede`): ranked first to evict, as a prompt-end snapshot is once its
  turn end is cached (``CommitRegistrar.demote_prompt_end``), still served while they are
  cached.

The second condition keeps the checkpoints of a first request: a document's first question
saves checkpoints inside the document, and its follow-up extends it, but a second question
on the document branches at the document's end and resumes from the deepest of them (without
the condition, docs at 1 GiB lost 0.064 on one seed). It ranks under value eviction only
(:meth:`PrefixIndex.supersede_snapshot <hybridcache.index.PrefixIndex.supersede_snapshot>`):
a recency order ages such checkpoints out by itself, and the peers' emulations stay as
their systems are; under any policy it is recorded (``UnitHandle.snap_superseded``), so
that a switch into value eviction ranks them as a manager that had run it all along. Demoting at the finish, not at the first allocation, keeps a refused
allocation free of effects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.index import PrefixIndex
    from hybridcache.unit_handle import UnitHandle


#: The snapshots one request registered: ``[extends, digest, digest, ...]``, where
#: ``extends`` says whether that request extended a cohort itself (:func:`supersede`)
#: and the digests come in registration order. A plain list, made once per request that
#: registers a snapshot, so that the bookkeeping costs one allocation and no call.
#: Invariant: a digest's handle belongs to the cohort while its ``snap_cohort`` is this very
#: list and its snapshot is cached; a later registration by another request, or an
#: eviction, ends that (the digest stays here and is skipped).
Cohort = list


def supersede(index: PrefixIndex, restore: UnitHandle) -> Cohort | None:
    """What a first allocation restoring ``restore`` does (module docstring), in one pass
    over ``restore``'s cohort: returns the cohort it extends (None: a branch inside it, or
    no cohort), and if that cohort's request extended one itself, marks its cached
    snapshots below ``restore`` that were never restored as gone past (ranked first under
    value eviction). A snapshot being restored now (``snap_ref``) is not queued and keeps
    its rank."""
    cohort = restore.snap_cohort
    if cohort is None:
        return None
    get, depth = index.handles.get, restore.depth
    below = []
    for d in cohort[1:]:
        n = get(d)
        if n is None or n.snap < 0 or n.snap_cohort is not cohort:
            continue
        if n.depth > depth:
            return None  # a deeper one is cached: a branch inside the turn
        if (n.depth < depth and not n.snap_hits and not n.snap_demoted and not n.snap_superseded
                and not n.snap_ref):
            below.append(n)
    if cohort[0]:
        for n in below:
            index.supersede_snapshot(n)
    return cohort
