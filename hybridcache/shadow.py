"""Miniature simulations: shadow caches that replay a spatial sample of the live requests.

A shadow is an ordinary :class:`~hybridcache.manager.HybridCacheManager` over a smaller
byte budget with one candidate setting. It is accounting only: the manager hands out page
and slot numbers and never touches tensors, so a shadow costs bookkeeping and no memory
beyond its index. Following SHARDS (Waldspurger et al., FAST'15) and "Cache Modeling and
Optimization using Miniature Simulations" (ATC'17), the shadow sees only the requests
whose *sampling key* hashes below a rate ``r`` and holds ``r`` times the live budget, so
that its hit rate estimates the hit rate of the same setting at full size. The key is the
*chain key* of the request (:class:`ChainKeys`): the digest of the first unit past the
prefix its root (first unit) shares with other chains, so that every turn of a session
shares the key and a sampled family is replayed whole, while the sessions behind one
system prompt are sampled apart (the first unit alone would make them one family: all or
nothing); a root whose shared prefix is long (a document before its questions) is keyed
whole, so that the shadows do not hold every document.

A shadow is fed a finished request in one go (match, allocate, commit, free) with the
live request's unit digests, so it needs no tokens and hashes nothing (not even the
tenant salt: :meth:`ShadowCache._add_request`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

from hybridcache.config import CacheConfig
from hybridcache.requests import Request
from hybridcache.seen_prefixes import fit_record
from hybridcache.spec import ModelSpec
from hybridcache.step import _Step

#: 2**64: sampling keys are the first 8 bytes of a unit digest, read as an integer.
KEY_SPACE = float(1 << 64)


def sample_key(digest: bytes) -> float:
    """Where a prefix family falls in [0, 1): the first 8 bytes of its first unit digest.

    Digests are uniform (xxh3 / sha256 of chained content), so no second hash is needed.
    """
    return int.from_bytes(digest[:8], "little") / KEY_SPACE


class ChainKeys:
    """Sampling keys of request chains (digest lists), stable across a session's turns.

    Per root (first unit digest) it keeps a reference chain and the *split*: the shallowest
    depth at which two chains of the root were seen to differ (the end of a shared system
    prompt, a document before its questions). A chain's key is its digest at the split
    (the first unit of its own content), or its root when it is no longer than the split or
    its root never split (one session extending itself: one family). Unit digests are
    chained (a digest names its whole prefix), so the first difference is found by binary
    search. The split only moves towards the root, a few times per root and early (once two
    families of the root are seen it is where they part), so a family keeps its key.

    Keyed at its split, a root's shared prefix is held *unscaled*: a shadow holds all of it
    as soon as one of its families is sampled, where its share is ``rate`` of it. For a
    system prompt before many sessions that is a few units; for a document before its
    questions (each question a family) it is the document, and a shadow sampling one
    question in eight held every document (docs, 16 GiB: the sample's unique KV 1.56x the
    shadows' capacity where the live cache's is 0.25x, so the shadows thrashed where the
    live cache did not). So the split depths of the roots keyed at their split are summed,
    and a root whose first split would take the sum past :attr:`budget` (units) is keyed
    whole instead: all its chains share the root as key and are sampled together, as
    SHARDS samples any key, at the price of an all-or-nothing draw (the adaptive manager's
    family check raises the rate where the sample holds too few families). The choice is
    made once, at the root's first split, so that a family keeps its key.
    """

    def __init__(self, budget: float = math.inf) -> None:
        # root -> [reference chain (up to the split), split depth (None: never split),
        #          keyed whole]
        self._roots: dict[bytes, list] = {}
        #: Units of shared prefixes the sample may hold unscaled (set by the adaptive
        #: manager from its shadows' size and rate; infinite: every root keyed at its split).
        self.budget = budget
        #: The split depths of the roots keyed at their split, summed (<= budget when each
        #: was decided).
        self.held = 0

    def __len__(self) -> int:
        return len(self._roots)

    @property
    def whole(self) -> int:
        """Roots keyed whole (a count over the roots: read by reports and tests only)."""
        return sum(1 for entry in self._roots.values() if entry[2])

    def key(self, digests: Sequence[bytes]) -> bytes:
        """The chain's sampling key (its root's entry is updated with the chain).

        Internal updates: the root's reference chain and split, and the first split's
        choice between split and whole (a split is counted in :attr:`held`)."""
        root = digests[0]
        entry = self._roots.get(root)
        if entry is None:
            self._roots[root] = [tuple(digests), None, False]
            return root
        ref, split, whole = entry
        if whole:
            return root
        m = min(len(ref), len(digests))
        if m > 1 and digests[m - 1] != ref[m - 1]:
            lo, hi = 0, m - 1  # digests[lo] == ref[lo], digests[hi] != ref[hi]
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if digests[mid] == ref[mid]:
                    lo = mid
                else:
                    hi = mid
            if split is None and self.held + hi > self.budget:
                entry[0], entry[2] = (), True
                return root
            self.held += hi - (split or 0)
            split = hi
            entry[0], entry[1] = ref[:hi], hi
        elif split is None and len(digests) > len(ref):
            entry[0] = tuple(digests)  # an extension: the reference follows the session
        if split is None or len(digests) <= split:
            return root
        return digests[split]


class PairedDifference:
    """Exponentially windowed mean of a per-request difference and its standard error.

    Weights decay by the caller's factor per sample (the window of
    :attr:`ShadowCache.score`); the effective sample size is ``W**2 / sum(w**2)``.
    """

    __slots__ = ("w", "w2", "s1", "s2")

    def __init__(self) -> None:
        self.w = self.w2 = self.s1 = self.s2 = 0.0

    def add(self, d: float, decay: float) -> None:
        self.w = self.w * decay + 1.0
        self.w2 = self.w2 * decay * decay + 1.0
        self.s1 = self.s1 * decay + d
        self.s2 = self.s2 * decay + d * d

    @property
    def n(self) -> float:
        """Effective sample size of the window (``W**2 / sum(w**2)``)."""
        return self.w * self.w / self.w2 if self.w2 else 0.0

    def z(self, min_n: float) -> float:
        """Mean over its standard error (0 below ``min_n`` effective samples or when the
        mean is not positive; infinite for a positive mean with no spread)."""
        if not self.w or self.w * self.w / self.w2 < min_n or self.s1 <= 0:
            return 0.0
        mean, var = self.moments()
        if var <= mean * mean * 1e-12:
            return math.inf
        return mean / self.stderr(var)

    def moments(self) -> tuple[float, float]:
        """The window's mean and variance of the differences (call with ``w`` > 0)."""
        mean = self.s1 / self.w
        return mean, max(0.0, self.s2 / self.w - mean * mean)

    def stderr(self, var: float) -> float:
        """The standard error of the window's mean, for a variance ``var`` of its samples."""
        return math.sqrt(var * self.w2 / (self.w * self.w))


