"""Real tensors behind an :class:`~hybridcache.arena.ArenaLayout`: one byte buffer, typed views.

The manager only does bookkeeping: it hands out page ids and slot ids. An engine needs
memory behind those ids, laid out exactly as the arena says, or a page id from a block
table would address the wrong bytes. :class:`ArenaStorage` allocates ONE ``uint8`` buffer of
``layout.capacity_bytes`` and carves typed views out of it:

- per attention group and layer, a KV view ``[num_pages, *page_shape]`` indexed by page id
  (``page_shape`` is ``(2, unit, kv_heads, head_dim)`` for full / sliding attention, K then
  V, and ``(unit, latent)`` for MLA);
- per state group, layer and tensor, a state view ``[num_slots, *shape]`` indexed by slot id.

Both kinds share the buffer, because a block of the arena is a KV slab at one moment and a
state block the next: writing through a stale view of the wrong kind would corrupt live
data, which is exactly what the tests of the reference model would catch.

Strides. Pages always sit at a uniform stride (see :mod:`hybridcache.arena`). Slots do too,
except when several slots share a block (snapshots smaller than a page) and the page is not
a multiple of the slot: then slot ``i`` is at ``block(i) * block_bytes + (i % per_block) *
slot_bytes`` and no single ``as_strided`` view can express it. :attr:`uniform_slots` says
which case holds; :meth:`state_view` is only available in the uniform case, while
:meth:`state_slot` and :meth:`copy_slots` work in both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from hybridcache.arena import ArenaLayout, TensorPlacement
from hybridcache.kernels.device_copy import copy_states
from hybridcache.spec import AttentionGroupSpec, AttentionKind, ModelSpec, dtype_bytes

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


class SlotPlan(Protocol):
    """A copy plan as the manager hands it out (:class:`hybridcache.manager.CopyPlan`)."""

    src: Sequence[int]
    dst: Sequence[int]


def page_shape(group: AttentionGroupSpec, unit: int) -> tuple[int, ...]:
    """Shape of one layer's part of one KV page: K and V per head, or one MLA latent."""
    if group.kind is AttentionKind.MLA:
        return (unit, group.num_kv_heads * group.head_dim)
    return (2, unit, group.num_kv_heads, group.head_dim)


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


