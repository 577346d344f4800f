"""KDA math: chunked == per-token, and the state-split property the prefix cache relies on."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridcache.adapters.reference.kda import (
    conv_state_at,
    kda_chunked,
    kda_recurrent,
    short_conv,
)


def _inputs(T: int, H: int = 2, K: int = 8, seed: int = 0, decay: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(T, H, K, generator=g), dim=-1)
    k = F.normalize(torch.randn(T, H, K, generator=g), dim=-1)
    v = torch.randn(T, H, K, generator=g)
    logd = -F.softplus(torch.randn(T, H, K, generator=g) * 2 - 1) * decay
    beta = torch.sigmoid(torch.randn(T, H, generator=g))
    s0 = torch.randn(H, K, K, generator=g) * 0.3
    return q, k, v, logd, beta, s0


def _sl(xs, a, b):
    return [x[a:b] for x in xs]


def test_chunked_matches_recurrent_with_states_inside_chunks():
    T = 150
    q, k, v, g, beta, s0 = _inputs(T)
    emit = [0, 1, 17, 63, 64, 65, 100, 128, 149, 150]
    o1, s1, e1 = kda_recurrent(q, k, v, g, beta, s0, 0.35, emit)
    o2, s2, e2 = kda_chunked(q, k, v, g, beta, s0, 0.35, emit, chunk=64)
    assert (o1 - o2).abs().max() < 2e-6
    assert (s1 - s2).abs().max() < 2e-6
    assert sorted(e1) == sorted(e2) == emit
    for b in emit:
        assert (e1[b] - e2[b]).abs().max() < 2e-6, b
    assert torch.equal(e1[150], s1) and torch.equal(e1[0], s0)


def test_chunked_is_stable_under_strong_decay():
    """Cumulative decays of -1e3 over a chunk must not overflow (exponents are differences)."""
    q, k, v, g, beta, s0 = _inputs(96, decay=40.0)
    o1, s1, _ = kda_recurrent(q, k, v, g, beta, s0, 0.35)
    o2, s2, _ = kda_chunked(q, k, v, g, beta, s0, 0.35, chunk=64)
    assert torch.isfinite(o2).all() and torch.isfinite(s2).all()
    assert (o1 - o2).abs().max() < 2e-6 and (s1 - s2).abs().max() < 2e-6


def test_emitted_state_equals_state_of_the_prefix():
    q, k, v, g, beta, s0 = _inputs(80)
    _, _, em = kda_chunked(q, k, v, g, beta, s0, 0.35, [37], chunk=16)
    _, s_pref, _ = kda_chunked(*_sl((q, k, v, g, beta), 0, 37), s0, 0.35, chunk=16)
    assert (em[37] - s_pref).abs().max() < 1e-6


@settings(max_examples=25, deadline=None)
@given(
    T=st.integers(1, 140),
    cut=st.integers(0, 140),
    chunk=st.sampled_from([1, 5, 16, 64]),
    seed=st.integers(0, 1000),
)
def test_state_split_property(T, cut, chunk, seed):
    """Run [0:n), save the state, run [n:m) from it == run [0:m) (bitwise per token)."""
    n = min(cut, T)
    xs = _inputs(T, seed=seed)
    q, k, v, g, beta, s0 = xs
    o, s, _ = kda_recurrent(q, k, v, g, beta, s0, 0.35)
    oa, sa, _ = kda_recurrent(*_sl(xs[:5], 0, n), s0, 0.35)
    ob, sb, _ = kda_recurrent(*_sl(xs[:5], n, T), sa, 0.35)
    assert torch.equal(torch.cat([oa, ob]), o) and torch.equal(sb, s)
    co, cs, _ = kda_chunked(q, k, v, g, beta, s0, 0.35, chunk=chunk)
    ca, csa, _ = kda_chunked(*_sl(xs[:5], 0, n), s0, 0.35, chunk=chunk)
    cb, csb, _ = kda_chunked(*_sl(xs[:5], n, T), csa, 0.35, chunk=chunk)
    assert (torch.cat([ca, cb]) - co).abs().max() < 2e-6
    assert (csb - cs).abs().max() < 2e-6 and (cs - s).abs().max() < 2e-6


def test_short_conv_split_and_state_at():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(20, 6, generator=gen)
    w = torch.randn(6, 4, generator=gen)
    st0 = torch.randn(6, 3, generator=gen)
    y, hist = short_conv(x, w, st0)
    # Direct definition: y_t = silu(sum_j w[:, j] * input[t - 3 + j]).
    full = torch.cat([st0.T, x])
    ref = torch.stack([F.silu((full[t : t + 4].T * w).sum(-1)) for t in range(20)])
    assert (y - ref).abs().max() < 1e-6
    ya, ha = short_conv(x[:7], w, st0)
    yb, _ = short_conv(x[7:], w, conv_state_at(ha, 7, 4))
    # Equal up to float32 rounding: the split runs the same sums over shorter inputs, which
    # a CPU may vectorise differently (bit-equal on AVX-512 machines; 1.5e-8 apart on an
    # AVX2-only one, 2026-12-02), within one ulp at the output's scale. A wrong carried
    # state moves the outputs by O(1).
    one_ulp = torch.finfo(torch.float32).eps * y.abs().max()
    assert (torch.cat([ya, yb]) - y).abs().max() <= one_ulp
    assert torch.equal(conv_state_at(hist, 20, 4), x[-3:].T)
    assert torch.equal(conv_state_at(hist, 0, 4), st0)
