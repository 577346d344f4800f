"""The reference hybrid decoder: embedding, KDA and full-attention layers, SwiGLU MLP, LM head.

fp32 throughout, random weights from a seed, nothing downloaded. The model never owns cache
memory: every forward call gets a :class:`CacheContext` that says where the KDA state
comes from and goes to, and where the attention KV lives. :class:`PagedContext` reads and
writes the arena through the block table and slots the manager handed out (the path under
test); :class:`DenseContext` keeps everything in ordinary tensors (the tests' reference).

Attention uses no positional encoding (as the MLA layers of Kimi Linear): the KDA layers
carry position, which keeps the cached KV independent of where a prefix is reused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from hybridcache.kernels.storage import ArenaStorage

from .config import ATTENTION, ATTN_GROUP, KDA_GROUP, ReferenceConfig
from .kda import conv_state_at, kda_chunked, kda_recurrent, short_conv

KDA_MODES = ("chunked", "recurrent")


class CacheContext(Protocol):
    """Where one forward step reads and writes its cache (see module docstring)."""

    def load_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(conv [C, W-1], recurrent [H, K, V])`` of KDA layer ``layer`` before the step."""
        ...

    def emit_boundaries(self) -> list[int]:
        """Step-local boundaries (in ``[1, T]``) whose states must be stored."""
        ...

    def store_state(
        self,
        layer: int,
        states: dict[int, tuple[torch.Tensor, torch.Tensor]],
        final: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Store the emitted states (by local boundary) and the state after the step."""
        ...

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the step's K and V (``[T, Hkv, D]``) of attention layer ``layer``."""
        ...

    def read_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every token up to the end of the step (``[start + T, Hkv, D]``)."""
        ...


def _rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class ReferenceModel:
    """Random-weight hybrid decoder (see module docstring).

    Args:
        cfg: shapes and weight seed.
        kda_mode: ``chunked`` (chunks of ``cfg.kda_chunk``) or ``recurrent`` (per token).
    """

    def __init__(self, cfg: ReferenceConfig, kda_mode: str = "chunked") -> None:
        if kda_mode not in KDA_MODES:
            raise ValueError(f"kda_mode must be one of {KDA_MODES}, got {kda_mode!r}")
        self.cfg = cfg
        self.kda_mode = kda_mode
        gen = torch.Generator().manual_seed(cfg.seed)
        d = cfg.hidden_size

        def w(*shape: int, scale: float | None = None) -> torch.Tensor:
            s = scale if scale is not None else shape[0] ** -0.5
            return torch.randn(*shape, generator=gen) * s

        self.embed = w(cfg.vocab_size, d, scale=1.0)
        self.lm_head = w(d, cfg.vocab_size)
        self.layers: list[dict[str, torch.Tensor]] = []
        for kind in cfg.layer_pattern:
            p: dict[str, torch.Tensor] = {}
            if kind == ATTENTION:
                hd = cfg.attn_head_dim
                p["wq"] = w(d, cfg.attn_heads * hd)
                p["wk"] = w(d, cfg.attn_kv_heads * hd)
                p["wv"] = w(d, cfg.attn_kv_heads * hd)
                p["wo"] = w(cfg.attn_heads * hd, d)
            else:
                c = cfg.kda_width
                p["wqkv"] = w(d, 3 * c)
                p["conv"] = w(3 * c, cfg.conv_kernel, scale=0.5)
                p["wg"] = w(d, c)
                # Bias -2.5: softplus ~0.08, so typical decays keep ~90% per token and a
                # few channels (large projections) decay fast, as trained models do.
                p["bg"] = torch.full((c,), -2.5)
                p["wbeta"] = w(d, cfg.kda_heads)
                p["wo"] = w(c, d)
            p["w_gate"] = w(d, cfg.mlp_hidden)
            p["w_up"] = w(d, cfg.mlp_hidden)
            p["w_down"] = w(cfg.mlp_hidden, d)
            self.layers.append(p)

    # ------------------------------------------------------------------ forward
    def forward(
        self, tokens: Sequence[int] | torch.Tensor, start: int, ctx: CacheContext
    ) -> torch.Tensor:
        """Logits ``[T, vocab]`` of ``tokens`` at positions ``[start, start + T)``.

        Every KDA layer reads its state from ``ctx`` and stores its new state and the
        states at ``ctx.emit_boundaries()``; every attention layer appends its K/V to
        ``ctx`` and attends over all of them.
        """
        ids = torch.as_tensor(tokens, dtype=torch.long)
        h = self.embed[ids]
        for i, p in enumerate(self.layers):
            _, idx = self.cfg.group_layer(i)
            x = _rms(h)
            if self.cfg.layer_pattern[i] == ATTENTION:
                h = h + self._attention(x, p, idx, start, ctx)
            else:
                h = h + self._kda(x, p, idx, ctx)
            x = _rms(h)
            h = h + (F.silu(x @ p["w_gate"]) * (x @ p["w_up"])) @ p["w_down"]
        return _rms(h) @ self.lm_head

    def _kda(
        self, x: torch.Tensor, p: dict[str, torch.Tensor], idx: int, ctx: CacheContext
    ) -> torch.Tensor:
        cfg = self.cfg
        T, H, D = x.shape[0], cfg.kda_heads, cfg.kda_head_dim
        conv0, s0 = ctx.load_state(idx)
        y, hist = short_conv(x @ p["wqkv"], p["conv"], conv0)
        q, k, v = (t.reshape(T, H, D) for t in y.split(cfg.kda_width, dim=1))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        g = -F.softplus(x @ p["wg"] + p["bg"]).reshape(T, H, D)
        beta = torch.sigmoid(x @ p["wbeta"])
        emit = ctx.emit_boundaries()
        if self.kda_mode == "chunked":
            o, s, states = kda_chunked(q, k, v, g, beta, s0, D**-0.5, emit, cfg.kda_chunk)
        else:
            o, s, states = kda_recurrent(q, k, v, g, beta, s0, D**-0.5, emit)
        w = cfg.conv_kernel
        ctx.store_state(
            idx,
            {b: (conv_state_at(hist, b, w), st) for b, st in states.items()},
            (conv_state_at(hist, T, w), s),
        )
        return o.reshape(T, H * D) @ p["wo"]

    def _attention(
        self, x: torch.Tensor, p: dict[str, torch.Tensor], idx: int, start: int, ctx: CacheContext
    ) -> torch.Tensor:
        cfg = self.cfg
        T, hd = x.shape[0], cfg.attn_head_dim
        q = (x @ p["wq"]).reshape(T, cfg.attn_heads, hd)
        ctx.write_kv(
            idx,
            (x @ p["wk"]).reshape(T, cfg.attn_kv_heads, hd),
            (x @ p["wv"]).reshape(T, cfg.attn_kv_heads, hd),
        )
        keys, values = ctx.read_kv(idx)
        rep = cfg.attn_heads // cfg.attn_kv_heads
        keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        scores = torch.einsum("thd,lhd->htl", q, keys) * hd**-0.5
        pos = torch.arange(start, start + T)[:, None]
        mask = torch.arange(keys.shape[0])[None, :] > pos
        probs = scores.masked_fill(mask[None], float("-inf")).softmax(-1)
        return torch.einsum("htl,lhd->thd", probs, values).reshape(T, -1) @ p["wo"]

    # ------------------------------------------------------------------ helpers
    def dense_context(self) -> DenseContext:
        """A fresh :class:`DenseContext` (zero state, no KV) for this model."""
        return DenseContext(self.cfg)

    def logits_full(self, tokens: Sequence[int]) -> torch.Tensor:
        """Logits of a whole sequence from scratch in one step, no paging (test reference)."""
        return self.forward(tokens, 0, self.dense_context())


class DenseContext:
    """Cache in plain tensors: state per KDA layer, KV per attention layer, grown each step.

    Call :meth:`begin` before each forward with the step's length (and, optionally, local
    boundaries whose states should be captured into :attr:`captured`).
    """

    def __init__(self, cfg: ReferenceConfig) -> None:
        c = 3 * cfg.kda_width
        self.conv = [torch.zeros(c, cfg.conv_kernel - 1) for _ in range(cfg.num_kda_layers)]
        self.state = [
            torch.zeros(cfg.kda_heads, cfg.kda_head_dim, cfg.kda_head_dim)
            for _ in range(cfg.num_kda_layers)
        ]
        shape = (0, cfg.attn_kv_heads, cfg.attn_head_dim)
        self.k = [torch.zeros(shape) for _ in range(cfg.num_attention_layers)]
        self.v = [torch.zeros(shape) for _ in range(cfg.num_attention_layers)]
        self.emit: list[int] = []
        self.captured: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def begin(self, emit: Sequence[int] = ()) -> DenseContext:
        self.emit = list(emit)
        return self

    def load_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv[layer], self.state[layer]

    def emit_boundaries(self) -> list[int]:
        return self.emit

    def store_state(self, layer, states, final):
        for b, st in states.items():
            self.captured[(layer, b)] = (st[0].clone(), st[1].clone())
        self.conv[layer], self.state[layer] = final[0].clone(), final[1].clone()

    def write_kv(self, layer, k, v):
        self.k[layer] = torch.cat([self.k[layer], k])
        self.v[layer] = torch.cat([self.v[layer], v])

    def read_kv(self, layer):
        return self.k[layer], self.v[layer]


class PagedContext:
    """Cache in the arena: state from/to slots, KV in pages through a block table.

    Args:
        storage: the arena's tensors.
        start: first position of the step; num_tokens: tokens in the step.
        pages: the request's pages of the attention group (page ``i`` = tokens
            ``[i*U, (i+1)*U)``), from ``Allocation.block_table``.
        running_slot: the request's running state slot (read before, written after).
        emit: absolute boundary -> slots that receive the state after that token (save
            points and speculative draft slots).
    """

    def __init__(
        self,
        storage: ArenaStorage,
        start: int,
        num_tokens: int,
        pages: Sequence[int],
        running_slot: int,
        emit: dict[int, list[int]],
    ) -> None:
        self.storage = storage
        self.start = start
        self.num_tokens = num_tokens
        self.pages = torch.as_tensor(list(pages), dtype=torch.long)
        self.slot = running_slot
        self.emit = emit
        for b in emit:
            if not start < b <= start + num_tokens:
                raise ValueError(f"boundary {b} outside the step ({start}, {start + num_tokens}]")

    def load_state(self, layer):
        st = self.storage
        return (
            st.state_slot(KDA_GROUP, layer, "conv", self.slot).clone(),
            st.state_slot(KDA_GROUP, layer, "recurrent", self.slot).clone(),
        )

    def emit_boundaries(self):
        return sorted(b - self.start for b in self.emit)

    def _put(self, layer: int, slot: int, conv: torch.Tensor, rec: torch.Tensor) -> None:
        self.storage.state_slot(KDA_GROUP, layer, "conv", slot).copy_(conv)
        self.storage.state_slot(KDA_GROUP, layer, "recurrent", slot).copy_(rec)

    def store_state(self, layer, states, final):
        for b, slots in self.emit.items():
            conv, rec = states[b - self.start]
            for s in slots:
                self._put(layer, s, conv, rec)
        self._put(layer, self.slot, *final)

    def write_kv(self, layer, k, v):
        view = self.storage.kv_view(ATTN_GROUP, layer)
        unit = self.storage.unit
        pos = torch.arange(self.start, self.start + k.shape[0])
        page = self.pages[pos // unit]
        off = pos % unit
        view[page, 0, off] = k
        view[page, 1, off] = v

    def read_kv(self, layer):
        view = self.storage.kv_view(ATTN_GROUP, layer)
        end = self.start + self.num_tokens
        unit = self.storage.unit
        n_pages = -(-end // unit)
        kv = view[self.pages[:n_pages]]  # [P, 2, U, Hkv, D] (a gather: a copy)
        flat = kv.transpose(0, 1).reshape(2, n_pages * unit, *kv.shape[3:])
        return flat[0, :end], flat[1, :end]
