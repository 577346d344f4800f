"""A torch forward for vLLM's KDA layer (``KimiK3DeltaAttention``) on the CPU build.

vLLM 0.32's KDA layer runs only Triton / CUDA kernels (chunked KDA prefill, fused
recurrent decode, causal conv1d), none of which the CPU build can launch. The layer is a
``PluggableLayer``, so an out-of-tree class registered with ``register_oot`` is
instantiated in its place; this module's class keeps everything of vLLM's layer (weights,
projections, state shapes from ``MambaStateShapeCalculator.kda_state_shape``, the KV cache
spec, the output norm) and replaces only ``_forward``, the part that reads and writes the
state cache.

What the kernels compute, and so what this forward computes (per request, fp32):

* **short conv** on the packed q|k|v channels (kernel ``W``, no bias, SiLU). The conv
  state block holds ``W - 1 + num_spec`` input columns per channel (oldest first):
  prefill (``causal_conv1d_fn``) reads and writes columns ``[0, W-1)``; a plain decode
  (``causal_conv1d_update``) reads ``[0, W-1)`` and shifts all columns by one; a
  speculative step reads ``[a-1, a-1+W-1)`` (``a`` = accepted tokens of the last step)
  and writes the shifted history followed by the step's inputs from column 0; the window
  after its ``t + 1``-th input is also written into ``[0, W-1)`` of the step's column
  ``t`` (:func:`.cpu_kernels.spread_conv_windows`), so that every column's block is a
  whole state a sub-block tail can copy (vLLM itself never reads those columns' conv).
* **KDA recurrence** (:func:`hybridcache.adapters.reference.kda.kda_recurrent_kernel_form`,
  the math shared with the reference model): gate from ``A_log``, ``dt_bias`` and the
  lower bound, sigmoid beta, in-kernel l2 norm, scale ``K ** -0.5``. The recurrent state
  block is ``[H, V, K]`` (the kernels index ``v * K + k``), stored in the cache dtype
  (fp32 by default). Prefill and plain decode read and write the request's block
  (``state_indices[:, 0]``; a request without initial state starts from zeros); a
  speculative step reads column ``a - 1`` and writes the state after its ``t``-th token
  into column ``t`` (block 0, the null block, is never written).

The per-token recurrence is used for prefill too (vLLM's chunked kernel is the same math
up to fp32 rounding, ~1e-6): running ``[0, n)`` then ``[n, m)`` equals running
``[0, m)`` bit for bit, which is what lets a restored snapshot be compared exactly with a
no-cache run's state. It is slow per token and meant for tiny CPU models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridcache.adapters.reference.kda import kda_gate, kda_recurrent_kernel_form

from .cpu_kernels import spread_conv_windows

NULL_BLOCK = 0


@dataclass
class _Inputs:
    """One layer call's projected inputs (rows are tokens of the scheduled batch)."""

    qkv: torch.Tensor  # [N, 3P] before the conv
    raw_g: torch.Tensor  # [N, H, D]
    raw_beta: torch.Tensor  # [N, H]


