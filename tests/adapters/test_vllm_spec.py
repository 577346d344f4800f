"""Specs from vLLM's ``KVCacheConfig``: true bytes, and the accounting layout over vLLM's pool."""

from __future__ import annotations

import pytest

try:
    from hybridcache.adapters.vllm.spec import (
        pool_spec,
        spec_from_kv_cache_config,
        state_kind,
    )
except ImportError as exc:
    pytest.skip(f"vLLM adapter not importable: {exc}", allow_module_level=True)

import torch  # noqa: E402
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
)

from hybridcache.arena import plan_layout  # noqa: E402
from hybridcache.errors import SpecError  # noqa: E402
from hybridcache.spec import AttentionKind, FlopModel, StateKind  # noqa: E402

pytestmark = pytest.mark.vllm

# Qwen3-Next-80B-A3B (public config): GDN 16 key heads x 128, 32 value heads x 128, conv 4;
# full attention 2 KV heads x 256. Per TP rank 1; vLLM's CPU GDN state is fp32.
GDN_CONV = (3, 2 * 16 * 128 + 32 * 128)  # (kernel-1, q+k+v channels), as vLLM lays it out
GDN_REC = (32, 128, 128)


def qwen3_next_config(block: int = 272, n_groups: int = 3) -> KVCacheConfig:
    mamba = MambaSpec(block_size=block, shapes=(GDN_CONV[::-1], GDN_REC),
                      dtypes=(torch.bfloat16, torch.float32), mamba_cache_mode="align",
                      mamba_type=MambaAttentionBackendEnum.GDN_ATTN)
    attn = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=256,
                             dtype=torch.bfloat16)
    groups = [KVCacheGroupSpec([f"l{i}.gdn.{k}" for k in range(12)], mamba) for i in range(n_groups)]
    groups.append(KVCacheGroupSpec([f"a{k}" for k in range(12)], attn))
    return KVCacheConfig(num_blocks=1000, kv_cache_tensors=[], kv_cache_groups=groups)


def test_true_spec_bytes_match_vllm_and_hand_arithmetic():
    cfg = qwen3_next_config()
    spec = spec_from_kv_cache_config(cfg, name="qwen3-next")
    (attn,) = spec.attention_groups
    assert attn.kind is AttentionKind.FULL and attn.num_layers == 12
    # K and V, 2 heads x 256, bf16: 2048 B per token per layer (vLLM: page / block size).
    assert attn.bytes_per_token_per_layer == 2 * 2 * 256 * 2
    vllm_attn = cfg.kv_cache_groups[-1].kv_cache_spec
    assert attn.bytes_per_token_per_layer == vllm_attn.page_size_bytes // vllm_attn.block_size
    assert [g.kind for g in spec.state_groups] == [StateKind.GDN] * 3
    state = spec.state_groups[0]
    # conv: 3 x (q 16x128 + k 16x128 + v 32x128 = 8192 channels) bf16; recurrent fp32.
    per_layer = 3 * 8192 * 2 + 32 * 128 * 128 * 4
    assert state.bytes_per_layer == per_layer == cfg.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    assert spec.snapshot_bytes == 36 * per_layer


def test_mla_groups_store_one_latent_per_token():
    mla = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    cfg = KVCacheConfig(num_blocks=10, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["m0", "m1"], mla)])
    (g,) = spec_from_kv_cache_config(cfg).attention_groups
    assert g.kind is AttentionKind.MLA and g.bytes_per_token == 2 * 576 * 2


def test_pool_layout_maps_pages_and_slots_onto_vllm_blocks():
    cfg = qwen3_next_config(block=272, n_groups=3)
    spec = pool_spec(cfg, flops=FlopModel(2048, 12, 36), max_model_len=4096)
    lay = plan_layout(spec, cfg.num_blocks * 272, 272, alignment=1)
    # One page = one vLLM block; one slot = one block of each of the 3 GDN groups.
    assert (lay.page_bytes, lay.slot_bytes, lay.pages_per_block, lay.slots_per_block) == (
        272, 3 * 272, 3, 1)
    assert lay.num_pages <= cfg.num_blocks
    for page in (0, 1, 2, 3, 299):
        assert lay.page_offset(page) == page * 272  # page p sits in vLLM block p
    for slot in (0, 5, 332):
        assert lay.slot_offset(slot) == slot * 3 * 272  # slot s covers blocks 3s .. 3s+2


def test_different_block_sizes_are_refused():
    mamba = MambaSpec(block_size=64, shapes=((3, 8),), dtypes=(torch.float32,))
    attn = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16)
    cfg = KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["m"], mamba), KVCacheGroupSpec(["a"], attn)])
    with pytest.raises(SpecError, match="block sizes"):
        pool_spec(cfg, flops=FlopModel(64, 1, 1), max_model_len=128)


def test_state_kinds_follow_vllm_backend_names():
    spec = MambaSpec(block_size=16, shapes=((3, 8),), dtypes=(torch.float32,))
    assert state_kind(spec) is StateKind.MAMBA2  # vLLM's default mamba_type
