"""Small model specs for core tests: tiny so that eviction happens after a few requests."""

from __future__ import annotations

import pytest

from hybridcache.spec import (
    AttentionGroupSpec,
    FlopModel,
    ModelSpec,
    StateGroupSpec,
    StateTensorSpec,
)


def tiny_spec(
    state: bool = True, attention: bool = True, big_state: bool = True, max_len: int = 4096
) -> ModelSpec:
    """A hybrid spec with 256-byte-per-token KV and a 4 KiB (or 64 B) snapshot."""
    attn = (AttentionGroupSpec("attn", "full", num_layers=2, num_kv_heads=1, head_dim=32, dtype="float16"),)
    shape = (4, 16, 16) if big_state else (4,)
    st = (
        StateGroupSpec(
            "kda",
            "kda",
            num_layers=2,
            tensors=(
                StateTensorSpec("recurrent", shape, "float32"),
                StateTensorSpec("conv", (8, 3), "bfloat16"),
            ),
        ),
    )
    return ModelSpec(
        name="tiny",
        attention_groups=attn if attention else (),
        state_groups=st if state else (),
        flops=FlopModel(hidden_size=64, num_attention_layers=2, num_recurrent_layers=2),
        max_model_len=max_len,
    )


@pytest.fixture
def spec() -> ModelSpec:
    return tiny_spec()
