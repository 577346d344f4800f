"""Kimi Delta Attention (KDA) math: short conv, per-token recurrence, exact chunked form.

Per head, with the state ``S`` of shape ``(K, V)`` (DESIGN.md section 1)::

    S' = Diag(exp(g_t)) S_{t-1}
    S_t = S' + beta_t k_t (v_t - S'^T k_t)^T
    o_t = scale * S_t^T q_t

``g_t`` is a per-key-channel log decay (<= 0), ``beta_t`` a sigmoid gate, q and k are
l2-normalised. The functions here work on one sequence, all heads at once, and every one of
them can emit the state at arbitrary *boundaries* inside the tokens it processes (boundary
``b`` = the state after the first ``b`` tokens), because the prefix cache asks for
snapshots at hash-unit boundaries that fall inside a prefill chunk or a speculative step.

Chunked form (WY / UT representation, as in fla's chunked delta-rule kernels). Inside a
chunk starting from state ``S0``, with ``G_t`` the running sum of ``g`` and pseudo-values
``u_t = beta_t (v_t - S'_t^T k_t)``, unrolling the recurrence gives::

    S_t  = exp(G_t) * S0 + sum_{i<=t} (exp(G_t - G_i) * k_i) u_i^T
    u_t + beta_t sum_{i<t} A_ti u_i = beta_t (v_t - S0^T (exp(G_t) * k_t))
    A_ti = sum_c k_t[c] k_i[c] exp(G_t[c] - G_i[c])
    o_t  = scale * (S0^T (exp(G_t) * q_t) + sum_{i<=t} B_ti u_i),  B_ti likewise with q_t

so all pseudo-values of a chunk come from one unit-lower-triangular solve. Every exponent is
a difference ``G_t - G_i`` with ``i <= t``, hence <= 0: nothing overflows however strong the
decay (the ``(C, C, K)`` decay tensor is what fla's secondary chunking avoids on GPU; at
reference sizes it is small). The running sums are kept in float64 so that the difference
of two large sums keeps the small decay between nearby tokens exact. The state at any boundary inside the chunk is the first line
evaluated at that ``t``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def short_conv(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU over time.

    Args:
        x: ``[T, C]`` inputs.
        weight: ``[C, W]`` taps; ``weight[:, -1]`` multiplies the current input.
        state: ``[C, W - 1]`` the previous ``W - 1`` inputs per channel, oldest first.

    Returns:
        ``(y, history)``: ``y`` is ``[T, C]``; ``history`` is ``[C, W - 1 + T]`` (state then
        inputs), from which :func:`conv_state_at` reads the state at any boundary.
    """
    hist = torch.cat([state, x.transpose(0, 1)], dim=1)
    windows = hist.unfold(1, weight.shape[1], 1)  # [C, T, W]
    y = (windows * weight[:, None, :]).sum(-1).transpose(0, 1)
    return F.silu(y), hist


def conv_state_at(history: torch.Tensor, boundary: int, width: int) -> torch.Tensor:
    """Conv state after ``boundary`` tokens: the last ``width - 1`` inputs before it."""
    return history[:, boundary : boundary + width - 1]


def _check_emit(emit: Sequence[int], n: int) -> list[int]:
    out = sorted(set(int(b) for b in emit))
    if out and (out[0] < 0 or out[-1] > n):
        raise ValueError(f"emit boundaries must lie in [0, {n}], got {out}")
    return out


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float,
    emit: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """Token-by-token KDA: the reference the chunked form is tested against.

    Args:
        q, k, g: ``[T, H, K]``; v: ``[T, H, V]``; beta: ``[T, H]``; state: ``[H, K, V]``.
        scale: output scale (``K ** -0.5``).
        emit: boundaries in ``[0, T]`` whose states are returned.

    Returns:
        ``(o [T, H, V], final state, {boundary: state})``. The same per-token operations run
        whatever the split, so running ``[0:n)`` then ``[n:m)`` from the state at ``n`` is
        bit-identical to running ``[0:m)``.
    """
    want = _check_emit(emit, q.shape[0])
    s = state.clone()
    out: dict[int, torch.Tensor] = {}
    if 0 in want:
        out[0] = s.clone()
    outs = []
    decay = g.exp()
    for t in range(q.shape[0]):
        s = decay[t][:, :, None] * s
        pred = torch.einsum("hk,hkv->hv", k[t], s)
        u = beta[t][:, None] * (v[t] - pred)
        s = s + k[t][:, :, None] * u[:, None, :]
        outs.append(scale * torch.einsum("hkv,hk->hv", s, q[t]))
        if t + 1 in want:
            out[t + 1] = s.clone()
    o = torch.stack(outs) if outs else v.new_zeros(v.shape)
    return o, s, out


