"""Room a later request of a step may take back (withdraw) instead of evicting a cached
entry or being refused: the save points handed out in the step and not yet written, and
running requests' settled turn-end slots.

An engine that runs one request at a time (the simulator, the reference runner) commits a
request's step before it allocates the next, so a save point's slot is a registered,
evictable snapshot by the time anyone else needs room. An engine that allocates a whole
batch before it runs the step (vLLM's scheduler) holds every save slot of the batch at
once: a slot the ``spare-interval`` rule took from free room, or the last free block an
interval checkpoint took, is then missing for a later request of the same step, which
evicts for it or, when nothing is evictable, is refused (a preemption a save caused).

What a withdrawal takes back, and in which order (:meth:`PendingSaves.withdraw`):

- **spare checkpoints first**, before any cached entry is evicted: once registered they
  rank first to evict anyway (:mod:`hybridcache.admission`);
- **other save points** only when nothing else is evictable, and never for another save
  point (an optional save taking an optional save's room gains nothing): a state that is
  merely worth keeping never costs a running request its place;
- among save points, the latest grant first (the request scheduled last in the step);
- **then, last, a running request's turn-end slot** (its rolling slot, registered when it
  finishes so that the next turn resumes after the answer), once settled: written in a
  step before the request's current one (``0 < rolling_boundary < step_start``), so that
  nothing reads it before the request finishes, not even an engine that serves saves in
  place and copies the step's state out of that block in the next step (vLLM). The
  request goes on computing and only its turn-end snapshot is lost (it saves a new one at
  its next turn-end point if there is room); preempting a request instead costs its
  computed tokens and its turn-end slot too. The latest-added request's first, the one
  vLLM would preempt first.

The engine must not write a withdrawn save point (:meth:`take_withdrawn`). Withdrawal is
therefore off until the engine declares it drops them
(:meth:`hybridcache.port.EnginePort.allow_save_withdrawal`): an engine that has already
launched a request's step would write into a slot someone else then holds. "Settled"
assumes a step has run before the next one is allocated (synchronous scheduling; the vLLM
adapter refuses asynchronous scheduling). A save served
in place (:meth:`~hybridcache.save_points.SavePointControl.save_in_running_slot`, vLLM's
Mamba layers) swaps the running slot and the save slot; withdrawing it swaps them back and
frees the fresh slot, which the engine would only have used from the next step on.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.arena import Arena
    from hybridcache.requests import Request


class WithdrawnSave(NamedTuple):
    """A save point taken back before its step ran, or a running request's settled
    turn-end slot: the engine must not write ``slot`` for the request any more.

    Attributes:
        request_id: the request whose step held it.
        boundary: the save point's token boundary (no snapshot is registered there).
        slot: the slot freed; for a save served in place, the fresh slot that would have
            become the running one (the request computes in its old running slot again).
        in_place: whether the save had been served in place.
        turn_end: a running request's settled turn-end slot (written in an earlier step,
            read by nobody): the request has no turn-end state until its next one.
    """

    request_id: str
    boundary: int
    slot: int
    in_place: bool
    turn_end: bool = False


class PendingSaves:
    """The save points of the step being allocated, and the live requests' settled
    turn-end slots: what a later allocation of the step may take back (module docstring).

    Args:
        requests: the manager's live requests (a grant is pending while its request is
            live and still holds the save point with the granted slot).
        arena: where withdrawn slots go back.
    """

    __slots__ = ("requests", "arena", "grants", "withdrawn", "optional")

    def __init__(self, requests: dict[str, Request], arena: Arena) -> None:
        self.requests = requests
        self.arena = arena
        #: ``(request, boundary, slot)`` in grant order (a spare's boundary is in its
        #: request's ``spare`` list); entries whose save was written, cancelled or freed
        #: since are dropped lazily (:meth:`_pending`).
        self.grants: list[tuple[Request, int, int]] = []
        #: Withdrawn since the engine last took them (:meth:`take_withdrawn`).
        self.withdrawn: list[WithdrawnSave] = []
        #: True while the manager schedules save points: they may take spares back but
        #: never another save point (module docstring).
        self.optional = False

    def note(self, req: Request, boundary: int, slot: int) -> None:
        """Record a save point just handed out (``req.saves[boundary] == slot``)."""
        grants = self.grants
        grants.append((req, boundary, slot))
        if len(grants) > 64 + 4 * len(self.requests):  # keep the list at O(step) size
            self.grants = [g for g in grants if self._pending(g)]

    def _pending(self, grant: tuple[Request, int, int]) -> bool:
        """Whether a grant still holds its slot unwritten: its request is live and the save
        point holds the slot, or (served in place) the request computes in it."""
        req, b, s = grant
        held = req.saves.get(b)
        return held is not None and (held == s or req.slot == s) and self.requests.get(req.id) is req

    def slots(self) -> list[int]:
        """Every slot an allocation that must be served could take back: the pending save
        points' and the settled turn-end slots (a walk over the live requests, so the room
        count asks only when the answer is no without them)."""
        self.grants = grants = [g for g in self.grants if self._pending(g)]
        return [g[2] for g in grants] + [r.rolling_slot for r in self._settled_turn_ends()]

    def _settled_turn_ends(self) -> list[Request]:
        """Live requests whose turn-end slot is settled (module docstring), latest-added
        first."""
        return [r for r in reversed(self.requests.values())
                if r.rolling_slot >= 0 and 0 < r.rolling_boundary < r.step_start]

    def withdraw(self, *, spares_only: bool) -> bool:
        """Take back the latest pending spare (``spares_only``), or else, unless
        :attr:`optional`, the latest pending save point of any kind, then a settled
        turn-end slot; False when there is none.

        Internal updates: the save point leaves its request (``saves``; ``spare``), a save
        served in place gives the request its old running slot back, a turn-end slot
        leaves its request (``rolling_slot``, ``rolling_boundary``), the slot returns to
        the arena, and a :class:`WithdrawnSave` is queued for the engine.
        """
        if not spares_only and self.optional:
            return False
        grants = self.grants
        for i in range(len(grants) - 1, -1, -1):
            g = grants[i]
            if not self._pending(g):
                del grants[i]
                continue
            if spares_only and not _is_spare(g[0], g[1]):
                continue
            del grants[i]
            self._undo(*g)
            return True
        if spares_only:
            return False
        for req in self._settled_turn_ends():
            b, s = req.rolling_boundary, req.rolling_slot
            req.rolling_slot = req.rolling_boundary = -1
            self.arena.free_slot(s)
            self.withdrawn.append(WithdrawnSave(req.id, b, s, False, True))
            return True
        return False

    def _undo(self, req: Request, b: int, s: int) -> None:
        in_place = req.saves[b] != s
        if in_place:  # save_in_running_slot swapped them: swap back
            req.slot = req.saves[b]
        del req.saves[b]
        if _is_spare(req, b):
            req.spare.remove(b)
        self.arena.free_slot(s)
        self.withdrawn.append(WithdrawnSave(req.id, b, s, in_place))

    def take_withdrawn(self) -> list[WithdrawnSave]:
        """The save points withdrawn since the last call, oldest first."""
        out, self.withdrawn = self.withdrawn, []
        return out


def _is_spare(req: Request, boundary: int) -> bool:
    """Whether the request's save point at ``boundary`` is a spare checkpoint (its
    ``spare`` list, kept sorted, marks them)."""
    spares = req.spare
    i = bisect_left(spares, boundary)
    return i < len(spares) and spares[i] == boundary
