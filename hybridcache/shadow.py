"""Miniature simulations: shadow caches that replay a spatial sample of the live requests.

A shadow is an ordinary :class:`~hybridcache.manager.HybridCacheManager` over a smaller
byte budget with one candidate setting. It is accounting only: the manager hands out page
and slot numbers and never touches tensors, so a shadow costs bookkeeping and no memory
beyond its index. Following SHARDS (Waldspurger et al., FAST'15) and "Cache Modeling and
Optimization using Miniature Simulations" (ATC'17), the shadow sees only the requests
whose *sampling key* hashes below a rate ``r`` and holds ``r`` times the live budget, so
that its hit rate estimates the hit rate of the same setting at full size. The key is the
request's first unit digest: every request of a prefix family (a session, a document and
its questions, a system prompt's users) shares it, so a sampled family is replayed whole
and its reuse is seen as the live cache sees it.

A shadow is fed a finished request in one go (match, allocate, commit, free) with the
request's unit digests, so it needs no tokens and hashes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridcache.errors import OutOfSpaceError
from hybridcache.plans import CacheConfig
from hybridcache.spec import ModelSpec

#: 2**64: sampling keys are the first 8 bytes of a unit digest, read as an integer.
KEY_SPACE = float(1 << 64)


def sample_key(digest: bytes) -> float:
    """Where a prefix family falls in [0, 1): the first 8 bytes of its first unit digest.

    Digests are uniform (xxh3 / sha256 of chained content), so no second hash is needed.
    """
    return int.from_bytes(digest[:8], "little") / KEY_SPACE


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
        self._flops = spec.flops.prefill_flops
        self.freq = True  # frequency weighting of value eviction (set by the adaptive manager)
        self.score = 0.0
        self.saved = 0.0
        self.hit_tokens = 0
        self.prompt_tokens = 0
        self._next_id = 0

    @property
    def admission(self):  # type: ignore[no-untyped-def]
        """The parsed admission rules of this candidate (what the live manager adopts)."""
        return self.mgr.admission

    def feed(self, digests: Sequence[bytes], prompt_len: int, total: int,
             tenant: str | None, decay: float) -> None:
        """Replay one finished request: prompt of ``prompt_len`` tokens, ``total`` computed
        (prompt + output); ``digests`` are the unit digests of all computed full units."""
        mgr, unit = self.mgr, self.mgr.unit
        self._next_id += 1
        rid = str(self._next_id)
        match = mgr.add_request(rid, prompt_len, tenant=tenant, digests=digests[: prompt_len // unit])
        try:
            mgr.allocate(rid, total - match.hit_tokens)
        except OutOfSpaceError:
            mgr.free(rid, finished=False)
            self._count(0, prompt_len, decay)
            return
        if total > prompt_len:
            # The output's units, as append_tokens would have hashed them: salted by the
            # hasher's root like the prompt's (add_request(digests=) salts them).
            mgr.requests[rid].hasher.adopt(digests[: total // unit], total)
            mgr.requests[rid].num_tokens = total
        mgr.commit(rid, total)
        mgr.free(rid)
        self._count(match.hit_tokens, prompt_len, decay)

    def _count(self, hit: int, prompt: int, decay: float) -> None:
        saved = self._flops(0, hit) if hit else 0.0
        self.score = self.score * decay + saved
        self.saved += saved
        self.hit_tokens += hit
        self.prompt_tokens += prompt