def _chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    s0: torch.Tensor,
    scale: float,
    emit: list[int],
) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """One chunk in head-major layout (q, k, g: ``[H, n, K]``; v: ``[H, n, V]``; beta ``[H, n]``)."""
    n = q.shape[1]
    # Running sums in float64: G_t - G_i of two large fp32 sums loses the small difference
    # (|G| ~ 1e3 has an fp32 ulp of 1e-4, the error of exp(G_t - G_i) for adjacent tokens).
    G = torch.cumsum(g.double(), dim=1)
    incl = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    diff = (G[:, :, None, :] - G[:, None, :, :]).masked_fill(~incl[None, :, :, None], float("-inf"))
    E = diff.exp().to(q.dtype)  # [H, t, i, K]: exp(G_t - G_i) for i <= t, else 0
    kE = E * k[:, None, :, :]  # decayed keys seen from row t
    A = torch.einsum("htk,htik->hti", k, kE).tril(-1)
    eye = torch.eye(n, dtype=q.dtype, device=q.device)
    lower = eye + beta[:, :, None] * A
    eg = G.exp().to(q.dtype)
    rhs = beta[:, :, None] * (v - torch.matmul(eg * k, s0))
    u = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    B = torch.einsum("htk,htik->hti", q, kE)
    o = scale * (torch.matmul(eg * q, s0) + torch.matmul(B, u))
    states: dict[int, torch.Tensor] = {}
    for b in emit:
        states[b] = _state_at(b, s0, eg, kE, u)
    final = states[n] if n in states else _state_at(n, s0, eg, kE, u)
    return o, final, states


def _state_at(
    b: int, s0: torch.Tensor, eg: torch.Tensor, kE: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """State after the first ``b`` tokens of a chunk (``b = 0``: the chunk's initial state)."""
    if b == 0:
        return s0.clone()
    t = b - 1
    return eg[:, t, :, None] * s0 + torch.einsum("hik,hiv->hkv", kE[:, t, :b], u[:, :b])


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float,
    emit: Sequence[int] = (),
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """Chunked KDA (chunks of ``chunk`` tokens from the first token); same contract as
    :func:`kda_recurrent`, equal to it within ~1e-6 in fp32."""
    T = q.shape[0]
    want = _check_emit(emit, T)
    hm = [x.transpose(0, 1) for x in (q, k, v, g)]  # head-major [H, T, *]
    bm = beta.transpose(0, 1)
    s = state
    outs = []
    out: dict[int, torch.Tensor] = {0: state.clone()} if 0 in want else {}
    for c0 in range(0, T, chunk):
        c1 = min(c0 + chunk, T)
        local = [b - c0 for b in want if c0 < b <= c1]
        o, s, st = _chunk(*(x[:, c0:c1] for x in hm), bm[:, c0:c1], s, scale, local)
        outs.append(o)
        for b, val in st.items():
            out[b + c0] = val
    o_all = torch.cat(outs, dim=1).transpose(0, 1) if outs else v.new_zeros(v.shape)
    return o_all, (s if T else state.clone()), out


# --------------------------------------------------------------------------- vLLM's KDA
# The functions below are the gate, normalisation and per-token update exactly as vLLM's
# Triton KDA kernels compute them (``vllm/models/kimi_k3/nvidia/ops/third_party/kda``:
# ``_kda_gate_beta_fwd_kernel``, ``fused_recurrent_kda_fwd_kernel``), so that the CPU
# forward of :mod:`hybridcache.adapters.vllm.kda_layer` and the reference model share one
# implementation of the recurrence.


def kda_gate(
    raw_g: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
) -> torch.Tensor:
    """Per-key-channel log decay from the projection's raw gate, in fp32.

    ``raw_g`` is ``[T, H, K]``, ``a_log`` ``[H]``, ``dt_bias`` ``[H * K]``. With a lower
    bound (Kimi K3's "safe gate"): ``lower_bound * sigmoid(exp(A_log) * (g + bias))``;
    without: ``-exp(A_log) * softplus(g + bias)`` (softplus linear above 20, as the kernel).
    """
    g = raw_g.float()
    if dt_bias is not None:
        g = g + dt_bias.float().view(g.shape[-2], g.shape[-1])
    a = a_log.float().exp()[:, None]
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * g)
    soft = torch.where(g > 20.0, g, torch.log1p(torch.exp(torch.clamp(g, max=20.0))))
    return -a * soft


def l2_normalize_kernel(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last axis (the kernels' in-kernel l2norm)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def kda_recurrent_kernel_form(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    emit: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """vLLM's per-token KDA on one sequence, fp32, state ``[H, K, V]``.

    Args:
        q, k: ``[T, H, K]`` raw (after the short conv); normalised here as in the kernel.
        v: ``[T, H, V]``; g: ``[T, H, K]`` log decay (:func:`kda_gate`); beta: ``[T, H]``
            after the sigmoid; state: ``[H, K, V]``.
        emit: boundaries whose states are returned (speculative steps keep one per token).

    The scale ``K ** -0.5`` is applied to the normalised query before the read-out, as in
    the kernel; the recurrence itself is :func:`kda_recurrent`'s.
    """
    qn = l2_normalize_kernel(q.float()) * (q.shape[-1] ** -0.5)
    kn = l2_normalize_kernel(k.float())
    return kda_recurrent(qn, kn, v.float(), g.float(), beta.float(), state.float(), 1.0, emit)
