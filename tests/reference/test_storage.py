"""ArenaStorage: typed views carved from one buffer at the offsets the arena layout gives."""

from __future__ import annotations

import pytest
import torch

from hybridcache.arena import plan_layout
from hybridcache.kernels.storage import ArenaStorage
from hybridcache.manager import CopyPlan
from hybridcache.spec import (
    AttentionGroupSpec,
    FlopModel,
    ModelSpec,
    StateGroupSpec,
    StateTensorSpec,
)


def _spec(state_shape=(2, 8, 8), attn_layers=2, kv_heads=2, head_dim=8, mla=False) -> ModelSpec:
    attn = ()
    if attn_layers:
        kind = "mla" if mla else "full"
        attn = (
            AttentionGroupSpec(
                "attn",
                kind,
                num_layers=attn_layers,
                num_kv_heads=1 if mla else kv_heads,
                head_dim=head_dim,
                dtype="float32",
            ),
        )
    st = ()
    if state_shape:
        st = (
            StateGroupSpec(
                "kda",
                "kda",
                num_layers=3,
                tensors=(
                    StateTensorSpec("conv", (12, 3), "bfloat16"),
                    StateTensorSpec("recurrent", state_shape, "float32"),
                ),
            ),
        )
    return ModelSpec("t", attn, st, FlopModel(32, max(attn_layers, 1), 3))


def _storage(spec: ModelSpec, capacity: int = 1 << 16, unit: int = 16) -> ArenaStorage:
    return ArenaStorage(plan_layout(spec, capacity, unit), spec)


def test_views_alias_the_arena_bytes_at_layout_offsets():
    st = _storage(_spec())
    lay = st.layout
    assert st.uniform_slots and lay.slots_per_block == 1
    assert st.buffer.numel() == lay.capacity_bytes
    for page in (0, lay.num_pages - 1):
        st.buffer.zero_()
        st.kv_view("attn", 1)[page, 1, 3, 0, 0] = 1.0
        nz = torch.nonzero(st.buffer).flatten()
        layer_bytes = 16 * 2 * 2 * 8 * 4
        elem = ((1 * 16 + 3) * 2 + 0) * 8  # (V, token 3, head 0, dim 0) inside the layer
        expect = lay.page_offset(page) + layer_bytes + elem * 4
        assert expect <= nz.min().item() <= nz.max().item() < expect + 4
    for slot in (0, lay.num_slots - 1):
        st.buffer.zero_()
        st.state_view("kda", 2, "recurrent")[slot].fill_(1.0)
        p = next(p for p in lay.placements if p.layer == 2 and p.name == "recurrent")
        nz = torch.nonzero(st.buffer).flatten()
        lo = lay.slot_offset(slot) + p.offset
        assert nz.min().item() >= lo and nz.max().item() < lo + p.nbytes


def test_every_page_and_slot_tensor_is_disjoint():
    """Write a distinct value into every (page, layer) and (slot, tensor); all survive."""
    st = _storage(_spec(), capacity=1 << 15)
    lay = st.layout
    for page in range(lay.num_pages):
        for layer in range(2):
            st.kv_view("attn", layer)[page].fill_(page * 10 + layer)
    for page in range(lay.num_pages):
        for layer in range(2):
            assert (st.kv_view("attn", layer)[page] == page * 10 + layer).all()
    for i, key in enumerate(st.state_keys()):
        for slot in range(lay.num_slots):
            st.state_view(*key)[slot].fill_(slot * 100 + i)
    for i, key in enumerate(st.state_keys()):
        for slot in range(lay.num_slots):
            assert (st.state_slot(*key, slot) == slot * 100 + i).all()


def test_non_uniform_slots_use_the_per_slot_accessor():
    """Small states share a block; when the page is not a multiple of the slot, no single
    stride fits and only the per-slot accessor (and copy_slots) may be used."""
    spec = _spec(state_shape=(5,), attn_layers=4, kv_heads=4, head_dim=16)
    st = _storage(spec, capacity=1 << 17)
    lay = st.layout
    assert lay.slots_per_block > 1
    assert lay.block_bytes != lay.slots_per_block * lay.slot_bytes
    assert not st.uniform_slots
    with pytest.raises(ValueError, match="uniform"):
        st.state_view("kda", 0, "recurrent")
    p = next(p for p in lay.placements if p.layer == 1 and p.name == "recurrent")
    for slot in range(lay.num_slots):
        st.buffer.zero_()
        st.state_slot("kda", 1, "recurrent", slot).fill_(2.0)
        nz = torch.nonzero(st.buffer).flatten()
        assert nz.min().item() >= lay.slot_offset(slot) + p.offset
        assert nz.max().item() < lay.slot_offset(slot) + p.offset + p.nbytes
    for slot in range(lay.num_slots):
        st.state_slot("kda", 0, "conv", slot).fill_(slot)
    st.copy_slots(CopyPlan((1, 2), (lay.num_slots - 1, 0)))
    assert st.copy_backend == "torch"
    assert (st.state_slot("kda", 0, "conv", lay.num_slots - 1) == 1).all()
    assert (st.state_slot("kda", 0, "conv", 0) == 2).all()


@pytest.mark.parametrize("force_torch", [False, True])
def test_copy_slots_copies_every_tensor_and_nothing_else(force_torch):
    st = _storage(_spec(), capacity=1 << 15)
    gen = torch.Generator().manual_seed(0)
    # Pages and slots are views of the same bytes (a block is either), so random bytes
    # everywhere stand for both; compare bytes, not values (they may decode as NaN).
    st.buffer.copy_(torch.randint(0, 256, st.buffer.shape, generator=gen, dtype=torch.uint8))
    before = st.buffer.clone()
    n = st.copy_slots(CopyPlan((0, 0, 3), (1, 2, 3)), force_torch=force_torch)
    assert n == 2  # the 3 -> 3 pair is a no-op
    assert st.copy_backend == ("torch" if force_torch else "kernel")
    lay = st.layout
    for key in st.state_keys():
        v = st.state_view(*key)
        for d in (1, 2):
            assert torch.equal(v[d].view(torch.uint8), v[0].view(torch.uint8))
    changed = torch.nonzero(st.buffer != before).flatten()
    lo, hi = lay.slot_offset(1), lay.slot_offset(2) + lay.slot_bytes
    assert changed.numel() > 0 and changed.min() >= lo and changed.max() < hi


def test_zero_slot_and_range_checks():
    st = _storage(_spec())
    for key in st.state_keys():
        st.state_view(*key).fill_(3)
    st.zero_slot(1)
    for key in st.state_keys():
        assert (st.state_slot(*key, 1) == 0).all() and (st.state_slot(*key, 0) == 3).all()
    with pytest.raises(IndexError):
        st.state_slot("kda", 0, "conv", st.layout.num_slots)
    with pytest.raises(IndexError):
        st.copy_slots(CopyPlan((0,), (st.layout.num_slots,)))


def test_pure_attention_mla_and_pure_state_specs():
    mla = _storage(_spec(state_shape=(), attn_layers=2, head_dim=24, mla=True), capacity=1 << 18)
    assert mla.kv_view("attn", 1).shape == (mla.layout.num_pages, 16, 24)
    assert mla.state_keys() == [] and mla.copy_slots(CopyPlan()) == 0
    pure = _storage(_spec(attn_layers=0))
    assert pure.unit == 0 and pure.layout.num_pages == 0
    assert pure.state_view("kda", 0, "recurrent").shape == (pure.layout.num_slots, 2, 8, 8)
    assert pure.describe()["uniform_slots"] is True
