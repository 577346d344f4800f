"""The reference model over paged storage equals the same model over plain tensors."""

from __future__ import annotations

import pytest
import torch

from hybridcache.adapters.reference import (
    ReferenceConfig,
    ReferenceModel,
    Runner,
    RunnerConfig,
    model_spec,
    ngram_draft,
)
from hybridcache.kernels.storage import ArenaStorage
from hybridcache.manager import CacheConfig, HybridCacheManager

from .conftest import TINY


def _tokens(n: int, seed: int = 0, vocab: int = 128) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def test_spec_is_derived_from_the_config():
    spec = model_spec(TINY)
    (attn,) = spec.attention_groups
    (kda,) = spec.state_groups
    assert attn.num_layers == 1 and kda.num_layers == 3
    assert spec.kv_bytes_per_token == 2 * TINY.attn_kv_heads * TINY.attn_head_dim * 4
    shapes = {t.name: (t.shape, t.dtype) for t in kda.tensors}
    assert shapes["recurrent"] == ((2, 8, 8), "float32")
    assert shapes["conv"] == ((3 * 16, 3), "float32")
    assert TINY.group_layer(3) == ("attn", 0) and TINY.group_layer(2) == ("kda", 2)


@pytest.mark.parametrize(
    "bad",
    [
        {"layer_pattern": "AAX"},
        {"layer_pattern": "AA"},
        {"attn_heads": 3},
        {"conv_kernel": 1},
        {"hidden_size": 0},
    ],
)
def test_config_validation(bad):
    with pytest.raises(ValueError):
        ReferenceConfig(**bad)


@pytest.mark.parametrize("mode", ["chunked", "recurrent"])
def test_chunked_steps_equal_one_dense_pass(mode):
    """Steps of 7, 20 and 1 tokens (state carried over) == the whole sequence at once."""
    model = ReferenceModel(TINY, kda_mode=mode)
    toks = _tokens(28)
    full = model.logits_full(toks)
    ctx = model.dense_context()
    parts, pos = [], 0
    for n in (7, 20, 1):
        parts.append(model.forward(toks[pos : pos + n], pos, ctx.begin()))
        pos += n
    assert (torch.cat(parts) - full).abs().max() < 1e-5


def test_chunked_and_recurrent_models_agree():
    toks = _tokens(150, seed=1)
    a = ReferenceModel(TINY, "chunked").logits_full(toks)
    b = ReferenceModel(TINY, "recurrent").logits_full(toks)
    assert (a - b).abs().max() < 1e-5


def test_runner_logits_equal_dense_reference_and_snapshots_are_restorable():
    """Serve a prompt through manager + arena, then the same prompt again (a hit): the
    generated logits equal a dense, cache-free computation of the same tokens."""
    spec = model_spec(TINY)
    mgr = HybridCacheManager(spec, 1 << 18, CacheConfig(hash_unit=16))
    storage = ArenaStorage(mgr.layout, spec)
    model = ReferenceModel(TINY)
    runner = Runner(model, mgr, storage, RunnerConfig(prefill_chunk=24))
    prompt = _tokens(70, seed=2)
    for rid in ("a", "b"):
        runner.submit(rid, prompt, 5)
        while not (done := runner.step()):
            pass
        (res,) = done
        dense = model.logits_full(res.history[:-1])[len(prompt) - 1 :]
        assert (res.logits - dense).abs().max() < 1e-5
        assert res.tokens == dense.argmax(-1).tolist()
    assert res.hit_tokens == 64  # the last-token snapshot of "a" (70 tokens, unit 16)
    assert runner.stats.copies == 1


def test_ngram_draft():
    assert ngram_draft([1, 2, 3, 9, 1, 2], 2, 3) == [3, 9, 1]
    assert ngram_draft([5, 1, 7, 7, 1], 2, 2) == [7, 7]  # falls back to the 1-gram
    assert ngram_draft([1, 2, 3], 2, 3) == []
    assert ngram_draft([4, 4], 2, 3) == [4]
    assert ngram_draft([1, 2, 1], 2, 0) == []
