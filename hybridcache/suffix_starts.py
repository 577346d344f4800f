"""Where a request's own suffix starts: the ``suffix-start`` admission rule's estimate.

A request that shares a document, a system prompt or a tool preamble with later requests
is left by them where their own parts begin. The ``branch-point`` rule saves a state there
only once a second request has diverged, and that second request itself resumes from the
deepest state below the point, which on a long shared prefix may be thousands of tokens
short of it (the document's end: its interval checkpoint or spare lies below). Nothing in
the first request says where its shared part ends, but the requests before it do: a
request whose KV match stops inside an earlier prompt (not at its end, nor at a turn's end,
which extending sessions continue from) left a sibling there, and its own suffix, prompt
length minus that match, is how far below its prompt's end the shared part stopped. A
match a state already serves to its end (the third question, resuming at the state the
second one's branch point left) is not counted: it tells nothing about new content. The
saved point must lie past the request's own match: a branch inside cached KV is the
``branch-point`` rule's to save.

:class:`SuffixStarts` keeps the last :data:`WINDOW` matches and, when at least half of them
left a sibling (documents asked several questions, sub-agents forked from one context),
predicts a new request's suffix to be the :data:`QUANTILE` of those suffixes: the rule
saves a state that far below the prompt's end, so that the next sibling resumes from it.
Where most matches extend a prompt or a turn (chat, agent sessions) there is no estimate
and the rule saves nothing. No constant depends on a trace: the window is the evidence,
the quantile places the state below most suffixes seen (a state inside a sibling's own
part serves nobody), and half is the point where siblings are the common case.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.requests import Request

#: Matches remembered (the estimate follows a change of workload within this many requests).
WINDOW = 64
#: The share of siblings' suffixes the saved state lies below.
QUANTILE = 0.9
#: Matches needed before any estimate.
MIN_MATCHES = 4
#: Prompt and turn ends remembered (digests of their last units), oldest forgotten first.
MAX_ENDS = 4096


def _boundary(prompt_len: int, matched: int, unit: int, suffix: int) -> int:
    """The unit boundary a request of ``prompt_len`` tokens whose KV match is ``matched``
    tokens is saved at, for a predicted own suffix of ``suffix`` tokens: that far below the
    last prompt boundary; 0 where the point is not past the match (a branch inside cached KV
    is the ``branch-point`` rule's, and a point below the match continues an earlier
    request, not this one's own part) or not before the prompt-end boundary."""
    last = (prompt_len - 1) // unit * unit
    b = (prompt_len - 1 - suffix) // unit * unit
    return b if matched < b < last else 0


class SuffixStarts:
    """Recent matches and the prompt and turn ends they are told apart by.

    Invariants: ``suffixes`` holds, per recent match with a KV hit, the request's own suffix
    in tokens (``None`` for a match that stopped at a remembered end: an extension), at most
    :data:`WINDOW` entries; ``_sorted`` is the sorted list of its non-``None`` entries.
    """

    def __init__(self) -> None:
        self.suffixes: deque[int | None] = deque()
        self._sorted: list[int] = []
        self._ends: OrderedDict[bytes, None] = OrderedDict()
        self._dropped: tuple[int | None, ...] = ()  # what the last push let go, if any (undo_match)
        self._counted: object = None  # the request whose match the last note_match counted (undo_match)

    def note_match(self, req: Request, unit: int, spare: bool = False) -> int:
        """Count ``req``'s match (its first allocation) and return the boundary the rule
        saves it at (0: none). ``spare``: for the ``spare-suffix-start`` rule, whose state
        only takes free room or another wish's slot, so that an estimate needs siblings
        in the window but not as the common case (:meth:`estimate`).

        Internal updates: the window of matches."""
        return self._match(req, req.kv_hit_tokens, req.hit_tokens, unit, spare)

    def preview(self, req: Request, kv_hit_tokens: int, hit_tokens: int, unit: int) -> int:
        """What :meth:`note_match` would return for ``req`` matched at these lengths, changing
        nothing (an engine planning a request's first step before allocating it): the match
        counted, then taken back as a refused allocation's is."""
        b = self._match(req, kv_hit_tokens, hit_tokens, unit, False)
        self.undo_match(req)
        return b

    def _match(self, req: Request, kv: int, hit: int, unit: int, spare: bool) -> int:
        self._counted = None
        if kv > 0:
            own = None if req.hasher.digests[kv // unit - 1] in self._ends else req.prompt_len - kv
            # A branch a state already serves (the branch-point rule's, from an earlier
            # sibling) says nothing about where new content will branch: not counted.
            if own is None or hit < kv:
                self._push(own)
                self._counted = req
        s = self.estimate(spare)
        return 0 if s is None else _boundary(req.prompt_len, kv, unit, s)

    def estimate(self, spare: bool = False) -> int | None:
        """The predicted own suffix in tokens: the :data:`QUANTILE` of the siblings' suffixes
        in the window; None with fewer than :data:`MIN_MATCHES` matches or siblings fewer
        than half of them, or with ``spare``, fewer than :data:`MIN_MATCHES` siblings.

        Half is where siblings are the common case, the bar for a state every request
        pays a slot for; a spare one (``spare-suffix-start``) costs only free room or
        another wish's slot, so siblings in the window are enough (documents asked
        beside chat sessions, where most matches extend a turn)."""
        srt, n = self._sorted, len(self.suffixes)
        if (len(srt) < MIN_MATCHES) if spare else (n < MIN_MATCHES or 2 * len(srt) < n):
            return None
        return srt[min(len(srt) - 1, int(QUANTILE * len(srt)))]

    def note_end(self, req: Request, unit: int) -> None:
        """Remember where a finished request's prompt and turn end (the digests of the
        units there), for telling a later match that extends them from one that leaves a
        sibling.

        Internal updates: the remembered ends (the oldest dropped past :data:`MAX_ENDS`)."""
        digests, p = req.hasher.digests, req.prompt_len
        ends, n = self._ends, len(digests)
        last, end = (p - 1) // unit, p // unit
        done = min(req.num_computed, req.num_tokens) // unit
        for u in ((last, done) if last == end else (last, end, done)):
            if 0 < u <= n:
                d = digests[u - 1]
                ends[d] = None
                ends.move_to_end(d)
        while len(ends) > MAX_ENDS:
            ends.popitem(last=False)

    def undo_match(self, req: Request) -> None:
        """Take back ``req``'s match if the last :meth:`note_match` counted it (a first
        allocation refused after it: a refused call changes nothing).

        Internal updates: the window of matches, as it was before that call."""
        if self._counted is not req:
            return
        self._counted = None
        own = self.suffixes.pop()
        if own is not None:
            del self._sorted[bisect.bisect_left(self._sorted, own)]
        for old in self._dropped:
            self.suffixes.appendleft(old)
            if old is not None:
                bisect.insort(self._sorted, old)
        self._dropped = ()

    def _push(self, own: int | None) -> None:
        q = self.suffixes
        self._dropped = ()
        if len(q) == WINDOW:
            old = q.popleft()
            self._dropped = (old,)
            if old is not None:
                del self._sorted[bisect.bisect_left(self._sorted, old)]
        q.append(own)
        if own is not None:
            bisect.insort(self._sorted, own)

    def sanity_check(self) -> None:
        """Raise AssertionError if an invariant does not hold."""
        assert len(self.suffixes) <= WINDOW
        assert self._sorted == sorted(s for s in self.suffixes if s is not None)
        assert len(self._ends) <= MAX_ENDS
