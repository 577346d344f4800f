"""Test helpers: arenas of strided views, poisoning, and an independent reference copy.

The reference deliberately uses none of hybridcache.kernels: it copies rows one at a time
through plain tensor indexing on a *separate* clone of the arena, so a bug shared by both
backends still shows up as a mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8)
POISON = 0xA5


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    row_shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        n = 1
        for d in self.row_shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Arena:
    """One uint8 buffer holding ``num_slots`` slots; each slot has one row of every tensor.

    ``offsets[j]`` is tensor j's byte offset inside a slot, ``slot_bytes`` the slot stride,
    ``base`` an extra byte offset of slot 0 (odd values make rows misaligned on purpose).
    """

    specs: tuple[TensorSpec, ...]
    num_slots: int
    offsets: tuple[int, ...]
    slot_bytes: int
    base: int

    @property
    def nbytes(self) -> int:
        return self.base + self.num_slots * self.slot_bytes

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Strided typed views ``[num_slots, *row_shape]`` over ``buf``."""
        out = []
        for spec, off in zip(self.specs, self.offsets):
            esize = torch.empty((), dtype=spec.dtype).element_size()
            start = self.base + off
            flat = buf[start : start + (self.num_slots - 1) * self.slot_bytes + spec.row_bytes]
            flat = flat.view(spec.dtype)
            row_numel = spec.row_bytes // esize
            strides = [self.slot_bytes // esize]
            acc = 1
            for d in reversed(spec.row_shape):
                strides.insert(1, acc)
                acc *= d
            out.append(torch.as_strided(flat, (self.num_slots, *spec.row_shape), strides))
            assert out[-1][0].numel() == row_numel
        return out

    def random_buffer(self, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, 256, (self.nbytes,), dtype=torch.uint8, generator=gen)


def make_arena(
    specs: list[TensorSpec],
    num_slots: int,
    *,
    align: int = 16,
    pad: int = 0,
    base: int = 0,
    slot_round: int = 16,
) -> Arena:
    """Slot-major arena: rows of each slot back to back, each aligned to ``align`` bytes
    (at least the element size), plus ``pad`` spare bytes per slot that must never change.
    ``slot_round`` rounds the slot stride; 1 with byte-sized dtypes gives rows whose
    addresses differ modulo 16 between slots (the kernel's unaligned byte path)."""
    offsets, pos = [], 0
    for spec in specs:
        a = max(align, torch.empty((), dtype=spec.dtype).element_size())
        pos = (pos + a - 1) // a * a
        offsets.append(pos)
        pos += spec.row_bytes
    slot_bytes = (pos + pad + slot_round - 1) // slot_round * slot_round
    return Arena(tuple(specs), num_slots, tuple(offsets), slot_bytes, base)


def _row_bytes(t: torch.Tensor, slot: int) -> torch.Tensor:
    return t[slot].view(-1).view(torch.uint8)  # view, never a silent copy


def poison_rows(tensors: list[torch.Tensor], slots) -> None:
    """Overwrite the listed slots of every tensor with the poison byte."""
    for t in tensors:
        for s in slots:
            _row_bytes(t, int(s)).fill_(POISON)


def reference_copy(tensors, pairs, nbytes_per_tensor=None) -> None:
    """Copy rows pair by pair from a snapshot of the sources (copies are concurrent)."""
    for j, t in enumerate(tensors):
        snap = {int(s): _row_bytes(t, int(s)).clone() for s, _ in pairs}
        for i, (s, d) in enumerate(pairs):
            row = _row_bytes(t, int(d))
            n = row.numel() if nbytes_per_tensor is None else nbytes_per_tensor[j][i]
            row[:n] = snap[int(s)][:n]


def mixed_specs() -> list[TensorSpec]:
    """Every dtype the library copies, with odd and even row sizes (a KDA-like mix in small)."""
    return [
        TensorSpec(torch.float32, (2, 8, 8)),  # recurrent state, 512 B
        TensorSpec(torch.bfloat16, (24, 3)),  # conv state, 144 B (not a multiple of 16)
        TensorSpec(torch.float16, (5,)),  # 10 B
        TensorSpec(torch.int8, (7,)),  # 7 B
        TensorSpec(torch.uint8, (33,)),  # 33 B
        TensorSpec(torch.float32, ()),  # one scalar per slot
    ]
