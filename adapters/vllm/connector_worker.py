"""Worker side of :class:`~.connector.HybridCacheConnector`: block bytes <-> tier entries.

vLLM 0.32 hands a connector one tensor per layer (``register_kv_caches``): a view of the
shared KV cache allocation whose first dimension is the block id (attention layers:
``[blocks, heads, tokens, ...]`` in the model dtype; Mamba-family layers: the state page as
raw bytes). Groups overlay one allocation, so a block id belongs to exactly one group at a
time, and the connector only ever touches the block ids the scheduler named for a group.

A piece of an entry is one block of every layer of one group, stacked:
``kv.<gid>`` / ``state.<gid>`` of shape ``[layers, *block_shape]``. Loads are all or
nothing: every entry of a request is fetched and checked (present, validated by the tier,
every piece of the expected name, dtype and shape) before the first byte is written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from hybridcache.tiers import Entry, Tier

from .connector_plan import LoadJob, SaveJob

logger = logging.getLogger("hybridcache.adapters.vllm.connector")


@dataclass
class WorkerStats:
    """Counters of the worker-side connector (cumulative)."""

    loads: int = 0
    load_failures: int = 0
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    load_s: float = 0.0
    saves: int = 0
    save_failures: int = 0
    bytes_saved: int = 0
    save_s: float = 0.0
    failure_reasons: dict[str, int] = field(default_factory=dict)

    def fail(self, reason: str) -> None:
        """Count one failed load and why."""
        self.load_failures += 1
        self.failure_reasons[reason] = self.failure_reasons.get(reason, 0) + 1


class BlockIO:
    """Gathers and scatters whole blocks of the layers of each KV cache group."""

    def __init__(self, layer_names: Mapping[int, Sequence[str]], num_blocks: int) -> None:
        self.layer_names = {g: list(names) for g, names in layer_names.items()}
        self.num_blocks = num_blocks
        self.layers: dict[int, list[torch.Tensor]] = {}

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Keep a ``[num_blocks, ...]`` view of every layer of the connector's groups.

        Raises:
            ValueError: a layer is missing or its first dimension is not the block id.
        """
        for gid, names in self.layer_names.items():
            views = []
            for name in names:
                t = kv_caches.get(name)
                if not isinstance(t, torch.Tensor):
                    raise ValueError(f"HybridCacheConnector: no KV cache tensor for {name}")
                if t.shape[0] != self.num_blocks:
                    if t.shape[0] % self.num_blocks:
                        raise ValueError(
                            f"HybridCacheConnector: {name} has {t.shape[0]} rows, not a "
                            f"multiple of {self.num_blocks} blocks"
                        )
                    t = t.unflatten(0, (self.num_blocks, -1))  # kernel blocks -> blocks
                views.append(t)
            shapes = {(tuple(v.shape[1:]), v.dtype) for v in views}
            if len(shapes) != 1:
                raise ValueError(f"HybridCacheConnector: group {gid} mixes layer shapes {shapes}")
            self.layers[gid] = views

    def piece_spec(self, gid: int) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of one block of group ``gid`` across its layers."""
        views = self.layers[gid]
        return (len(views), *views[0].shape[1:]), views[0].dtype

    def gather(self, gid: int, block_ids: Sequence[int]) -> torch.Tensor:
        """``[len(block_ids), layers, ...]`` on the CPU (a copy: safe to keep after the step)."""
        views = self.layers[gid]
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=views[0].device)
        out = torch.stack([v.index_select(0, idx) for v in views], dim=1)
        return out.to("cpu") if out.device.type != "cpu" else out

    def write_block(self, gid: int, block_id: int, piece: torch.Tensor) -> None:
        """Copy one block (``[layers, ...]``) into ``block_id`` of every layer of ``gid``."""
        for li, v in enumerate(self.layers[gid]):
            v[block_id].copy_(piece[li])

    def scatter(self, gid: int, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Write ``data`` (``[len(block_ids), layers, ...]``) into the blocks, in place."""
        views = self.layers[gid]
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=views[0].device)
        for li, v in enumerate(views):
            v.index_copy_(0, idx, data[:, li].to(v.device))


