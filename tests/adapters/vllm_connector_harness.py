"""Drive vLLM's real ``Scheduler`` with ``HybridCacheConnector`` and a tensor-backed worker.

:class:`TensorWorker` plays vLLM's worker with real per-layer cache tensors (the shapes a
connector sees in vLLM 0.32: attention ``[blocks, heads, block_size, dim]`` in bf16, a
recurrent state page as raw int8 bytes) and runs the connector's worker side in vLLM's
order: block zeroing and copies, ``preprocess_mamba``'s column copy, the forward pass, then
``start_load_kv`` (loads are asynchronous), ``wait_for_save`` and ``get_transfer_results``.

The "model" writes, at each position ``p``, KV bytes derived from the digest of tokens
``[0, p]``, and the state after ``n`` tokens is bytes derived from the digest of tokens
``[0, n)``. Before a step computes ``[start, end)`` it checks that every KV position below
``end`` holds the right bytes and that the running state block holds exactly the state
after ``start`` tokens, so a restored page or state that is wrong, stale or in the wrong
block fails the step.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import vllm_sched_harness as h

from hybridcache.tiers import Tier

HEAD_DIM = 16
STATE_BYTES = 256
MODULE = "hybridcache.adapters.vllm.connector"


def transfer_dict(extra: dict, role: str = "kv_both") -> dict:
    """``HybridCacheConnector``'s ``KVTransferConfig`` fields (``kv_connector_extra_config``
    is ``extra``), as vLLM's ``--kv-transfer-config`` JSON takes them."""
    return dict(kv_connector="HybridCacheConnector", kv_connector_module_path=MODULE,
                kv_role=role, kv_connector_extra_config=extra)


def transfer_config(extra: dict, role: str = "kv_both") -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(**transfer_dict(extra, role))


def redis_extra(url: str) -> dict:
    """Connector settings for a RedisTier at ``url`` with the tier tests' secret."""
    import tiers_testlib

    return {"tier": "redis", "url": url, "secret": tiers_testlib.SECRET.decode()}


