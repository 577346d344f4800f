"""vLLM's attention block for a hybrid model in ``align`` mode: the one fact about vLLM's
geometry that both the simulator's ``vllm-align`` emulation (:mod:`hybridcache.sim.policies`)
and the adaptive policy's candidates (:mod:`hybridcache.candidates`: vLLM's rules at its own
block boundaries) need, kept in the core so that the candidates do not import the simulator.
"""

from __future__ import annotations

import math

from hybridcache.spec import AttentionKind, ModelSpec

#: vLLM's default block size and the kernel alignment its MLA backends ask for.
VLLM_DEFAULT_BLOCK = 16
VLLM_MLA_ALIGNMENT = 128


def vllm_align_block(spec: ModelSpec) -> int:
    """Attention block size vLLM picks in ``align`` mode for a hybrid model.

    Follows ``Platform._align_hybrid_block_size`` (vLLM 0.32): one attention *layer*'s page
    for the block must hold one state *layer*'s page, so ``block = a * ceil(state_page /
    (a * kv_page_per_token))`` where both pages are per layer and ``a`` is the kernel
    alignment (16, raised to 128 for MLA models); the state page is the largest state
    group's per-layer bytes. Attention-only models keep 16.
    """
    if not spec.has_state or not spec.attention_groups:
        return VLLM_DEFAULT_BLOCK
    kv_per_token = max(g.bytes_per_token_per_layer for g in spec.attention_groups)
    state_page = max(g.bytes_per_layer for g in spec.state_groups)
    mla = any(g.kind is AttentionKind.MLA for g in spec.attention_groups)
    align = VLLM_MLA_ALIGNMENT if mla else VLLM_DEFAULT_BLOCK
    return align * math.ceil(state_page / (align * kv_per_token))