class WorkerSide:
    """Runs the load and save jobs of one step against a tier."""

    def __init__(
        self,
        tier: Tier,
        fingerprint: str,
        io: BlockIO,
        kv_groups: Sequence[int],
        state_groups: Sequence[int],
        ttl_s: float | None,
    ) -> None:
        self.tier = tier
        self.fingerprint = fingerprint
        self.io = io
        self.kv_groups = list(kv_groups)
        self.state_groups = list(state_groups)
        self.ttl_s = ttl_s
        self.stats = WorkerStats()
        # Pieces every entry must hold (name -> shape, dtype); the last entry of a load
        # (a hybrid entry) also holds the states.
        kv = {f"kv.{g}": io.piece_spec(g) for g in self.kv_groups}
        self._kv_pieces = kv
        self._hybrid_pieces = kv | {f"state.{g}": io.piece_spec(g) for g in self.state_groups}

    # ------------------------------------------------------------------ loads
    @staticmethod
    def _check(
        entry: Entry | None, pieces: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    ) -> str | None:
        """Why ``entry`` cannot be restored (``None``: it can)."""
        if entry is None:
            return "missing"
        for name, (shape, dtype) in pieces.items():
            piece = entry.pieces.get(name)
            if not isinstance(piece, torch.Tensor):
                return "piece-missing"
            if tuple(piece.shape) != shape or piece.dtype != dtype:
                return "piece-shape"
        return None

    def load(self, job: LoadJob) -> bool:
        """Restore one request's blocks and state; ``False`` (nothing written) on any doubt."""
        t0 = time.perf_counter()
        if not job.keys:
            self.stats.fail("plan")
            return False
        try:
            entries = self.tier.get_many([k.entry_key(self.fingerprint) for k in job.keys])
            for i, entry in enumerate(entries):
                pieces = self._hybrid_pieces if i == len(entries) - 1 else self._kv_pieces
                reason = self._check(entry, pieces)
                if reason is not None:
                    self.stats.fail(reason)
                    return False
            nbytes = 0
            for g in self.kv_groups:  # straight from the tier's buffers: no staging copy
                for entry, block_id in zip(entries, job.kv_blocks[g], strict=True):
                    piece = entry.pieces[f"kv.{g}"]  # type: ignore[union-attr]
                    self.io.write_block(g, block_id, piece)
                    nbytes += piece.numel() * piece.element_size()
            for g in self.state_groups:
                state = entries[-1].pieces[f"state.{g}"]  # type: ignore[union-attr]
                self.io.write_block(g, job.state_blocks[g], state)
                nbytes += state.numel() * state.element_size()
        except Exception as exc:  # noqa: BLE001 - a failed load is a miss, never a crash
            logger.warning("HybridCacheConnector: load of %s failed: %r", job.req_id, exc)
            self.stats.fail("error")
            return False
        self.stats.loads += 1
        self.stats.blocks_loaded += len(job.keys)
        self.stats.bytes_loaded += nbytes
        self.stats.load_s += time.perf_counter() - t0
        return True

    # ------------------------------------------------------------------ saves
    def save(self, jobs: Sequence[SaveJob]) -> None:
        """Copy the named blocks out of the cache and put one entry per job (never raises)."""
        if not jobs:
            return
        t0 = time.perf_counter()
        try:
            kv = {g: self.io.gather(g, [j.kv_blocks[g] for j in jobs]) for g in self.kv_groups}
            hybrid = [j for j in jobs if j.state_blocks is not None]
            states = {
                g: self.io.gather(g, [j.state_blocks[g] for j in hybrid])  # type: ignore[index]
                for g in self.state_groups
            } if hybrid else {}
        except Exception as exc:  # noqa: BLE001
            logger.warning("HybridCacheConnector: reading blocks to save failed: %r", exc)
            self.stats.save_failures += len(jobs)
            return
        h = 0
        for i, job in enumerate(jobs):
            pieces = {f"kv.{g}": kv[g][i] for g in self.kv_groups}
            if job.state_blocks is not None:
                pieces.update({f"state.{g}": states[g][h] for g in self.state_groups})
                h += 1
            try:
                entry = Entry(pieces, meta={"block": job.block})
                ok = self.tier.put(job.key.entry_key(self.fingerprint), entry, ttl_s=self.ttl_s)
            except Exception as exc:  # noqa: BLE001
                logger.warning("HybridCacheConnector: save failed: %r", exc)
                ok = False
            if ok:
                self.stats.saves += 1
                self.stats.bytes_saved += entry.nbytes
            else:
                self.stats.save_failures += 1
        self.stats.save_s += time.perf_counter() - t0