def make(model_dir: Path, extra: dict, num_blocks: int = 200, scheduler_cls: Any = None,
         role: str = "kv_both", **kw: Any) -> tuple[Any, TensorWorker]:
    """vLLM's Scheduler (or ``scheduler_cls``, e.g. ``HybridCacheScheduler``) with the
    connector (scheduler role) and a worker with its worker role."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.scheduler import Scheduler

    from hybridcache.adapters.vllm.connector import HybridCacheConnector

    sched = h.make_scheduler(model_dir, scheduler_cls or Scheduler, num_blocks,
                             kv_transfer_config=transfer_config(extra, role), **kw)
    conn = HybridCacheConnector(sched.vllm_config, KVConnectorRole.WORKER, sched.kv_cache_config)
    return sched, TensorWorker(sched.kv_cache_config, conn)


class Chains:
    """Digests of every token prefix of each request: ``at(rid, tokens, n)`` is that of
    ``tokens[:n]``; a chain over the tokens only, so equal prompts agree across schedulers."""

    def __init__(self) -> None:
        self.chains: dict[str, list[bytes]] = {}

    def at(self, rid: str, tokens: list[int], n: int) -> bytes:
        chain = self.chains.setdefault(rid, [b"root"])
        while len(chain) <= n:
            tok = tokens[len(chain) - 1].to_bytes(4, "little")
            chain.append(hashlib.blake2b(chain[-1] + tok, digest_size=16).digest())
        return chain[n]


_KV_MEMO: dict[tuple[bytes, int], torch.Tensor] = {}


def kv_value(digest: bytes, layer: int) -> torch.Tensor:
    """``[2, HEAD_DIM]`` bf16 (small integers: exact in bf16)."""
    got = _KV_MEMO.get((digest, layer))
    if got is None:
        raw = torch.tensor(list(digest), dtype=torch.float32)
        got = torch.stack([raw, (raw + layer + 1) % 256]).to(torch.bfloat16)
        if len(_KV_MEMO) > 200_000:
            _KV_MEMO.clear()
        _KV_MEMO[(digest, layer)] = got
    return got


def state_value(digest: bytes, layer: int) -> torch.Tensor:
    raw = torch.tensor(list(digest * (STATE_BYTES // 16)), dtype=torch.int16) ^ (layer + 1)
    return (raw % 256 - 128).to(torch.int8).view(1, 1, STATE_BYTES)


@dataclass
class TensorWorker:
    """vLLM's worker, simulated on real tensors (see module docstring)."""

    kv_cache_config: Any
    connector: Any
    caches: dict[str, torch.Tensor] = field(default_factory=dict)
    tables: dict[str, list[list[int]]] = field(default_factory=dict)
    state_col: dict[str, int] = field(default_factory=dict)
    chains: Chains = field(default_factory=Chains)
    steps: int = 0

    def __post_init__(self) -> None:
        from vllm.v1.kv_cache_interface import MambaSpec

        kvc = self.kv_cache_config
        self.block_size = kvc.kv_cache_groups[0].kv_cache_spec.block_size
        self.mamba = [i for i, g in enumerate(kvc.kv_cache_groups)
                      if isinstance(g.kv_cache_spec, MambaSpec)]
        self.attn = [i for i in range(len(kvc.kv_cache_groups)) if i not in self.mamba]
        nb = kvc.num_blocks
        for g in self.attn:
            for name in kvc.kv_cache_groups[g].layer_names:
                self.caches[name] = torch.zeros(nb, 2, self.block_size, HEAD_DIM,
                                                dtype=torch.bfloat16)
        for g in self.mamba:
            for name in kvc.kv_cache_groups[g].layer_names:
                self.caches[name] = torch.zeros(nb, 1, 1, STATE_BYTES, dtype=torch.int8)
        self.connector.register_kv_caches(self.caches)

    def layers(self, g: int) -> list[tuple[int, torch.Tensor]]:
        names = self.kv_cache_config.kv_cache_groups[g].layer_names
        return [(i, self.caches[n]) for i, n in enumerate(names)]

    def _zero(self, block: int) -> None:
        for t in self.caches.values():  # one block of memory is every group's: clear it all
            t[block].zero_()

    def _copy(self, src: int, dst: int) -> None:
        for t in self.caches.values():
            t[dst].copy_(t[src])

    def _update_states(self, out: Any) -> set[str]:
        """Apply frees, zeroing, copies and block tables; returns requests whose table is new."""
        for rid in list(out.finished_req_ids) + list(out.preempted_req_ids or ()):
            self.tables.pop(rid, None)
            self.state_col.pop(rid, None)
            self.chains.chains.pop(rid, None)
        for b in out.new_block_ids_to_zero or ():
            self._zero(b)
        for c in out.kv_cache_block_copies or ():
            self._copy(c.src_block_id, c.dst_block_id)
        return h.mirror_tables(out, self.tables, self.state_col)

    def step(self, out: Any, requests: dict[str, Any]) -> Any:
        """One engine step; returns the ``KVConnectorOutput`` for the scheduler."""
        from vllm.v1.outputs import KVConnectorOutput

        self.steps += 1
        fresh = self._update_states(out)
        spans = {}
        for rid, n in out.num_scheduled_tokens.items():
            req = requests[rid]
            start = req.num_computed_tokens - n  # the scheduler already advanced it
            spans[rid] = (start, start + n, list(req.all_token_ids))
        self._preprocess_mamba(spans)
        self.connector.bind_connector_metadata(out.kv_connector_metadata)
        if out.has_sync_kv_loads:
            self.connector.start_load_kv(None)
        self._forward(spans, fresh)
        if not out.has_sync_kv_loads:
            self.connector.start_load_kv(None)
        self.connector.wait_for_save()
        res = self.connector.get_transfer_results(out.finished_req_ids)
        self.connector.clear_connector_metadata()
        return KVConnectorOutput(finished_recving=res.finished_recving or None,
                                 failed_recving=res.failed_recving)

    def _preprocess_mamba(self, spans: dict[str, tuple[int, int, list[int]]]) -> None:
        bs = self.block_size
        for rid, (start, end, _) in spans.items():
            curr = (end - 1) // bs
            prev = self.state_col.get(rid, (start - 1) // bs if start else -1)
            for g in self.mamba:
                col = self.tables[rid][g]
                if prev != -1 and prev != curr:
                    assert col[prev] != 0, f"{rid}: state copy from the null block"
                    self._copy(col[prev], col[curr])
            self.state_col[rid] = curr

    def _forward(self, spans: dict[str, tuple[int, int, list[int]]], fresh: set[str]) -> None:
        """Check what each request reads, then write what it computes.

        A request's whole history is checked on its first step after its block table was
        (re)installed (that is where restored blocks are read); later steps check the
        block they extend.
        """
        bs = self.block_size
        for rid, (start, end, tokens) in spans.items():
            table = self.tables[rid]
            at = self.chains.at
            first = 0 if rid in fresh else start - start % bs
            for g in self.attn:
                for li, t in self.layers(g):
                    for pos in range(first, start):
                        got = t[table[g][pos // bs], :, pos % bs]
                        want = kv_value(at(rid, tokens, pos + 1), li)
                        assert torch.equal(got, want), f"{rid}: wrong KV at {pos} (layer {li})"
                    for pos in range(start, end):
                        t[table[g][pos // bs], :, pos % bs] = kv_value(at(rid, tokens, pos + 1), li)
            for g in self.mamba:
                block = table[g][(end - 1) // bs]
                assert block != 0, f"{rid}: running state in the null block"
                for li, t in self.layers(g):
                    if start:
                        want = state_value(at(rid, tokens, start), li)
                        assert torch.equal(t[block], want), f"{rid}: wrong state at {start}"
                    t[block] = state_value(at(rid, tokens, end), li)


def drive(sched: Any, worker: TensorWorker, sessions: dict[str, list[h.Turn]],
          salts: dict[str, str | None] | None = None, max_steps: int = 5000) -> h.DriveResult:
    """Run every session's turns (each prompt is the whole history) to the end
    (:func:`vllm_sched_harness.run_sessions`), every step through ``worker``."""
    from vllm.v1.outputs import ModelRunnerOutput

    def step(out: Any, live: dict[str, Any]) -> Any:
        kv_out = worker.step(out, live)
        mro = h.model_output(out, live) if out.num_scheduled_tokens else ModelRunnerOutput(
            req_ids=[], req_id_to_index={})
        mro.kv_connector_output = kv_out
        return mro

    return h.run_sessions(sched, sessions, step, salts=salts, max_steps=max_steps)


def run(model_dir: Path, extra: dict, sessions: dict[str, list[h.Turn]],
        salts: dict[str, str | None] | None = None, tier: Any = None,
        **kw: Any) -> tuple[h.DriveResult, Any, TensorWorker]:
    """:func:`make` (``kw`` goes to it), with both roles on ``tier`` if given, then
    :func:`drive`; returns the result, the scheduler and the worker."""
    sched, worker = make(model_dir, extra, **kw)
    if tier is not None:
        sched.connector.tier = worker.connector.tier = tier
        worker.connector._worker.tier = tier
    res = drive(sched, worker, sessions, salts)
    return res, sched, worker


def external(sched: Any) -> int:
    """Tokens the scheduler-side connector found in the tier."""
    return sched.connector.scheduler_stats()["hit_tokens"]


def flip_chunks(redis_server: Any) -> int:
    """Flip one byte in the middle of every chunk in Redis; returns how many."""
    client = redis_server.client()
    n = 0
    for key in client.scan_iter(match="hc:*}:*"):  # chunk keys
        value = bytearray(client.get(key))
        value[len(value) // 2] ^= 0xFF
        client.set(key, bytes(value))
        n += 1
    return n


class Recording(Tier):
    """A tier that remembers every entry put and every entry returned by a read."""

    def __init__(self, inner: Tier) -> None:
        self.inner, self.puts, self.gets = inner, {}, []

    def put(self, key, entry, *, ttl_s=None, priority=0.0):
        self.puts[key] = entry
        return self.inner.put(key, entry, ttl_s=ttl_s, priority=priority)

    def get_many(self, keys):
        got = self.inner.get_many(keys)
        self.gets += [(k, e) for k, e in zip(keys, got) if e is not None]
        return got

    def contains_many(self, keys):
        return self.inner.contains_many(keys)

    def delete(self, key):
        self.inner.delete(key)

    def stats(self):
        return self.inner.stats()