class ArenaStorage:
    """One byte buffer of ``layout.capacity_bytes`` with KV and state views over it.

    Args:
        layout: the arena geometry of the manager that hands out the ids.
        spec: the model spec the layout was planned for (gives the page shapes).
        device: where the buffer lives.

    Attributes:
        buffer: the ``uint8`` arena (zero-initialised).
        unit: tokens per KV page (the manager's hash unit).
        uniform_slots: True when every slot is at ``slot * slot_stride`` bytes.
        copy_backend: ``"kernel"`` or ``"torch"``: what the last :meth:`copy_slots` used.
    """

    def __init__(self, layout: ArenaLayout, spec: ModelSpec, device: str | torch.device = "cpu"):
        self.layout = layout
        self.spec = spec
        self.device = torch.device(device)
        self.buffer = torch.zeros(layout.capacity_bytes, dtype=torch.uint8, device=self.device)
        self.unit = self._unit()
        lay = layout
        self.uniform_slots = (
            lay.slots_per_block <= 1 or lay.block_bytes == lay.slots_per_block * lay.slot_bytes
        )
        self.slot_stride = lay.slot_bytes if lay.slots_per_block > 1 else lay.block_bytes
        self.page_stride = lay.page_bytes
        if lay.pages_per_block and lay.block_bytes != lay.pages_per_block * lay.page_bytes:
            raise ValueError(
                "arena layout has non-uniform page strides; KV views need uniform pages"
            )
        self._placements: dict[tuple[str, int, str], TensorPlacement] = {
            (p.group, p.layer, p.name): p for p in lay.placements
        }
        self._kv: dict[tuple[str, int], torch.Tensor] = {}
        self._build_kv_views()
        self._state: dict[tuple[str, int, str], torch.Tensor] = {}
        self._state_blocks: dict[tuple[str, int, str], torch.Tensor] = {}
        self._build_state_views()
        self.copy_backend = "none"

    # ------------------------------------------------------------------ construction
    def _unit(self) -> int:
        groups = self.spec.attention_groups
        if not groups:
            return 0
        g = groups[0]
        return self.layout.page_payload[g.name] // g.bytes_per_token

    def _typed(self, dtype: str) -> torch.Tensor:
        """The whole buffer reinterpreted as ``dtype`` (offsets must be multiples of its size)."""
        size = dtype_bytes(dtype)
        n = self.buffer.numel() // size
        return self.buffer[: n * size].view(TORCH_DTYPES[dtype])

    def _build_kv_views(self) -> None:
        lay = self.layout
        for g in self.spec.attention_groups:
            elem = dtype_bytes(g.dtype)
            shape = page_shape(g, self.unit)
            layer_bytes = self.unit * g.bytes_per_token_per_layer
            if lay.page_bytes % elem or layer_bytes % elem:
                raise ValueError(f"attention group {g.name!r}: page not aligned to its dtype")
            typed = self._typed(g.dtype)
            for layer in range(g.num_layers):
                self._kv[(g.name, layer)] = torch.as_strided(
                    typed,
                    (lay.num_pages, *shape),
                    (lay.page_bytes // elem, *_contiguous_strides(shape)),
                    layer * layer_bytes // elem,
                )

    def _build_state_views(self) -> None:
        lay = self.layout
        spb = max(lay.slots_per_block, 1)
        for key, p in self._placements.items():
            elem = dtype_bytes(p.dtype)
            if p.offset % elem or lay.slot_bytes % elem or lay.block_bytes % elem:
                raise ValueError(f"state tensor {key}: offset not aligned to its dtype")
            typed = self._typed(p.dtype)
            inner = _contiguous_strides(p.shape)
            self._state_blocks[key] = torch.as_strided(
                typed,
                (lay.num_blocks, spb, *p.shape),
                (lay.block_bytes // elem, lay.slot_bytes // elem, *inner),
                p.offset // elem,
            )
            if self.uniform_slots:
                self._state[key] = torch.as_strided(
                    typed,
                    (lay.num_slots, *p.shape),
                    (self.slot_stride // elem, *inner),
                    p.offset // elem,
                )

    # ------------------------------------------------------------------ views
    def kv_view(self, group: str, layer: int) -> torch.Tensor:
        """``[num_pages, *page_shape]`` view of one attention layer's KV, indexed by page id."""
        return self._kv[(group, layer)]

    def state_view(self, group: str, layer: int, name: str) -> torch.Tensor:
        """``[num_slots, *shape]`` view of one state tensor, indexed by slot id.

        Raises:
            ValueError: the layout's slots are not at a uniform stride (use :meth:`state_slot`).
        """
        if not self.uniform_slots:
            raise ValueError("slots are not at a uniform stride in this layout; use state_slot()")
        return self._state[(group, layer, name)]

    def state_slot(self, group: str, layer: int, name: str, slot: int) -> torch.Tensor:
        """One slot's tensor (a view, writable in place); works for every layout."""
        if not 0 <= slot < self.layout.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.layout.num_slots})")
        spb = max(self.layout.slots_per_block, 1)
        return self._state_blocks[(group, layer, name)][slot // spb, slot % spb]

    def state_keys(self) -> list[tuple[str, int, str]]:
        """``(group, layer, name)`` of every state tensor, in placement order."""
        return [(p.group, p.layer, p.name) for p in self.layout.placements]

    def state_views(self) -> list[torch.Tensor]:
        """Every ``[num_slots, ...]`` state view (uniform layouts only), in placement order."""
        return [self.state_view(*k) for k in self.state_keys()]

    def slot_bytes_view(self, slot: int) -> torch.Tensor:
        """The raw bytes of one slot (all its tensors, padding included)."""
        off = self.layout.slot_offset(slot)
        return self.buffer[off : off + self.layout.slot_bytes]

    def page_bytes_view(self, page: int) -> torch.Tensor:
        """The raw bytes of one KV page (all layers of the widest group, padding included)."""
        off = self.layout.page_offset(page)
        return self.buffer[off : off + self.layout.page_bytes]

    # ------------------------------------------------------------------ operations
    def zero_slot(self, slot: int) -> None:
        """Reset one slot to the zero state (a request without a snapshot hit starts here)."""
        for key in self.state_keys():
            self.state_slot(*key, slot).zero_()

    def copy_slots(self, plan: SlotPlan, *, force_torch: bool = False) -> int:
        """Execute a copy plan ``src[i] -> dst[i]`` over every state tensor of every layer.

        Uses the kernels' ``copy_states`` (one launch on GPU) when it is importable and the
        slots are uniform; otherwise copies each slot's payload bytes with torch, which is
        correct for every layout. Returns the number of pairs copied.
        """
        pairs = [(int(s), int(d)) for s, d in zip(plan.src, plan.dst) if int(s) != int(d)]
        if not pairs:
            return 0
        n = self.layout.num_slots
        for s, d in pairs:
            if not (0 <= s < n and 0 <= d < n):
                raise IndexError(f"copy plan pair {s} -> {d} out of range [0, {n})")
        if not force_torch and self.uniform_slots and self.layout.placements:
            copy_states(plan, self.state_views())
            self.copy_backend = "kernel"
            return len(pairs)
        span = self._payload_span()
        for s, d in pairs:
            so, do = self.layout.slot_offset(s), self.layout.slot_offset(d)
            self.buffer[do : do + span].copy_(self.buffer[so : so + span])
        self.copy_backend = "torch"
        return len(pairs)

    def _payload_span(self) -> int:
        """Bytes from a slot's start to the end of its last tensor (what a copy must move)."""
        return max((p.offset + p.nbytes for p in self.layout.placements), default=0)

    def describe(self) -> dict[str, object]:
        """Geometry summary, JSON-friendly (used by the docs and the check's verbose mode)."""
        lay = self.layout
        return {
            "capacity_bytes": lay.capacity_bytes,
            "page_bytes": lay.page_bytes,
            "slot_bytes": lay.slot_bytes,
            "block_bytes": lay.block_bytes,
            "pages_per_block": lay.pages_per_block,
            "slots_per_block": lay.slots_per_block,
            "num_pages": lay.num_pages,
            "num_slots": lay.num_slots,
            "uniform_slots": self.uniform_slots,
            "tokens_per_page": self.unit,
            "kv_views": len(self._kv),
            "state_views": len(self._state_blocks),
            "buffer_mib": round(lay.capacity_bytes / 2**20, 3),
            "state_elems_per_slot": sum(math.prod(p.shape) for p in lay.placements),
        }
