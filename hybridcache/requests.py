"""Per-request bookkeeping of the manager (where admission wants snapshots is
:mod:`hybridcache.admission`).

Kept apart from :mod:`hybridcache.manager` so that the manager reads as the algorithm and
this file as the data it walks over.
"""

from __future__ import annotations

import bisect

from hybridcache.errors import InvalidRequestError
from hybridcache.hashing import TokenHasher
from hybridcache.index import UnitHandle
from hybridcache.runs import Run
from hybridcache.superseded import Cohort


class Request:
    """State of one live request.

    Units ``[0, units)`` are registered (their pages belong to cached units the request
    holds through ``holds``; for duplicates, listed in ``dup_pages``, the request computed
    its own copy and keeps it private). Units ``[units, units_allocated)`` have private pages.
    """

    __slots__ = (
        "id", "hasher", "tenant", "num_tokens", "prompt_len", "allocated", "counted",
        "units", "pages", "units_allocated", "dup_pages", "slot", "draft_slots", "saves",
        "rolling_slot", "rolling_boundary", "pending_rolling", "restore", "hit_tokens", "value_base", "kv_hit_tokens",
        "num_computed", "num_allocated", "step_start", "snap_marks", "walk", "holds", "hit_holds",
        "slide", "spare", "suffix_start", "cohort", "resumed_from", "seen_branch",
    )

    def __init__(self, request_id: str, hasher: TokenHasher, tenant: str | None, n: int) -> None:
        self.id = request_id
        self.hasher = hasher
        self.tenant = tenant
        self.num_tokens = n
        self.prompt_len = n
        self.reset()

    def reset(self) -> None:
        """Back to 'waiting': nothing held, nothing allocated."""
        self.allocated = False
        self.counted = False
        self.units = 0
        self.pages: list[list[int]] = []
        self.units_allocated = 0
        self.dup_pages: list[int] = []
        self.slot = -1
        self.draft_slots: list[int] = []
        self.saves: dict[int, int] = {}
        self.spare: list[int] = []  # boundaries of the spare-interval rule's saves, increasing
        self.suffix_start = 0  # the suffix-start rule's boundary (0: none), set at the first allocation
        self.rolling_slot = -1
        self.rolling_boundary = -1
        self.pending_rolling: tuple[int, int] | None = None
        self.restore: UnitHandle | None = None
        self.hit_tokens = 0
        # Where the request's snapshots are valued from (last_snapshot_boundary): its hit,
        # or, when the hit restored a spare checkpoint, that spare's own base.
        self.value_base = 0
        self.kv_hit_tokens = 0
        # The seen-branch rule's boundary (0: none), worked out once at the first allocation
        # (SeenPrefixes.point: its KV match and the record of evicted units).
        self.seen_branch = 0
        self.num_computed = 0
        self.num_allocated = 0
        self.step_start = 0
        self.snap_marks: list[int] = []
        self.walk: tuple[tuple[int, int], tuple[int, int, UnitHandle | None, list]] | None = None
        # Run holds (see hybridcache.runs) covering units ``[0, units)``, released at free; the first
        # ones, ``hit_holds``, are the matched hit (counted as hits once served).
        self.holds: list = []
        self.hit_holds: list = []
        # Per sliding-window cache, the request's pages there (hybridcache.coordinator);
        # empty for models without sliding windows.
        self.slide: list = []
        # The snapshots this request registered, and the digest of the snapshot its first
        # allocation resumed from when that extended the snapshot's cohort (None: it did
        # not; hybridcache.superseded).
        self.cohort: Cohort | None = None
        self.resumed_from: bytes | None = None

    def check_step(self, num_new_tokens: int, num_draft: int) -> None:
        """An allocation of ``num_new_tokens`` (``num_draft`` of them drafts) is a valid
        next step for this request; raises :class:`InvalidRequestError` otherwise."""
        rid = self.id
        if num_new_tokens <= 0:
            raise InvalidRequestError(f"request {rid!r}: num_new_tokens must be > 0")
        if not 0 <= num_draft < num_new_tokens:
            raise InvalidRequestError(f"request {rid!r}: num_draft must be in [0, {num_new_tokens - 1}]")
        if self.draft_slots:
            raise InvalidRequestError(f"request {rid!r}: accept() the drafts first")
        if self.allocated and self.num_allocated != self.num_computed:
            raise InvalidRequestError(
                f"request {rid!r}: commit the {self.num_allocated - self.num_computed} "
                "allocated tokens before allocating more"
            )

    def held_run(self, u: int) -> Run | None:
        """The run holding unit ``u``, one of the registered units ``[0, units)``."""
        for run, end in reversed(self.holds):
            if run.first <= u < run.first + end:
                return run
        return None

    def last_snapshot_boundary(self, boundary: int, *, mark: bool = True) -> int:
        """Deepest snapshot below ``boundary`` on this request's path (for marginal FLOPs);
        ``mark``: record ``boundary`` as one (spare checkpoints are not: they go first).

        Spare checkpoints never count as that snapshot, neither this request's own nor the
        one its hit restored (``value_base``): they are first to evict, so a snapshot valued
        from one (a document's end reached from a spare halfway) would keep the small value
        of the stretch past the spare after the spare is gone, and go before states worth
        less (docs/results.md, "A restored spare")."""
        marks = self.snap_marks
        i = bisect.bisect_left(marks, boundary)
        base = self.value_base
        best = max(base if base < boundary else 0, marks[i - 1] if i else 0)
        if mark and (i == len(marks) or marks[i] != boundary):
            marks.insert(i, boundary)
        return best


# Moved to hybridcache.admission; the old import path keeps working.
from hybridcache.admission import admission_points  # noqa: E402, F401
