"""Tier keys of device cache entries, and the byte moves between the arena and host memory.

**Key layout.** The device caches one entry per hash unit: the unit's KV pages (one page per
attention group) and, at some units, the recurrent-state snapshot after the unit's last
token. A tier stores them the same way, one tier entry per piece of device cache, so that a
demotion is one put and a load takes exactly the units it needs::

    EntryKey(tenant, fingerprint, b"K" + unit digest)   KV of one unit: pieces "kv.<group>"
    EntryKey(tenant, fingerprint, b"S" + unit digest)   snapshot at the unit's end: "state"

* The unit digest is the manager's chained, tenant-salted prefix hash: equal digests mean
  equal token prefixes under equal keys, so a digest names the whole prefix up to the unit.
* ``tenant`` is the request's tenant (``None`` -> ``"_anon"``; names a tier key cannot hold
  -> ``"t-"`` + a hash of the name), and the tier's :class:`~hybridcache.tiers.KeyCodec`
  turns (tenant, fingerprint, b"K"/b"S" + digest) into a keyed per-tenant digest, so two
  tenants never read each other's entries (second wall after the salted hash chain).
* ``fingerprint`` is ``spec.fingerprint()`` + a digest of the arena geometry the bytes are
  laid out in (hash unit, page payloads, state placements): an entry is only ever restored
  into the layout it was copied out of.
* Metadata records the kind and the unit index; a load checks both and every piece's size.

**Bytes.** A KV piece is the group's payload at the start of its page (padding not stored);
the state piece is a slot from its first byte to the end of its last tensor. Both are
contiguous ranges of the arena buffer, so a move is one ``copy_`` per piece (a DMA between
the device and pinned host memory on CUDA): nothing for a gather kernel to batch.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

import torch

from hybridcache.kernels.storage import ArenaStorage
from hybridcache.spec import ModelSpec
from hybridcache.tiers.format import Entry
from hybridcache.tiers.keys import _NAME_RE, EntryKey

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.port import ArenaLayout  # the port's read-only geometry type

KV_TAG, SNAP_TAG = b"K", b"S"
STATE_PIECE = "state"
ANON_TENANT = "_anon"


def kv_piece(group: str) -> str:
    return f"kv.{group}"


def layout_fingerprint(spec: ModelSpec, layout: ArenaLayout, unit: int) -> str:
    """``spec.fingerprint()`` + ``.`` + 12 hex digits of the arena geometry."""
    geometry = {
        "unit": unit,
        "payload": sorted(layout.page_payload.items()),
        "placements": [
            [p.group, p.layer, p.name, p.offset, list(p.shape), p.dtype] for p in layout.placements
        ],
    }
    digest = hashlib.blake2b(json.dumps(geometry).encode(), digest_size=6).hexdigest()
    return f"{spec.fingerprint()}.{digest}"


def tier_tenant(tenant: str | None) -> str:
    """The tier's name for a manager tenant (see the module notes)."""
    if tenant is None:
        return ANON_TENANT
    if _NAME_RE.fullmatch(tenant):
        return tenant
    return "t-" + hashlib.blake2b(tenant.encode(), digest_size=12).hexdigest()


class UnitKeys:
    """Tier keys of one model layout's KV units and snapshots."""

    def __init__(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint
        self._tenants: dict[str | None, str] = {}

    def _tenant(self, tenant: str | None) -> str:
        name = self._tenants.get(tenant)
        if name is None:
            name = self._tenants[tenant] = tier_tenant(tenant)
        return name

    def kv(self, tenant: str | None, digest: bytes) -> EntryKey:
        return EntryKey(self._tenant(tenant), self.fingerprint, KV_TAG + digest)

    def snap(self, tenant: str | None, digest: bytes) -> EntryKey:
        return EntryKey(self._tenant(tenant), self.fingerprint, SNAP_TAG + digest)


class DeviceIO:
    """Copies KV pages and state slots of an :class:`ArenaStorage` to and from host memory.

    Args:
        storage: the arena tensors the manager's page and slot ids address.
        groups: attention group names in the manager's order (``node.pages[g]``).
    """

    def __init__(self, storage: ArenaStorage, groups: list[str]) -> None:
        self.storage = storage
        self.groups = list(groups)
        lay = storage.layout
        self.kv_sizes = {g: lay.page_payload[g] for g in self.groups}
        self.state_span = max((p.offset + p.nbytes for p in lay.placements), default=0)
        self.kv_bytes = sum(self.kv_sizes.values())
        self._cuda = storage.device.type == "cuda"
        self._pending = False

    # ------------------------------------------------------------------ device -> host
    def _to_host(self, view: torch.Tensor) -> torch.Tensor:
        """A fresh host copy (pinned on CUDA); synchronous, because the device bytes may be
        reused as soon as the eviction hook returns."""
        out = torch.empty(view.numel(), dtype=torch.uint8, pin_memory=self._cuda)
        out.copy_(view)
        return out

    def read_kv(self, pages: tuple[int, ...], depth: int) -> Entry:
        """The entry of one unit's KV pages (one page per group, in group order)."""
        st = self.storage
        pieces = {
            kv_piece(g): self._to_host(st.page_bytes_view(p)[: self.kv_sizes[g]])
            for g, p in zip(self.groups, pages, strict=True)
        }
        return Entry(pieces, meta={"k": "kv", "d": depth})

    def read_snapshot(self, slot: int, depth: int) -> Entry:
        """The entry of the snapshot in ``slot`` (after unit ``depth``)."""
        view = self.storage.slot_bytes_view(slot)[: self.state_span]
        return Entry({STATE_PIECE: self._to_host(view)}, meta={"k": "state", "d": depth})

    # ------------------------------------------------------------------ host -> device
    def kv_entry_ok(self, entry: Entry, depth: int) -> bool:
        """Whether ``entry`` is the KV of unit ``depth`` in this layout (names, sizes, meta)."""
        return self._ok(entry, "kv", depth, {kv_piece(g): n for g, n in self.kv_sizes.items()})

    def snapshot_entry_ok(self, entry: Entry, depth: int) -> bool:
        return self._ok(entry, "state", depth, {STATE_PIECE: self.state_span})

    @staticmethod
    def _ok(entry: Entry, kind: str, depth: int, sizes: dict[str, int]) -> bool:
        if entry.meta.get("k") != kind or entry.meta.get("d") != depth:
            return False
        if set(entry.pieces) != set(sizes):
            return False
        for name, n in sizes.items():
            piece = entry.pieces[name]
            if not isinstance(piece, torch.Tensor) or piece.dtype != torch.uint8:
                return False
            if tuple(piece.shape) != (n,):
                return False
        return True

    def write_kv(self, pages: tuple[int, ...], entry: Entry) -> int:
        """Copy a validated KV entry into ``pages``; returns the bytes moved."""
        st = self.storage
        for g, p in zip(self.groups, pages, strict=True):
            dst = st.page_bytes_view(p)[: self.kv_sizes[g]]
            dst.copy_(entry.pieces[kv_piece(g)], non_blocking=self._cuda)
        self._pending = self._cuda
        return self.kv_bytes

    def write_snapshot(self, slot: int, entry: Entry) -> int:
        dst = self.storage.slot_bytes_view(slot)[: self.state_span]
        dst.copy_(entry.pieces[STATE_PIECE], non_blocking=self._cuda)
        self._pending = self._cuda
        return self.state_span

    def synchronize(self) -> None:
        """Wait for asynchronous host-to-device copies (before the entries are registered,
        so the engine never reads a page still being written)."""
        if self._pending:
            torch.cuda.synchronize(self.storage.device)
            self._pending = False
