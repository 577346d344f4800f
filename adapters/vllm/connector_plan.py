"""Scheduler-side planning of :class:`~.connector.HybridCacheConnector`: keys, hits, jobs.

Entry layout in the tier (one entry per vLLM block of a prefix)::

    key (tenant, "<fp>.kv", h_i)   KV of block i of every full-attention group
    key (tenant, "<fp>.hy", h_i)   KV of block i + the recurrent state after block i,
                                   of every Mamba-family group (one unit: a "hybrid" entry)

``h_i`` is the chained, tenant-salted digest of tokens ``[0, (i + 1) * block_size)``
(:mod:`hybridcache.hashing`, unit = one vLLM block; deterministic across processes, unlike
vLLM's block hashes with a per-process seed). A state exists only at the block boundaries
vLLM's ``align`` mode retains, so a prefix of ``k`` blocks can be restored only when blocks
``0 .. k-2`` have an entry of either kind and block ``k-1`` has a hybrid entry: its state
and the KV before it are then loaded together, or nothing is (the worker fetches and
validates every entry before it writes a byte). Keeping the two kinds under different keys
means a KV-only save never overwrites a hybrid entry.

The jobs the scheduler sends to the worker (:class:`ConnectorMetadata`) carry plain
values only (strings, bytes, ints), so they pickle cheaply to a worker process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from hybridcache.hashing import TokenHasher
from hybridcache.tiers import EntryKey, TierConfigError
from hybridcache.tiers.keys import check_name

#: Seed of the connector's hash chains (a different seed would be a disjoint cache).
CHAIN_SEED = "vllm-connector"

KIND_KV = "kv"
KIND_HYBRID = "hy"


def tenant_of(cache_salt: str | None, default: str) -> str:
    """The tier tenant of a request: its ``cache_salt``, or ``default`` without one.

    A salt that is not a valid key component (``[A-Za-z0-9_.-]{1,64}``) is replaced by a
    digest of itself; isolation does not rest on this name alone, since the raw salt also
    roots the request's hash chain.
    """
    if not cache_salt:
        return default
    try:
        return check_name(cache_salt, "tenant")
    except TierConfigError:
        return "x." + hashlib.blake2b(cache_salt.encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class JobKey:
    """An :class:`~hybridcache.tiers.EntryKey` as plain values (kind: ``kv`` or ``hy``)."""

    tenant: str
    kind: str
    prefix_hash: bytes

    def entry_key(self, fingerprint: str) -> EntryKey:
        return EntryKey(self.tenant, f"{fingerprint}.{self.kind}", self.prefix_hash)


@dataclass
class LoadJob:
    """Restore blocks ``[first_block, first_block + len(keys))`` of one request.

    ``keys[j]`` holds block ``first_block + j``; the last key is a hybrid entry whose state
    goes to ``state_blocks``. ``kv_blocks[gid][j]`` is the destination of block ``j``.
    """

    req_id: str
    first_block: int
    keys: list[JobKey]
    kv_blocks: dict[int, list[int]]
    state_blocks: dict[int, int]


@dataclass
class SaveJob:
    """Save one block's KV (``kv_blocks[gid]``) and, for a hybrid entry, the state after it."""

    req_id: str
    block: int
    key: JobKey
    kv_blocks: dict[int, int]
    state_blocks: dict[int, int] | None = None


@dataclass
class ConnectorMetadata(KVConnectorMetadata):
    """What the worker does this step: loads (before the next forward), saves (after this one)."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


def eligible(request: Any) -> bool:
    """Whether a request's prefix can be keyed by its token ids alone.

    Multimodal inputs (placeholder tokens stand for different images) and prompt embeddings
    (no token ids) are not cached by the connector.
    """
    return not getattr(request, "mm_features", None) and getattr(request, "prompt_embeds", None) is None


@dataclass
class RequestTrack:
    """What the scheduler-side connector knows about one live request.

    Attributes:
        hasher: the request's chain (one unit = one block), extended on demand.
        stored: leading blocks known to have an entry (of either kind) in the tier.
        hybrid: block indices known to have a hybrid entry.
        pending: the hit chosen by the last lookup, as ``(blocks, kinds)``.
        no_external: a load of this request failed; never offer it a hit again.
    """

    request: Any
    tenant: str
    hasher: TokenHasher
    stored: int = 0
    hybrid: set[int] = field(default_factory=set)
    pending: tuple[int, list[str]] | None = None
    no_external: bool = False

    @property
    def digests(self) -> list[bytes]:
        """Chain digests of the request's blocks hashed so far."""
        return self.hasher.digests

    def digests_upto(self, n_blocks: int) -> list[bytes]:
        """Digests of blocks ``0 .. n_blocks-1`` (extends the chain from the request tokens)."""
        h = self.hasher
        if n_blocks > len(h.digests):
            h.extend(list(self.request.all_token_ids[h.num_tokens : n_blocks * h.unit]))
        return h.digests[:n_blocks]


def new_track(request: Any, default_tenant: str, algo: str, block_size: int) -> RequestTrack:
    """Start tracking ``request``: tenant and chain root from its salt and LoRA."""
    lora = getattr(request, "lora_request", None)
    hasher = TokenHasher(
        block_size,
        algo,
        CHAIN_SEED,
        tenant=request.cache_salt or None,
        lora=getattr(lora, "lora_name", None),
    )
    return RequestTrack(request, tenant_of(request.cache_salt, default_tenant), hasher)


def best_hit(
    kv: Sequence[bool], hybrid: Sequence[bool], align_blocks: int = 1
) -> tuple[int, int]:
    """``(stored, hit)`` from per-block presence of KV and hybrid entries.

    ``stored``: leading blocks with an entry of either kind. ``hit``: the largest ``k <=
    stored`` whose block ``k-1`` has a hybrid entry (and ``k`` a multiple of
    ``align_blocks``), or 0.
    """
    stored = 0
    for a, b in zip(kv, hybrid):
        if not (a or b):
            break
        stored += 1
    hit = 0
    for k in range(stored, 0, -1):
        if hybrid[k - 1] and k % align_blocks == 0:
            hit = k
            break
    return stored, hit


def load_kinds(kv: Sequence[bool], hit: int) -> list[str]:
    """Entry kind to read for each block below ``hit``: KV-only where present, else hybrid."""
    return [KIND_KV if kv[i] and i < hit - 1 else KIND_HYBRID for i in range(hit)]


def group_offers(
    offers: Sequence[tuple[int, int, int]], state_groups: Sequence[int], block_size: int
) -> list[tuple[int, dict[int, int]]]:
    """vLLM's boundary-state hand-offs of one request -> ``[(boundary, {gid: block})]``.

    Only boundaries that are block multiples and offered by *every* state group are kept:
    a hybrid entry needs the state of all recurrent groups at the same point.
    """
    want = set(state_groups)
    by_boundary: dict[int, dict[int, int]] = {}
    for gid, block_id, boundary in offers:
        if gid in want and block_id > 0 and boundary > 0 and boundary % block_size == 0:
            by_boundary.setdefault(boundary, {})[gid] = block_id
    return sorted((b, g) for b, g in by_boundary.items() if set(g) == want)