class _Taken:
    """A replayed request's hasher: the digests it was given, nothing to hash with.

    The manager reads a request's hasher for its ``digests``, ``num_tokens`` and
    ``token_bytes`` (``None``: digests taken, not hashed from tokens, as after
    :meth:`TokenHasher.adopt <hybridcache.hashing.TokenHasher.adopt>`); only
    ``append_tokens`` hashes with it, and a replay never appends. A :class:`TokenHasher`
    per replayed request checked the tenant and looked up its root digest for nothing.
    """

    __slots__ = ("digests", "num_tokens", "token_bytes")

    def __init__(self, digests: list[bytes], num_tokens: int) -> None:
        self.digests = digests
        self.num_tokens = num_tokens
        self.token_bytes = None


class ShadowCache:
    """One candidate setting replayed over the sampled requests (see module docstring).

    ``score`` is the prefill FLOPs its hits saved over a recent window: every fed request
    first decays it by ``decay`` (the caller's window, in the same units for every shadow),
    then adds what the request saved.
    """

    def __init__(self, name: str, spec: ModelSpec, capacity_bytes: int, config: CacheConfig) -> None:
        from hybridcache.manager import HybridCacheManager  # the manager imports this module's user

        self.name = name
        self.config = config
        self.mgr = HybridCacheManager(spec, capacity_bytes, config)
        #: While non-zero, the cache is one this shadow inherited (:meth:`inherit`) and not
        #: yet its own: the evicted bytes (:attr:`evicted_bytes`) at which it will be.
        self.inherited_until = 0.0
        self._flops = spec.flops.prefill_flops
        self.weighting = "gdsf"  # value eviction's weighting (set by the adaptive manager)
        self.score = 0.0
        self.last = 0.0  # FLOPs saved on the last request fed
        self.pair = PairedDifference()  # against the live candidate (the adaptive manager's)
        self.saved = 0.0
        self.hit_tokens = 0
        self.prompt_tokens = 0
        self._next_id = 0
        self._last_hit = 0
        #: The shadow this one is a twin of (see :meth:`follow`), or None: fed itself.
        self.host: ShadowCache | None = None
        self.fork_at = 0

    def follow(self, host: ShadowCache, fork_at: int) -> None:
        """Share ``host``'s cache while no fed request computes ``fork_at`` tokens.

        Two settings that differ only in their ``interval`` rule place the same snapshots
        until a request reaches the smaller non-zero interval (interval points lie at
        multiples of it, up to the computed end), so until then their caches are one and
        the same and one replay serves both: exact, not an approximation. :meth:`fork`
        copies the host's cache when a longer request comes."""
        self.host, self.fork_at = host, fork_at

    def fork(self) -> None:
        """Take a copy of the host's cache, keeping this setting's own rules (from now on
        the two differ and each is fed on its own)."""
        self.copy_cache(self.host)

    def copy_cache(self, src_shadow: ShadowCache) -> None:
        """Make this shadow's cache a copy of ``src_shadow``'s (its host's if it is a twin),
        keeping this setting's own rules; fed on its own from now on.

        The copy's cached entries keep the rank the source gave them, as the live cache's do
        when it adopts a setting (:func:`hybridcache.adoption.set_weighting` re-ranks them
        only where the eviction policy, or the scale of value eviction's priorities, changes):
        a shadow restarted from the live candidate's cache measures what switching to it now
        would do."""
        src_shadow = src_shadow.host or src_shadow
        own, src = self.mgr, src_shadow.mgr
        # The manager's __new__ takes the constructor's arguments, so the copy is built
        # field by field; the memo makes the parts that point back at it point at the copy
        # and shares the model spec (immutable).
        self.mgr = object.__new__(type(src))
        memo = {id(src): self.mgr, id(src.spec): src.spec}
        self.mgr.__dict__.update(copy.deepcopy(src.__dict__, memo))
        self.mgr.config, self.mgr.admission = own.config, own.admission
        fit_record(self.mgr)  # the source's record where this setting reads one, else none
        self._next_id = src_shadow._next_id
        self.host = None

    def inherit(self, src_shadow: ShadowCache) -> None:
        """Restart from a copy of ``src_shadow``'s cache (:meth:`copy_cache`), held as
        inherited until this shadow has evicted a cache's worth of bytes since.

        Why: from another setting's full cache, a setting that admits less saves less and so
        evicts less of what it inherited, and for a while it hits more than the setting it
        copied, on entries that setting made. That lead lasts until the inherited entries
        are spent, and then turns: ``seen-twice-recency`` (a state only for a point seen
        twice), back from retirement on a copy of ``checkpoints-3x``'s cache, led it within
        20 requests and was adopted, on qwen3-next-80b agentic sessions at 2 GiB (0.19 of
        the prompt tokens as a fixed setting, against 0.66). Once it has evicted as many
        bytes as the cache holds, what it keeps is what its own rules chose."""
        self.copy_cache(src_shadow)
        self.inherited_until = self.evicted_bytes + self.mgr.layout.capacity_bytes

    @property
    def evicted_bytes(self) -> int:
        """Bytes of KV and snapshots evicted so far (the host's while this shadow shares
        its cache)."""
        idx = (self.host or self).mgr.index
        return idx.evictions["kv"] * idx.node_kv_bytes + idx.evictions["state"] * idx.snap_bytes

    @property
    def evictions(self) -> int:
        """Entries evicted so far (the host's while this shadow shares its cache)."""
        ev = (self.host or self).mgr.index.evictions
        return ev["kv"] + ev["state"]

    def mirror(self, prompt_len: int, decay: float) -> None:
        """Count the request the host was just fed, as this shadow (its twin) would have."""
        self._count(self.host._last_hit, prompt_len, decay)

    @property
    def admission(self):  # type: ignore[no-untyped-def]
        """The parsed admission rules of this candidate (what the live manager adopts)."""
        return self.mgr.admission

    def feed(self, digests: Sequence[bytes], prompt_len: int, total: int,
             tenant: str | None, decay: float, prompt_digests: list[bytes] | None = None) -> None:
        """Replay one finished request: prompt of ``prompt_len`` tokens, ``total`` computed
        (prompt + output); ``digests`` are the live request's unit digests of all computed
        full units (already chained and tenant-salted by the live hasher).

        The replay is the manager's own step (``match``, ``allocate``, ``commit``, ``free``)
        without what a replay reads nothing of: the argument checks (the live manager made
        the request), the match's and the allocation's result objects and the block table
        (a copy of the request's page list per step). ``tests/sim/test_shadow_model.py``
        compares every hit and eviction with the public path.

        The digest lists are only read, never changed, so one list serves every shadow fed
        the request: ``digests`` (a list) as the committed units and ``prompt_digests``
        (``digests[: prompt_len // unit]``, made once by the caller; made here if None)
        as the prompt's.
        """
        mgr, unit = self.mgr, self.mgr.unit
        self._next_id += 1
        rid = str(self._next_id)
        if prompt_digests is None:
            prompt_digests = list(digests[: prompt_len // unit])
        req = self._add_request(rid, prompt_digests, prompt_len, tenant)
        # allocate(rid, total - hit)'s count (HybridCacheManager._count_step) for a first
        # step of a valid request: the live one computed ``total`` tokens past its hit.
        hit = mgr._hit(req)
        units = hit[1]
        page_units = max(-(-total // unit) - units, 0)
        coord = mgr.coordinator
        slide_hold = coord.unheld_hit_pages(prompt_digests, units) if coord is not None else ()
        if not mgr._fits(page_units, 1 if mgr.has_state else 0, hit[2], hit[3], slide_hold):
            mgr.free(rid, finished=False)
            self._count(0, prompt_len, decay)
            return
        start = units * unit
        mgr._take(_Step(req, True, hit, start, total, page_units, 1, True, total - start, 0), False)
        if total > prompt_len:
            # The output's units, as append_tokens would have hashed them.
            req.hasher.digests = digests if len(digests) == total // unit else list(digests[: total // unit])
            req.hasher.num_tokens = req.num_tokens = total
        mgr._commit(req, total)
        del mgr.requests[rid]
        mgr._release(req, True)
        self._count(start, prompt_len, decay)

    def _add_request(self, rid: str, digests: list[bytes], prompt_len: int,
                     tenant: str | None) -> Request:
        """``add_request(rid, prompt_len, tenant=tenant, digests=...)`` without its two
        costs that a replay does not need: validating digests the live manager made, and
        salting them again. ``add_request(digests=)`` keys unit ``d`` as
        ``hash(root(tenant) + d)``; here it is keyed ``d`` itself. The live digests are
        already chained and salted with the tenant's root, so both keyings are one-to-one
        maps of the same digests (equal exactly when the live digests are equal, up to a
        128-bit collision) and the manager, which only compares keys, decides the same:
        ``tests/sim/test_shadow_model.py`` replays random streams both ways and compares
        every hit and every eviction. ``digests``: the prompt's (taken as they are, not
        copied: nothing changes a request's digest list in place)."""
        req = Request(rid, _Taken(digests, prompt_len), tenant, prompt_len)  # type: ignore[arg-type]
        self.mgr.requests[rid] = req
        return req

    def _count(self, hit: int, prompt: int, decay: float) -> None:
        saved = self._flops(0, hit) if hit else 0.0
        self._last_hit = hit
        self.last = saved
        self.score = self.score * decay + saved
        self.saved += saved
        self.hit_tokens += hit
        self.prompt_tokens += prompt
