"""Save points beside the admission rules' own: those an engine serves in place (for engines
whose kernels write a step's final state into the running slot, vLLM's Mamba layers, instead
of copying it to a save slot) and the spare checkpoints of the ``spare-interval`` rule.

Kept apart from :mod:`hybridcache.manager`: the manager's own path calls
:meth:`SavePointControl._rule_saves_first` (the admission rules' save points, before the
step's pages as far as the room holds both, the turn end and the prompt's end first) and
:meth:`SavePointControl._schedule_saves` (the rules' points left, then the spare ones); the
vLLM adapter uses the rest (see ``docs/vllm.md``).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hybridcache.admission import admission_points, points_by_priority, spare_points
from hybridcache.errors import InvalidRequestError
from hybridcache.pending_saves import PendingSaves, WithdrawnSave
from hybridcache.plans import SavePoint

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.requests import Request


class SavePointControl:
    """Relabel or drop a request's save points (mixed into the manager)."""

    # Provided by the manager.
    arena: Any
    admission: Any
    index: Any
    metrics: Any
    requests: dict[str, Request]
    unit: int
    has_state: bool
    _fits: Callable[..., bool]
    _seen: dict[bytes, int]
    _get: Callable[[str], Request]

    def _rule_saves_first(self, req: Request, start: int, end: int,
                          page_units: int) -> tuple[list[SavePoint], list[tuple[int, bool]]]:
        """The admission rules' save points in ``(start, end]``, their slots taken *before*
        the step's ``page_units`` units of pages as far as the room holds both.

        Returns:
            The save points taken, and the points left for after the pages
            (:meth:`_schedule_saves` takes them as room allows): none when the room holds
            every point with the pages; otherwise the points the room does not hold, in
            the order of :func:`~hybridcache.admission.points_by_priority` (the turn end
            and the prompt's end before the interval checkpoints), whose first points are
            the ones taken here.

        Why before: a slot needs an empty block whenever a state outweighs a page (one slot
        per block, :mod:`hybridcache.room`). After the pages, the step's own pages are
        pinned in blocks they share with cached KV, and a long prompt that fills most of
        the arena can leave no block that eviction may empty: the save point is skipped
        although the room held it. On agentic sessions at 1 GiB (24 blocks, 100k-token
        contexts) whole turns lost their prompt-end and turn-end states that way, and the
        next turn missed. The running slot comes before the pages for the same reason.
        Counted first (``fits``), so taking them never leaves the pages short; counted
        without the slots a batching engine's step may take back
        (:mod:`hybridcache.pending_saves`), or the pages could take back these very save
        points (the latest grants) after the allocation had handed them out. When the room
        does not hold them all (rare: the room holds the pages and ``len(wanted)`` more
        blocks unless nearly everything cached is held), the largest count it holds is
        found by bisection and the points are worked out again in priority order rather
        than carried on every step.
        """
        if not self.has_state:
            return [], []
        wanted = admission_points(self.admission, req, start, end, self.unit)
        if wanted and self.admission.min_seen > 1:
            wanted = self._seen_points(req, wanted)
        if not wanted:
            return [], []
        if self._fits(page_units, len(wanted), take_back=False):
            with self.index.slot_batch():
                return self._rule_saves(req, wanted), []
        order = points_by_priority(self.admission, req, wanted, start, end, self.unit)
        # The room holds ``lo`` slots beside the pages (the step fits), and no more than
        # ``hi`` (``order`` leaves out a point the turn end's slot serves: maybe all of it).
        lo, hi = 0, len(order)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._fits(page_units, mid, take_back=False):
                lo = mid
            else:
                hi = mid - 1
        if not lo:
            return [], order
        with self.index.slot_batch():
            return self._rule_saves(req, order[:lo]), order[lo:]

    def _schedule_saves(self, req: Request, taken: list[SavePoint], rest: list[tuple[int, bool]],
                        start: int, end: int) -> tuple[SavePoint, ...]:
        """The step's save points in ``(start, end]``: the admission rules' (each with a slot;
        the turn-end one in the request's rolling slot), ``taken`` already by
        :meth:`_rule_saves_first` and ``rest`` taken now, each evicting for it, as room
        allows; then the spare ones. In boundary order, the spare ones last."""
        if not self.has_state:
            return ()  # no state: no save point, whatever admission wants
        spares = self.admission.spare_interval or self.admission.spare_suffix_start  # the adaptive policy's
        if not rest and not spares:
            return tuple(taken)
        with self.index.slot_batch():
            if rest:
                taken = taken + self._rule_saves(req, rest)
                taken.sort()
            if spares:
                taken += self._spare_saves(req, start, end)
        return tuple(taken)

    def _rule_saves(self, req: Request, wanted: list[tuple[int, bool]]) -> list[SavePoint]:
        """Slots for the admission rules' save points ``wanted`` (``admission_points``), each
        evicting for it; a point without room is skipped (``snapshots_skipped``)."""
        out: list[SavePoint] = []
        pend = self.index.pending_saves  # a batching engine's (hybridcache.pending_saves)
        if pend is not None:
            pend.optional = True  # a save point takes back spares, never a save point
        try:
            for b, rolling in wanted:
                if b in req.saves:
                    continue
                if rolling and req.draft_slots:
                    # Inside a speculative step the boundary may be rejected: write it to a
                    # fresh slot so the last accepted turn-end state survives until accept().
                    s = self.index.alloc_slot()
                    if s is None:
                        self.metrics.snapshots_skipped += 1
                        continue
                    req.pending_rolling = (b, s)
                    out.append(SavePoint(b, s))
                    continue
                if rolling:
                    if req.rolling_slot < 0:
                        s = self.index.alloc_slot()
                        if s is None:
                            self.metrics.snapshots_skipped += 1
                            continue
                        req.rolling_slot = s
                    req.rolling_boundary = b
                    out.append(SavePoint(b, req.rolling_slot))
                    continue
                s = self.index.alloc_slot()
                if s is None:
                    self.metrics.snapshots_skipped += 1
                    continue
                req.saves[b] = s
                if pend is not None:
                    pend.note(req, b, s)
                out.append(SavePoint(b, s))
        finally:
            if pend is not None:
                pend.optional = False
        return out

    def _seen_points(self, req: Request, wanted: list[tuple[int, bool]]) -> list[tuple[int, bool]]:
        """The points of ``wanted`` that ``min_seen`` lets save: the turn end (never counted:
        its content is new), a point this request saved already, and a point wanted that
        many times. Filtered before the room is counted and the points are ranked, so that
        a point the rule will not save takes no slot of the room from one it will (a long
        document's question end, new each time, ranked before the document's branch
        point). The ``seen-branch`` point passes as seen twice: an earlier prompt went past
        it. Each point is counted once per step.

        Internal updates: the counts of the points it checks (``_seen``)."""
        seen = req.seen_branch if self.admission.seen_branch else 0
        return [(b, rolling) for b, rolling in wanted
                if rolling or b == seen or b in req.saves or self._seen_enough(req, b)]

    def _seen_enough(self, req: Request, boundary: int) -> bool:
        u = boundary // self.unit - 1
        if u >= len(req.hasher.digests):
            return False  # decode tokens not known yet: new content, never seen before
        d = req.hasher.digests[u]
        n = self._seen.get(d, 0) + 1
        if len(self._seen) > 1_000_000:
            self._seen.clear()
        self._seen[d] = n
        return n >= self.admission.min_seen

    def _spare_saves(self, req: Request, start: int, end: int) -> list[SavePoint]:
        """Save points of the ``spare-interval`` rule in ``(start, end]``, each only while the
        arena has a free slot (``Arena.alloc_slot`` never evicts): called after the step's
        pages and its own save points are allocated, so a spare one never takes room the step
        needs. They are marked on the request (``spare``) so that registration ranks them
        first to evict and leaves them out of the FLOPs the next snapshot is valued by. A
        batching engine's later request of the same step may take them back before it
        evicts anything (hybridcache.pending_saves).

        The ``spare-suffix-start`` point comes first: into a free slot, or else (not for a
        batching engine) the slot of the demoted snapshot the next eviction would take
        (:meth:`~hybridcache.eviction.Evictor.slot_from_demoted`). Returned in boundary
        order."""
        out: list[SavePoint] = []
        if not self.has_state:
            return out
        pol = self.admission
        b = req.suffix_start
        if pol.spare_suffix_start and not pol.suffix_start and start < b <= end:
            # The predicted sibling's resume point: worth more than an interval spare, so it
            # may take the slot of a demoted snapshot (never of what the rules made), unless
            # a batching engine may yet drop the save (hybridcache.pending_saves).
            if b not in req.saves and b != req.rolling_boundary:
                s = self.arena.alloc_slot()
                if s is None and self.index.pending_saves is None:
                    s = self.index.slot_from_demoted()
                if s is not None:
                    self._note_spare(req, b, s, out)
        first = len(out)  # the suffix start, if taken, goes before the interval spares
        if not self.arena.may_have_slot():
            return out  # no free room: every alloc_slot below would refuse (most steps under pressure)
        for b in spare_points(pol, start, end):
            if b in req.saves or b == req.rolling_boundary:
                continue
            s = self.arena.alloc_slot()
            if s is None:
                break
            self._note_spare(req, b, s, out)
        if first and len(out) > first:
            out.sort()
        return out

    def _note_spare(self, req: Request, b: int, s: int, out: list[SavePoint]) -> None:
        req.saves[b] = s
        i = bisect.bisect_left(req.spare, b)  # kept sorted (a rejected step re-plans)
        if i == len(req.spare) or req.spare[i] != b:
            req.spare.insert(i, b)
        pend = self.index.pending_saves
        if pend is not None:
            pend.note(req, b, s)
        out.append(SavePoint(b, s))

    def allow_save_withdrawal(self) -> None:
        """The engine allocates several requests before it runs a step, and drops the save
        points :meth:`take_withdrawn_saves` lists before it runs the step: from now on a
        later allocation of the step takes back an earlier one's pending spare checkpoint
        before it evicts, and any pending save point before it is refused
        (:mod:`hybridcache.pending_saves`). Idempotent."""
        if self.index.pending_saves is None:
            self.index.pending_saves = PendingSaves(self.requests, self.arena)

    def take_withdrawn_saves(self) -> list[WithdrawnSave]:
        """Save points taken back since the last call (empty unless
        :meth:`allow_save_withdrawal` was called): the engine must not write them, and no
        snapshot is registered at their boundaries. A save served in place
        (``in_place``) gave the request its old running slot back."""
        pend = self.index.pending_saves
        return pend.take_withdrawn() if pend is not None else []

    def save_in_running_slot(self, request_id: str, boundary: int) -> int:
        """Serve a save point without a copy: the state at ``boundary`` will be left in the
        running slot at the end of this step.

        Engines whose kernels write the step's final state in place (vLLM's Mamba layers)
        save at a step end by relabelling: the running slot becomes the save point's slot
        and the save point's fresh slot becomes the running one. Valid only when
        ``boundary`` is the end of the step just allocated.

        Returns:
            The new running slot: the engine must copy the state into it before the next
            step computes (vLLM's copy-on-extend does exactly that).
        """
        req = self._get(request_id)
        if boundary != req.num_allocated:
            raise InvalidRequestError(
                f"request {request_id!r}: save at {boundary} is not the end of the step "
                f"({req.num_allocated})"
            )
        if boundary == req.rolling_boundary and req.rolling_slot >= 0:
            req.rolling_slot, req.slot = req.slot, req.rolling_slot
        elif boundary in req.saves:
            req.saves[boundary], req.slot = req.slot, req.saves[boundary]
        else:
            raise InvalidRequestError(f"request {request_id!r}: no save point at {boundary}")
        return req.slot

    def cancel_save(self, request_id: str, boundary: int) -> None:
        """Drop a save point the engine cannot honour; no snapshot is registered for it."""
        req = self._get(request_id)
        if boundary == req.rolling_boundary:
            req.rolling_boundary = -1
        elif boundary in req.saves:
            self.arena.free_slot(req.saves.pop(boundary))
        else:
            raise InvalidRequestError(f"request {request_id!r}: no save point at {boundary}")
