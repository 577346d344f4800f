"""vLLM's KV cache events from hybridcache's event stream, for KV-aware routers.

Routers (llm-d, Dynamo) follow vLLM's ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` events and recompute block hashes from tokens with vLLM's hashing, so
an event must carry the hash *vLLM* gives the same tokens, not our digests. The core's
stream (:meth:`hybridcache.port.EnginePort.take_events`) says which of our units were
stored or evicted; this module maps each unit to vLLM's hash of the same block:

- a ``stored`` event is translated while the request whose commit (or finish) stored it is
  at hand: unit ``d`` of its chain is vLLM block ``d`` of the request (one unit = one vLLM
  block), whose hash is ``request.block_hashes`` viewed at the block size, exactly what
  vLLM's ``BlockPool.cache_full_blocks`` sends; the hash is remembered for the unit;
- a ``removed`` event names the remembered hash (a unit is forgotten once neither its KV
  nor its snapshot is cached);
- ``clear()`` ends with ``AllBlocksCleared``, as vLLM's ``reset_prefix_cache`` does.

Events name vLLM's groups: one ``BlockStored`` / ``BlockRemoved`` per attention group for
KV, per Mamba group for a snapshot (a state-only entry: the unit's KV may be gone), with
the group's ``kv_cache_spec_kind`` as vLLM's ``KVCacheManager.take_events`` annotates it,
medium ``"GPU"`` (vLLM's device block pool) and the request's LoRA, extra keys and session.
Requests that cannot be hit (a private tenant: prefix caching off for them) are not
announced.

Sub-block tails (:mod:`.fine`, with ``--prefix-match-unit`` finer than the block) are
announced as vLLM 0.32 announces its partial prefix-cache entries
(``BlockPool.cache_partial_block``): a tail ending at token ``t`` is one ``BlockStored`` per
attention group (its KV copy) and per Mamba group (its state copy) with
``block_hashes=[h(t)]``, ``parent_block_hash=h(t - unit)`` (``None`` for the first unit),
the tokens of its last hash unit and ``block_size`` = the hash unit, where ``h`` is vLLM's
chain hash at the hash unit (``request.block_hashes``); dropping the tail sends
``BlockRemoved([h(t)])`` per group. vLLM registers such entries at the prompt end only; a
tail also sits at a branch point or a decode turn end, and is announced the same way.

``kv_cache_report_mode="full"`` (a request's ``SamplingParams.extra_args``, as in vLLM) also
announces the blocks a hit reuses, when the scheduler looks the request up
(:meth:`VllmKVEvents.reused`): vLLM's ``emit_cached_block_events`` shape (one event per
group with blocks, parent ``None``, the hit's whole blocks), and a sub-block hit's tail as
its partial entry (vLLM 0.32 indexes the block-size view of the hashes at the partial
block, naming the whole block although only a prefix of it is cached).

This module reads the stream through a queue of its own (``port.subscribe()``), so other
consumers of the same port (a tier, a test) take their events independently.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vllm.distributed.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.multimodal.utils import get_mm_features_in_window
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    resolve_block_hashes,
    to_event_extra_keys,
)
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from vllm.v1.request import Request

from hybridcache.events import CLEARED, REMOVED, STORED, CacheEvent
from hybridcache.port import EnginePort

#: Tenant prefix of requests that neither hit nor are hit (see ``HybridKVCacheManager._add``).
PRIVATE_TENANT = "\x00private:"


class VllmKVEvents:
    """Translate the port's events into vLLM's ``KVCacheEvent`` objects.

    Args:
        port: the adapter's :class:`EnginePort` (this opens a queue of its event stream).
        kv_cache_config: vLLM's layout (group kinds for the events).
        attn_ids: vLLM group ids of the attention groups, in the manager's group order.
        mamba_ids: vLLM group ids of the state groups.
        block_size: tokens per vLLM block (= our hash unit).
        hash_block_size: the unit ``request.block_hashes`` is computed at.
        medium: the medium vLLM reports for device blocks.
    """

    def __init__(self, port: EnginePort, kv_cache_config: KVCacheConfig, *,
                 attn_ids: Sequence[int], mamba_ids: Sequence[int], block_size: int,
                 hash_block_size: int, medium: str = MEDIUM_GPU, tails: Any = None,
                 is_private: Callable[[Request], bool] = lambda request: False) -> None:
        self.port = port
        self._queue = port.subscribe()
        self.attn_ids = tuple(attn_ids)
        self.mamba_ids = tuple(mamba_ids)
        self.block_size = block_size
        self.hash_block_size = hash_block_size
        self.medium = medium
        self.group_meta = tuple(
            (get_kv_cache_spec_kind(g.kv_cache_spec).value,
             get_kv_cache_spec_sliding_window(g.kv_cache_spec))
            for g in kv_cache_config.kv_cache_groups
        )
        # our digest -> [vLLM hash, KV cached, snapshot cached]
        self.known: dict[bytes, list[Any]] = {}
        self.out: list[KVCacheEvent] = []
        self.unmapped = 0  # stored events whose request was not at hand (not announced)
        self.tails_unnamed = 0  # tails at a unit vLLM does not hash at (not announced)
        # The view of each request seen by collect(): a request's last events (its
        # turn-end snapshot) come from free(), after the port has forgotten it.
        self._views: dict[str, Any] = {}
        self.tails = tails  # the adapter's .fine.TailCache, if any
        self.is_private = is_private
        # Announced tails -> their vLLM hash (a dropped tail is announced removed).
        self._tails: dict[Any, Any] = {}
        self._tail_hashes: dict[Any, Any] = {}  # vLLM hash -> its announced tail

    @classmethod
    def for_adapter(cls, adapter: Any, hash_block_size: int) -> VllmKVEvents:
        """Events for a :class:`~.manager.HybridKVCacheManager` (over its port)."""
        return cls(adapter.port, adapter.kv_cache_config,
                   attn_ids=adapter.attn_ids, mamba_ids=adapter.mamba_ids,
                   block_size=adapter.block_size, hash_block_size=hash_block_size,
                   tails=adapter.tails, is_private=adapter.is_private)

    # ------------------------------------------------------------------ intake
    def collect(self, request: Request | None = None) -> None:
        """Translate the port's pending events; ``request`` is the one whose call ran."""
        view = None
        if request is not None:
            rid = request.request_id
            view = self.port.request(rid)
            if view is None:
                view = self._views.pop(rid, None)
            else:
                self._views[rid] = view
        for ev in self._queue.take():
            if ev.action == STORED:
                self._stored(ev, request, view)
            elif ev.action == REMOVED:
                self._removed(ev)
            elif ev.action == CLEARED:
                self.known.clear()
                self._tails.clear()
                self._tail_hashes.clear()
                self.out.append(AllBlocksCleared())
        if request is not None and self.tails is not None:
            self._stored_tails(request)

    def close(self) -> None:
        """Stop reading the port's stream (idempotent)."""
        self._queue.close()

    def take(self) -> list[KVCacheEvent]:
        """vLLM's events since the last call, oldest first (vLLM's ``take_events``)."""
        self.collect()
        self._removed_tails()
        out, self.out = self.out, []
        return out

    # ------------------------------------------------------------------ translation
    def _block_hashes(self, request: Request) -> Any:
        return resolve_block_hashes(request.block_hashes, self.hash_block_size, self.block_size)

    def _stored(self, ev: CacheEvent, request: Request | None, view: Any) -> None:
        if ev.tenant is not None and ev.tenant.startswith(PRIVATE_TENANT):
            return
        n = len(ev.digests)
        if request is None or view is None or not self._is_chain_of(ev, request, view):
            self.unmapped += 1
            return
        hashes = self._block_hashes(request)
        if len(hashes) < ev.depth + n:  # vLLM hashed fewer blocks (no block hasher set)
            self.unmapped += 1
            return
        ext = [maybe_convert_block_hash(hashes[ev.depth + k]) for k in range(n)]
        kv = ev.kind == "kv"
        for d, h in zip(ev.digests, ext):
            rec = self.known.setdefault(d, [h, False, False])
            rec[1 if kv else 2] = True
        parent = maybe_convert_block_hash(hashes[ev.depth - 1]) if ev.depth else None
        start, end = ev.depth * self.block_size, (ev.depth + n) * self.block_size
        extra, mm_idx = [], 0
        for i in range(ev.depth, ev.depth + n):
            keys, mm_idx = generate_block_hash_extra_keys(
                request, i * self.block_size, (i + 1) * self.block_size, mm_idx)
            extra.append(keys)
        lora = request.lora_request
        for gid in self.attn_ids if kv else self.mamba_ids:
            kind, window = self.group_meta[gid]
            self.out.append(BlockStored(
                block_hashes=list(ext), parent_block_hash=parent,
                token_ids=list(request.all_token_ids[start:end]), block_size=self.block_size,
                lora_id=lora.adapter_id if lora else None, medium=self.medium,
                lora_name=lora.name if lora else None, extra_keys=to_event_extra_keys(extra),
                group_idx=gid, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window,
                session_id=request.session_id,
            ))

    def _is_chain_of(self, ev: CacheEvent, request: Request, view: Any) -> bool:
        """Whether the event's units are units ``depth...`` of ``request``'s chain."""
        digests = view.digests
        end = ev.depth + len(ev.digests)
        return end <= len(digests) and tuple(digests[ev.depth:end]) == ev.digests \
            and end * self.block_size <= request.num_tokens

    def _removed(self, ev: CacheEvent) -> None:
        kv = ev.kind == "kv"
        for d in ev.digests:
            rec = self.known.get(d)
            if rec is None:
                continue  # never announced (private tenant, or stored before events)
            rec[1 if kv else 2] = False
            if not rec[1] and not rec[2]:
                del self.known[d]
            for gid in self.attn_ids if kv else self.mamba_ids:
                self.out.append(BlockRemoved(block_hashes=[rec[0]], medium=self.medium,
                                             group_idx=gid))

    # ------------------------------------------------------------------ sub-block tails
    def _partial_stored(self, request: Request, t: int, groups: Sequence[int]) -> Any:
        """vLLM's partial-entry ``BlockStored`` of ``request``'s prefix ``[0, t)`` on
        ``groups`` (``BlockPool.cache_partial_block``); its hash, or ``None`` if vLLM has
        not hashed that far."""
        hbs = self.hash_block_size
        k = t // hbs
        hashes = request.block_hashes
        if t % hbs or not 0 < k <= len(hashes):
            return None
        h = maybe_convert_block_hash(hashes[k - 1])
        parent = maybe_convert_block_hash(hashes[k - 2]) if k > 1 else None
        start = t - hbs
        mm_idx = 0
        mm = request.mm_features
        if start > 0 and mm and mm[-1].mm_position.offset + mm[-1].mm_position.length > start:
            mm_idx, _ = get_mm_features_in_window(mm, start, t)
        keys, _ = generate_block_hash_extra_keys(request, start, t, mm_idx)
        lora = request.lora_request
        for gid in groups:
            kind, window = self.group_meta[gid]
            self.out.append(BlockStored(
                block_hashes=[h], parent_block_hash=parent,
                token_ids=list(request.all_token_ids[start:t]), block_size=hbs,
                lora_id=lora.adapter_id if lora else None, medium=self.medium,
                lora_name=lora.name if lora else None, extra_keys=to_event_extra_keys([keys]),
                group_idx=gid, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window,
                session_id=request.session_id,
            ))
        return h

    def _stored_tails(self, request: Request) -> None:
        """Announce the tails ``request`` made in this step (queued copies of its blocks)."""
        rid = request.request_id
        made = [p.tail for p in self.tails.pending if p.rid == rid and p.tail is not None]
        for tail in made:
            if tail in self._tails or tail not in self.tails.lru or self.is_private(request):
                continue
            if self.tails.unit != self.hash_block_size:
                # vLLM hashes at another unit (no --prefix-match-unit: the block): no vLLM
                # hash names the tail, and native vLLM has no partial entries either.
                self.tails_unnamed += 1
                continue
            t = tail.boundary
            hashes = request.block_hashes
            k = t // self.hash_block_size
            if not 0 < k <= len(hashes):
                self.unmapped += 1
                continue
            h = maybe_convert_block_hash(hashes[k - 1])
            old = self._tail_hashes.get(h)
            if old is not None and old not in self.tails.lru:
                # The same prefix again (its old tail dropped in this step): routers
                # already hold it; the new tail takes over the announcement.
                del self._tails[old]
            elif old is None:
                self._partial_stored(request, t, self.attn_ids + self.mamba_ids)
            else:
                continue  # (two tails never share a prefix: fine.TailCache.by_key)
            self._tails[tail] = h
            self._tail_hashes[h] = tail

    def _removed_tails(self) -> None:
        """``BlockRemoved`` for announced tails the tail cache has dropped since."""
        if not self._tails:
            return
        for tail, h in [(t, h) for t, h in self._tails.items() if t not in self.tails.lru]:
            del self._tails[tail]
            del self._tail_hashes[h]
            for gid in self.attn_ids + self.mamba_ids:
                self.out.append(BlockRemoved(block_hashes=[h], medium=self.medium,
                                             group_idx=gid))

    # ------------------------------------------------------------------ reuse reports
    def reused(self, request: Request, block_ids: Sequence[Sequence[int]], tail: Any = None) -> None:
        """``kv_cache_report_mode="full"``: announce the blocks a hit reuses (module
        docstring). ``block_ids``: per vLLM group, the hit's blocks as the scheduler gets
        them; ``tail``: the sub-block tail the hit ends in, if any."""
        if getattr(request, "kv_cache_report_mode", "incremental") != "full":
            return
        bs = self.block_size
        hashes = self._block_hashes(request)
        for gid, blocks in enumerate(block_ids):
            n = min(len(blocks) - (tail is not None), len(hashes))
            if n <= 0:
                continue
            extra, mm_idx = [], 0
            for i in range(n):
                keys, mm_idx = generate_block_hash_extra_keys(request, i * bs, (i + 1) * bs, mm_idx)
                extra.append(keys)
            kind, window = self.group_meta[gid]
            lora = request.lora_request
            self.out.append(BlockStored(
                block_hashes=[maybe_convert_block_hash(hashes[i]) for i in range(n)],
                parent_block_hash=None, token_ids=list(request.all_token_ids[: n * bs]),
                block_size=bs, lora_id=lora.adapter_id if lora else None, medium=self.medium,
                lora_name=lora.name if lora else None, extra_keys=to_event_extra_keys(extra),
                group_idx=gid, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window,
                session_id=request.session_id,
            ))
        if tail is not None:
            self._partial_stored(request, tail.boundary, self.attn_ids + self.mamba_ids)
