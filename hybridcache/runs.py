"""Runs: consecutive KV units registered together, the unit of holding and value ranking.

A request registers the units it computed in one go, so they form a *run*: nodes ``R[0],
R[1], ...`` where each is the next unit of the one before on one token chain. Because
digests are chained, any path from the first unit that reaches ``R[j]`` passes through
``R[0..j)`` (the digest of ``R[j]`` names its whole prefix), so every hold on a run is a
*prefix* ``[0, end)`` of it. That turns per-unit bookkeeping into per-run bookkeeping:

- **Holds.** A run keeps a multiset of hold ends; units ``[0, held)`` are pinned, where
  ``held`` is the largest end. Holding or releasing a 170-unit prefix is one dict update,
  not 170 node updates. Which arena blocks a held prefix pins is read from the run's block
  segments (one step per block) when a slot allocation asks.
- **Value ranking.** A unit's hits and last release only grow towards the head of its run
  (whoever used ``R[j]`` used ``R[0..j)`` too), so the tail is always a run's lowest-ranked
  unit. :class:`~hybridcache.policies.value.RunValueQueue` queues one entry per run, its tail; evicting it exposes the
  next tail. Hits and release times are stored per hold end, and a unit's values are read
  from the ends past it.
- **Eviction** only removes unpinned units, at or past ``held``: taking the tail shortens
  the run; taking a unit inside it (LRU or Marconi choosing around pinned slabs) splits it,
  and the part past the victim becomes a run of its own (a path reaches it again only once
  the victim is recomputed, by a new run).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Mapping, Sequence

    from hybridcache.index import UnitHandle

#: Makes (or finds) the handle of the unit at a position of a run (``PrefixIndex.handle``).
UnitOf = Callable[["Run", int], "UnitHandle"]
#: A victim filter on a unit's pages, one per attention group.
PagesPred = Callable[[tuple[int, ...]], bool]
#: A filter's walk over one group's block segments ``(starts, blocks)`` from position
#: ``start`` down to ``held``: the deepest position it accepts, -1 for none.
SegmentScan = Callable[[list[int], list[int], int, int], int]


class Run:
    """Consecutive units of one chain, registered together (see module docstring).

    A unit of a run is ``(run, pos)``; no per-unit object exists unless someone asks for
    one (:meth:`PrefixIndex.handle <hybridcache.index.PrefixIndex.handle>`). Its digest is
    ``digests[pos]``, its page in group ``g`` is ``pages[g][pos]`` and its depth (unit index
    in the chain) is ``first + pos``: a run's units have consecutive depths.
    """

    __slots__ = (
        "digests", "pages", "segs", "holds", "held", "hits", "rel", "flops", "first", "tenant",
        "qseq", "qprio", "fork", "tokens", "sseq", "srel",
    )

    def __init__(self, flops: float, groups: int, first: int, tenant: str | None) -> None:
        """An empty run whose first unit will be unit ``first`` of its chain; :meth:`extend`
        adds its units."""
        self.digests: list[bytes] = []
        self.pages: list[list[int]] = [[] for _ in range(groups)]  # per group, by position
        self.segs: list[tuple[list[int], list[int]]] = [([], []) for _ in range(groups)]
        # Keyed by hold end, never past the run's length (ends are folded as it shrinks):
        self.holds: dict[int, int] = {}  # number of holds
        self.held = 0  # units [0, held) are pinned
        self.hits: dict[int, int] = {}  # counted hits of holds that ended there
        # (priority base, release number) at the last release: the number ranks equal
        # priorities in release order, as a per-unit heap ranks them in push order.
        self.rel: dict[int, tuple[float, int]] = {}
        self.flops = flops
        self.first = first
        self.tenant = tenant
        self.qseq = 0  # RunValueQueue entry of the current tail (0: none)
        self.qprio = 0.0
        self.sseq = 0  # recency: when the tail was last found stranded (RunValueQueue)
        self.srel = 0  # ... and the tail's release number then
        self.fork = 0  # where the last walk that left the run early left it (a hint)
        #: The units' token ids as the bytes they hash (the same size per unit), so that a
        #: prompt with equal tokens takes the run's digests instead of hashing them
        #: (:meth:`TokenHasher.extend_reusing <hybridcache.hashing.TokenHasher.extend_reusing>`);
        #: ``None`` once any unit came without them (digests only, multimodal extras).
        self.tokens: bytearray | None = bytearray()

    @classmethod
    def of(
        cls, digests: list[bytes], pages: list[list[int]], flops: float, ppb: int, first: int,
        tenant: str | None, tokens: bytes | bytearray | None = None,
    ) -> Run:
        """A run of the units ``digests`` (consecutive, from depth ``first``) whose pages per
        group are ``pages`` (and token bytes ``tokens``, if known)."""
        run = cls(flops, len(pages), first, tenant)
        run.extend(digests, pages, ppb, tokens)
        return run

    def __len__(self) -> int:
        return len(self.digests)

    def __repr__(self) -> str:
        return f"Run(first={self.first}, len={len(self.digests)}, held={self.held}, holds={self.holds})"

    def extend(
        self, digests: list[bytes], pages: list[list[int]], ppb: int, tokens: bytes | bytearray | None = None
    ) -> None:
        """Append units that continue the run's chain (a new run, or one whose whole length
        the registering request holds, so every path to the new units crosses it).

        Args:
            digests: the units' digests, in order.
            pages: per attention group, the units' pages.
            ppb: pages per arena block (for the block segments).
            tokens: the units' token bytes (``None``: unknown, and the run keeps none).
        """
        if self.tokens is not None:
            if tokens is None:
                self.tokens = None
            else:
                self.tokens += tokens
        self.digests += digests
        for pl, new, (starts, blocks) in zip(self.pages, pages, self.segs):
            add_segments(starts, blocks, new, len(pl), ppb)
            pl += new

    def unit_pages(self, pos: int) -> tuple[int, ...]:
        """The pages of the unit at ``pos``, one per group."""
        pages = self.pages
        if len(pages) == 1:  # one attention group: no generator (a victim scan asks often)
            return (pages[0][pos],)
        return tuple([p[pos] for p in pages])

    def ref(self, pos: int) -> int:
        """Holds covering the unit at ``pos`` (its reference count)."""
        return sum(c for end, c in self.holds.items() if end > pos)

    def hit_count(self, pos: int) -> int:
        """Counted hits of the unit at ``pos``."""
        return sum(c for end, c in self.hits.items() if end > pos)


#: A request's hold on a run: units ``[0, end)`` of ``run``.
Hold = tuple[Run, int]


def block_segments(pages: list[int], ppb: int) -> tuple[list[int], list[int]]:
    """``(starts, blocks)``: maximal stretches of positions whose pages share a block."""
    starts: list[int] = []
    blocks: list[int] = []
    add_segments(starts, blocks, pages, 0, ppb)
    return starts, blocks


def add_segments(starts: list[int], blocks: list[int], new: list[int], base: int, ppb: int) -> None:
    """Extend the segments ``(starts, blocks)`` with pages ``new`` at positions ``base...``.

    Pages of a table are distinct, so pages spanning exactly ``n`` ids in increasing order
    are consecutive (checked by one sort of an already sorted list, without making ``n``
    new integers).
    """
    n = len(new)
    if not n:
        return
    last = blocks[-1] if blocks else -1
    p0 = new[0]
    if new[-1] - p0 == n - 1 and sorted(new) == new:
        # Consecutive pages (bulk allocation): a new segment at each block start.
        b = p0 // ppb
        if b != last:
            starts.append(base)
            blocks.append(b)
        k = (b + 1) * ppb - p0  # position of the first page in the next block
        while k < n:
            starts.append(base + k)
            b += 1
            blocks.append(b)
            k += ppb
        return
    b = min(new) // ppb
    if b == max(new) // ppb:
        # Every page in one slab (freed entries of the open slab, in any order): one
        # segment, found by two C loops instead of one Python step per page.
        if b != last:
            starts.append(base)
            blocks.append(b)
        return
    for i, p in enumerate(new, base):
        b = p // ppb
        if b != last:
            starts.append(i)
            blocks.append(b)
            last = b


def uncached_stretch(
    heads: Mapping[bytes, Run], digests: Sequence[bytes] | Mapping[int, bytes], first: int, end: int
) -> list[bytes]:
    """The digests of a chain's units ``first, first+1, ...`` before ``end`` up to the first
    one that has KV: what a registration from ``first`` (which has none) may add.

    A unit past ``first`` that has KV is the first unit of a run (its unit before, one of
    ours, has none), so only run heads can cut the stretch short: one set test over the
    run heads, not a walk.
    """
    if isinstance(digests, list):
        ds = digests[first:end]
        if not heads.keys().isdisjoint(ds):
            ds = ds[: next(k for k, d in enumerate(ds) if d in heads)]
        return ds
    out: list[bytes] = []
    for i in range(first, end):
        if digests[i] in heads:
            break
        out.append(digests[i])
    return out


def shift_blocks(counts: list[int], run: Run, lo: int, hi: int, delta: int) -> None:
    """Add ``delta`` to ``counts[block]`` for every page of the units at ``[lo, hi)``, in
    every group: one step per block segment, not per page."""
    n_units = len(run.digests)
    for starts, blocks in run.segs:
        if len(starts) == 1:  # the run's pages of this group share one block
            counts[blocks[0]] += delta * (hi - lo)
            continue
        i = bisect_right(starts, lo) - 1
        n = len(starts)
        while i < n:
            s = starts[i]
            if s >= hi:
                break
            e = starts[i + 1] if i + 1 < n else n_units
            counts[blocks[i]] += delta * ((e if e < hi else hi) - (s if s > lo else lo))
            i += 1


def pop_tail(run: Run) -> bytes:
    """Remove the run's last unit; returns its digest."""
    n = len(run.digests) - 1
    t = run.tokens
    if t is not None:  # _cut_tokens, inline: single evictions come by the dozen
        del t[len(t) // (n + 1) * n :]
    digest = run.digests.pop()
    # Keep every hit / release end within the run (touch() reads the tail's in O(1)).
    if n + 1 in run.hits:
        run.hits[n] = run.hits.get(n, 0) + run.hits.pop(n + 1)
    if n + 1 in run.rel:
        v = run.rel.pop(n + 1)
        run.rel[n] = max(run.rel.get(n, v), v)
    for pages, (starts, blocks) in zip(run.pages, run.segs):
        pages.pop()
        while starts and starts[-1] >= n:
            starts.pop()
            blocks.pop()
    return digest


def pop_tail_range(run: Run, k: int) -> None:
    """Remove the run's last ``k`` units: what ``k`` calls of :func:`pop_tail` do, with
    each hit / release end past the new length folded into it once, not step by step
    (hits add up, release marks keep their maximum, as the steps would leave them)."""
    n = len(run.digests) - k
    _cut_tokens(run, n)
    del run.digests[n:]
    hits, rel = run.hits, run.rel
    past = [e for e in hits if e > n]
    if past:
        hits[n] = hits.get(n, 0) + sum([hits.pop(e) for e in past])
    past = [e for e in rel if e > n]
    if past:
        v = max([rel.pop(e) for e in past])
        rel[n] = max(rel.get(n, v), v)
    for pages, (starts, blocks) in zip(run.pages, run.segs):
        del pages[n:]
        while starts and starts[-1] >= n:
            starts.pop()
            blocks.pop()


def _cut_tokens(run: Run, n: int) -> None:
    """Keep the token bytes of the run's first ``n`` units (before its digests are cut)."""
    t = run.tokens
    if t is not None and run.digests:
        del t[len(t) // len(run.digests) * n :]


def tokens_chain(run: Run, fn: Callable[[bytes], bytes], unit_bytes: int) -> bool:
    """The run's token bytes (if kept) are its units' tokens: one unit's bytes per digest,
    each digest after the first the hash ``fn`` of the one before and its unit (what a
    prompt reusing them relies on, :meth:`TokenHasher.extend_reusing
    <hybridcache.hashing.TokenHasher.extend_reusing>`). An invariant, recounted by tests."""
    t, d = run.tokens, run.digests
    if t is None:
        return True
    if len(t) != len(d) * unit_bytes:
        return False
    return all(d[j] == fn(d[j - 1] + bytes(t[j * unit_bytes : (j + 1) * unit_bytes])) for j in range(1, len(d)))


def split(run: Run, j: int, ppb: int) -> Run | None:
    """Remove the unit at ``j`` (unpinned: ``j >= run.held``); units past it move to a new
    run, returned (``None`` if there are none). Hold ends are all ``<= j`` and stay."""
    tail_digests = run.digests[j + 1 :]
    tail_pages = [p[j + 1 :] for p in run.pages]
    tail_tokens = None
    if run.tokens is not None:
        ub = len(run.tokens) // len(run.digests)
        tail_tokens = run.tokens[(j + 1) * ub :]
    _cut_tokens(run, j)
    del run.digests[j:]
    for p, (starts, blocks) in zip(run.pages, run.segs):
        del p[j:]
        # The segments of a prefix are the whole run's cut at j (maximal stretches are
        # unique): no rebuild over the thousands of units a document's run keeps.
        k = bisect_left(starts, j)
        del starts[k:], blocks[k:]
    hits, rel = run.hits, run.rel
    run.hits, run.rel = {}, {}
    for end, c in hits.items():
        run.hits[min(end, j)] = run.hits.get(min(end, j), 0) + c
    for end, v in rel.items():
        run.rel[min(end, j)] = max(run.rel.get(min(end, j), v), v)
    if not tail_digests:
        return None
    cut = j + 1
    tail = Run.of(tail_digests, tail_pages, run.flops, ppb, run.first + cut, run.tenant, tail_tokens)
    tail.hits = {end - cut: c for end, c in hits.items() if end > cut}
    tail.rel = {end - cut: v for end, v in rel.items() if end > cut}
    return tail


def hold_tables(holds: Sequence[Hold], groups: int) -> list[list[int]]:
    """Block tables, per attention group, of a walked path's units: the path crosses each
    run of ``holds`` from its first unit (:meth:`PrefixIndex.kv_path`), so the tables are
    slices of the runs' page lists, not one look-up per unit."""
    if len(holds) == 1:  # the common case: the hit lies in one run
        run, end = holds[0]
        return [pages[:end] for pages in run.pages]
    tables: list[list[int]] = [[] for _ in range(groups)]
    for run, end in holds:
        for t, pages in zip(tables, run.pages):
            t += pages[:end]
    return tables


def truncate_holds(holds: Sequence[Hold], units: int) -> list[Hold]:
    """The holds of a walked path (as :meth:`PrefixIndex.kv_path` returns them) cut to its
    first ``units`` units."""
    out: list[Hold] = []
    left = units
    for run, end in holds:
        if left <= 0:
            break
        out.append((run, end if end <= left else left))
        left -= end
    return out


def __getattr__(name: str) -> Any:
    """``RunValueQueue`` moved to :mod:`hybridcache.policies.value` (old imports keep working)."""
    if name == "RunValueQueue":
        from hybridcache.policies.value import RunValueQueue

        return RunValueQueue
    raise AttributeError(name)