def _conv(x: torch.Tensor, hist: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv + SiLU of ``x`` [L, C] after history ``hist`` [C, W-1], fp32."""
    full = torch.cat([hist.float(), x.float().transpose(0, 1)], dim=1)
    windows = full.unfold(1, weight.shape[1], 1)  # [C, L, W]
    return F.silu((windows * weight.float()[:, None, :]).sum(-1)).transpose(0, 1)


class KdaCpuForward:
    """The state-cache half of the KDA layer in torch (mixed into the OOT layer class)."""

    # Attributes provided by vLLM's layer.
    kv_cache: tuple[torch.Tensor, ...]
    prefix: str
    local_num_heads: int
    head_dim: int
    local_projection_size: int
    conv_size: int
    gate_lower_bound: float | None

    def _kda_torch_forward(self, m, inputs: _Inputs, out: torch.Tensor) -> None:
        """Fill ``out`` [N, H, D] for every scheduled token and update the state cache."""
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

        conv_state, rec_state = self.kv_cache[0], self.kv_cache[1]
        if not is_conv_state_dim_first():
            conv_state = conv_state.transpose(-1, -2)  # [blocks, C, S]
        caches = (conv_state, rec_state)
        n = m.num_actual_tokens
        spec_rows, ns_rows = self._token_rows(m, n)
        if spec_rows is not None:
            self._run_spec(m, inputs, spec_rows, out, caches)
        if ns_rows is not None:
            self._run_non_spec(m, inputs, ns_rows, out, caches)

    @staticmethod
    def _token_rows(m, n: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Token rows of the speculative and the other requests, in request order."""
        all_rows = torch.arange(n)
        if m.num_spec_decodes == 0:
            return None, all_rows
        if m.num_prefills == 0 and m.num_decodes == 0:
            return all_rows, None
        if m.spec_token_start is not None:
            spec = torch.arange(m.spec_token_start, m.spec_token_start + m.num_spec_decode_tokens)
            n_ns = m.num_prefill_tokens + m.num_decode_tokens
            ns = torch.arange(m.non_spec_token_start, m.non_spec_token_start + n_ns)
            return spec, ns
        return m.spec_token_indx.cpu(), m.non_spec_token_indx.cpu()

    def _split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        shape = (y.shape[0], self.local_num_heads, self.head_dim)
        return tuple(t.reshape(shape) for t in y.split(self.local_projection_size, dim=-1))

    def _conv_weight(self) -> torch.Tensor:
        w = self.conv1d.weight  # type: ignore[attr-defined]
        return w.view(w.size(0), w.size(2))

    def _recur(
        self, y: torch.Tensor, raw_g: torch.Tensor, raw_beta: torch.Tensor,
        state_vk: torch.Tensor, emit: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """KDA over one request's conv outputs ``y``; states in the cache's ``[H, V, K]``."""
        q, k, v = self._split(y)  # in the model dtype, as the conv kernels store them
        g = kda_gate(raw_g, self.A_log, self.dt_bias, self.gate_lower_bound)  # type: ignore[attr-defined]
        beta = torch.sigmoid(raw_beta.float())
        o, final, states = kda_recurrent_kernel_form(
            q, k, v, g, beta, state_vk.float().transpose(-1, -2), emit
        )
        return o, final.transpose(-1, -2), {b: s.transpose(-1, -2) for b, s in states.items()}

    def _run_non_spec(self, m, inputs: _Inputs, rows: torch.Tensor, out, caches) -> None:
        conv_state, rec_state = caches
        W = self.conv_size
        weight = self._conv_weight()
        indices = m.non_spec_state_indices_tensor.cpu().tolist()
        prefill = m.num_prefills > 0
        if m.non_spec_query_start_loc is not None:
            qsl = m.non_spec_query_start_loc.cpu().tolist()
        else:  # packed decode: one token per request
            qsl = list(range(len(rows) + 1))
        has_init = m.has_initial_state.cpu().tolist() if prefill else None
        for i in range(len(qsl) - 1):
            r = rows[qsl[i] : qsl[i + 1]]
            idx = int(indices[i])
            if len(r) == 0 or idx <= NULL_BLOCK:
                continue
            init = bool(has_init[i]) if has_init is not None else True
            x = inputs.qkv[r]
            cs = conv_state[idx]
            hist = cs[:, : W - 1] if init else torch.zeros_like(cs[:, : W - 1])
            y = _conv(x, hist, weight).to(x.dtype)
            s0 = rec_state[idx] if init else torch.zeros_like(rec_state[idx])
            o, final, _ = self._recur(y, inputs.raw_g[r], inputs.raw_beta[r], s0, [])
            out[r] = o.to(out.dtype)
            rec_state[idx] = final.to(rec_state.dtype)
            full = torch.cat([hist, x.transpose(0, 1).to(cs.dtype)], dim=1)
            if prefill:  # causal_conv1d_fn keeps the last W-1 inputs in [0, W-1)
                cs[:, : W - 1] = full[:, -(W - 1) :]
            else:  # causal_conv1d_update shifts every column by the new tokens
                cs.copy_(torch.cat([cs, x.transpose(0, 1).to(cs.dtype)], dim=1)[:, -cs.shape[1] :])

    def _run_spec(self, m, inputs: _Inputs, rows: torch.Tensor, out, caches) -> None:
        conv_state, rec_state = caches
        W = self.conv_size
        weight = self._conv_weight()
        table = m.spec_state_indices_tensor.cpu().tolist()
        qsl = m.spec_query_start_loc.cpu().tolist()
        accepted = m.num_accepted_tokens.cpu().tolist()
        for i in range(m.num_spec_decodes):
            r = rows[qsl[i] : qsl[i + 1]]
            cols = [int(c) for c in table[i]]
            if len(r) == 0:
                continue
            off = int(accepted[i]) - 1
            x = inputs.qkv[r]
            cs = conv_state[cols[0]]
            if cols[0] > NULL_BLOCK:
                hist = cs[:, off : off + W - 1].clone()
                y = _conv(x, hist, weight).to(x.dtype)
                stored = torch.cat([hist[:, 1:], x.transpose(0, 1).to(cs.dtype)], dim=1)
                cs[:, : stored.shape[1]] = stored
                spread_conv_windows(conv_state, cols[: len(r)], W)
            src = cols[off]
            if src <= NULL_BLOCK or cols[0] <= NULL_BLOCK:
                out[r] = 0
                continue
            emit = list(range(1, len(r) + 1))
            o, _, states = self._recur(y, inputs.raw_g[r], inputs.raw_beta[r], rec_state[src], emit)
            out[r] = o.to(out.dtype)
            for t in range(len(r)):
                if cols[t] > NULL_BLOCK:
                    rec_state[cols[t]] = states[t + 1].to(rec_state.dtype)


def make_cpu_kda_class():
    """``KimiK3DeltaAttention`` with :class:`KdaCpuForward` as its state-cache forward.

    Built on demand: importing vLLM's model module is what the plug-in defers.
    """
    from vllm.forward_context import get_forward_context
    from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention

    class CpuKimiK3DeltaAttention(KdaCpuForward, KimiK3DeltaAttention):
        """vLLM's KDA layer whose state-cache part runs in torch (module docstring)."""

        def _forward(self, mixed_qkv, g1, g2, beta, core_attn_out) -> None:  # type: ignore[override]
            md = get_forward_context().attn_metadata
            if md is None or md.get(self.prefix) is None:
                return
            m = md[self.prefix]
            n = m.num_actual_tokens
            inputs = _Inputs(mixed_qkv[:n], g1[0, :n], beta[0, :n])
            out = torch.zeros(
                (n, self.local_num_heads, self.head_dim), dtype=core_attn_out.dtype
            )
            self._kda_torch_forward(m, inputs, out)
            core_attn_out.zero_()
            core_attn_out[0, :n] = out
            core_attn_out.copy_(self.o_norm(core_attn_out, g2))

    return CpuKimiK3DeltaAttention
