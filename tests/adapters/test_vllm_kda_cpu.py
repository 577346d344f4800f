"""The plug-in's CPU pieces for vLLM 0.32, without an engine: state-column gather, fused
Mamba copy kernels, the tolerant kernel rebinding, the plug-in registrations."""

from __future__ import annotations

import ctypes

import pytest

try:
    import hybridcache.adapters.vllm  # noqa: F401
except ImportError as exc:
    pytest.skip(f"vLLM adapter not importable: {exc}", allow_module_level=True)

import torch  # noqa: E402

from hybridcache.adapters.vllm import cpu_kernels, kda_cpu  # noqa: E402

pytestmark = pytest.mark.vllm


def test_aligned_state_indices_is_the_builders_torch_form():
    g = torch.Generator().manual_seed(0)
    table = torch.randint(1, 100, (6, 9), generator=g, dtype=torch.int32)
    seq_lens = torch.tensor([1, 16, 17, 64, 100, 129], dtype=torch.int32)
    got = kda_cpu.aligned_state_indices(table, seq_lens, 16, 3)
    # KimiK3KDAMetadataBuilder.build's comment: start = ((seq_lens - 1) // bs).clamp(0),
    # indices = start + arange(slots), gather; past the table: the null block.
    start = ((seq_lens.long() - 1) // 16).clamp(min=0)
    for r in range(6):
        for j in range(3):
            col = int(start[r]) + j
            want = int(table[r, col]) if col < 9 else 0
            assert int(got[r, j]) == want
    assert got.dtype == table.dtype


class _Layout:
    """Two states of one group as vLLM flattens them: a conv state (SD layout, width 5 =
    kernel 4 - 1 + 2 drafts, 6 channels) and a temporal state (2 x 3 x 3), 8 blocks."""

    def __init__(self, dim_first: bool = False) -> None:
        g = torch.Generator().manual_seed(1)
        self.conv = torch.randn(8, 6, 5, generator=g) if dim_first else torch.randn(8, 5, 6, generator=g)
        self.rec = torch.randn(8, 2, 3, 3, generator=g)
        self.table = torch.tensor([[3, 5, 6, 7, 0], [1, 2, 4, 0, 0]], dtype=torch.int32)
        self.dim_first = dim_first

    def args(self) -> tuple:
        conv, rec = self.conv, self.rec
        i64 = torch.int64
        inner = [conv.shape[2], rec[0].numel()] if not self.dim_first else [conv[0].numel(), rec[0].numel()]
        return (
            torch.tensor([self.table.data_ptr()], dtype=i64), self.table.stride(0),
            torch.tensor([conv.data_ptr(), rec.data_ptr()], dtype=i64),
            torch.tensor([conv.stride(0) * 4, rec.stride(0) * 4], dtype=i64),
            torch.tensor([4, 4], dtype=i64),
            torch.tensor(inner, dtype=i64),
            torch.tensor([5 if not self.dim_first else 5, 0], dtype=i64),
            torch.tensor([0, 0], dtype=i64),
            torch.tensor([6 if self.dim_first else 0, 0], dtype=i64),
            torch.tensor([conv.stride(1) * 4 if self.dim_first else 0, 0], dtype=i64),
        )


@pytest.mark.parametrize("dim_first", [False, True])
def test_precopy_moves_accepted_column_and_shifts_conv(dim_first):
    lay = _Layout(dim_first)
    conv0, rec0 = lay.conv.clone(), lay.rec.clone()
    # request 0: from column 1 (+ bias 1) into column 3; request 1: same column, no copy
    cpu_kernels.precopy_mamba_align_fused(
        torch.tensor([3, 1]), torch.tensor([1, 1]), torch.tensor([1, 0]), *lay.args(),
        None, 2, COPY_BLOCK_SIZE=1024, CONV_STATE_DIM_FIRST=dim_first, HAS_IDX_MAPPING=False)
    src, dst = 5, 7  # blocks of request 0's columns 1 and 3
    assert torch.equal(lay.rec[dst], rec0[6])  # temporal: column 1 + 1 = block 6
    if dim_first:  # conv: the window shifted by the bias
        assert torch.equal(lay.conv[dst][:, :4], conv0[src][:, 1:])
    else:
        assert torch.equal(lay.conv[dst][:4], conv0[src][1:])
    untouched = [b for b in range(8) if b != dst]
    assert torch.equal(lay.rec[untouched], rec0[untouched])


def test_postprocess_copies_the_accepted_boundary_state():
    lay = _Layout()
    rec0 = lay.rec.clone()
    bs = 16
    # request 0: computed 14, scheduled 4 (3 drafts), 3 accepted -> new computed 17:
    # boundary 16 passed; its state (input 2 of the step, column cur + 1) goes to column 0.
    # request 1: nothing crosses a boundary.
    out = torch.tensor([3, 1])
    cpu_kernels.postprocess_mamba_fused(
        torch.tensor([3, 1]), torch.tensor([1, 0]), torch.tensor([4, 1]), torch.tensor([14, 3]),
        torch.tensor([3, 0]), *lay.args(), out, None, 2,
        block_size=bs, COPY_BLOCK_SIZE=1024, CONV_STATE_DIM_FIRST=False)
    # running = 14 + 4 - 3 = 15, aligned 16, bias 1, dst column 0 = block 3,
    # src column mamba_state_idx 1 + bias 1 = column 2 = block 6
    assert torch.equal(lay.rec[3], rec0[6])
    others = [b for b in range(8) if b != 3]
    assert torch.equal(lay.rec[others], rec0[others])
    assert out.tolist() == [3, 1]


def test_tolerant_rebind_survives_unreadable_module_attributes(monkeypatch):
    import sys
    import types

    class Unreadable:
        @property
        def __dict__(self):  # like llvmlite's _lib_fn_wrapper: vars() has no .get
            return object()

    mod = types.ModuleType("hybridcache_test_unreadable")
    mod.bad = Unreadable()
    original, wrapper = object(), object()
    mod.kernel_ref = original
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    from vllm.triton_utils import dispatcher

    saved = cpu_kernels.vllm_rebind or dispatcher._rebind_kernels  # vLLM's own scan
    assert saved is not cpu_kernels.tolerant_rebind
    with pytest.raises(AttributeError):
        saved([(original, wrapper)])  # vLLM's own scan fails on it (the start-up bug)
    cpu_kernels.tolerant_rebind([(original, wrapper)])
    assert mod.kernel_ref is wrapper


def test_plugin_registers_kda_model():
    from vllm import ModelRegistry

    from hybridcache.adapters.vllm.kda_model import ARCHITECTURE

    kda_cpu.register_from_plugin()
    assert ARCHITECTURE in ModelRegistry.get_supported_archs()


def test_ctypes_reads_int32_block_ids():
    t = torch.tensor([[7, -1, 2**31 - 1]], dtype=torch.int32)
    assert ctypes.c_int32.from_address(t.data_ptr() + 8).value == 2**31 - 1


# --------------------------------------------------------------------------- spec columns
def _kda_layer(seed: int = 0):
    """The plug-in's KDA forward on a tiny random layer (2 heads of 4, conv width 4)."""
    from types import SimpleNamespace

    from hybridcache.adapters.vllm.kda_layer import KdaCpuForward

    g = torch.Generator().manual_seed(seed)
    heads, dim, width = 2, 4, 4

    class Layer(KdaCpuForward):
        local_num_heads, head_dim, local_projection_size = heads, dim, heads * dim
        conv_size, gate_lower_bound = width, -5.0
        conv1d = SimpleNamespace(weight=torch.randn(3 * heads * dim, 1, width, generator=g))
        A_log = torch.randn(heads, generator=g)
        dt_bias = torch.randn(heads * dim, generator=g)

    return Layer(), g


def _kda_inputs(layer, g, n: int):
    from hybridcache.adapters.vllm.kda_layer import _Inputs

    h, d = layer.local_num_heads, layer.head_dim
    return _Inputs(torch.randn(n, 3 * h * d, generator=g), torch.randn(n, h, d, generator=g),
                   torch.randn(n, h, generator=g))


def _cat(a, b):
    from hybridcache.adapters.vllm.kda_layer import _Inputs

    return _Inputs(*(torch.cat([x, y]) for x, y in zip((a.qkv, a.raw_g, a.raw_beta),
                                                        (b.qkv, b.raw_g, b.raw_beta))))


def _take(a, n: int):
    from hybridcache.adapters.vllm.kda_layer import _Inputs

    return _Inputs(a.qkv[:n], a.raw_g[:n], a.raw_beta[:n])


def _prefill(layer, caches, block: int, inputs) -> torch.Tensor:
    """Outputs of a prefill of ``inputs`` from ``block``'s state (vLLM's non-spec path)."""
    from types import SimpleNamespace

    n = inputs.qkv.shape[0]
    m = SimpleNamespace(non_spec_state_indices_tensor=torch.tensor([block]), num_prefills=1,
                        non_spec_query_start_loc=torch.tensor([0, n]),
                        has_initial_state=torch.tensor([True]))
    out = torch.zeros(n, layer.local_num_heads, layer.head_dim)
    layer._run_non_spec(m, inputs, torch.arange(n), out, caches)
    return out


def _copy_block(caches, src: int, dst: int) -> None:
    for c in caches:  # kv_cache_block_copies: the whole block of every state tensor
        c[dst] = c[src]


def _tail_after_spec_step_errors(layer, g) -> list[float]:
    """For each position ``t`` of a 4-token speculative step: run the step, copy its column
    ``t``'s blocks whole (what a sub-block tail does), prefill 3 more tokens from the copy;
    the largest difference from a prefill of the step's first ``t + 1`` tokens and the
    same 3 from the step's initial state."""
    width, spec, q = layer.conv_size, 3, 4
    blocks, c = 12, 3 * layer.local_projection_size
    conv = torch.randn(blocks, c, width - 1 + spec, generator=g)
    rec = torch.randn(blocks, layer.local_num_heads, layer.head_dim, layer.head_dim, generator=g)
    caches = (conv, rec)
    cols = [2, 3, 4, 5]
    _copy_block(caches, 2, 1)  # block 1: the step's initial state, kept
    x, y = _kda_inputs(layer, g, q), _kda_inputs(layer, g, 3)
    from types import SimpleNamespace

    m = SimpleNamespace(spec_state_indices_tensor=torch.tensor([cols]), num_spec_decodes=1,
                        spec_query_start_loc=torch.tensor([0, q]),
                        num_accepted_tokens=torch.tensor([1]))
    layer._run_spec(m, x, torch.arange(q), torch.zeros(q, layer.local_num_heads, layer.head_dim),
                    caches)
    errors = []
    for t in range(q):
        _copy_block(caches, cols[t], 9)
        got = _prefill(layer, caches, 9, y)
        _copy_block(caches, 1, 10)
        want = _prefill(layer, caches, 10, _cat(_take(x, t + 1), y))[t + 1 :]
        errors.append(float((got - want).abs().max()))
    return errors


def test_kda_spec_step_leaves_a_whole_state_in_every_column():
    """After a speculative step, every state column's blocks, copied whole, continue
    exactly as the step's accepted prefix would (the conv window is there too)."""
    layer, g = _kda_layer()
    errors = _tail_after_spec_step_errors(layer, g)
    assert max(errors) < 1e-5, errors


def test_mutation_kda_spec_step_without_column_windows_fails(monkeypatch):
    """Mutation: without ``spread_conv_windows`` only column 0 (the state after the first
    input) is whole; a copy of a later column starts from a stale conv window."""
    from hybridcache.adapters.vllm import kda_layer

    monkeypatch.setattr(kda_layer, "spread_conv_windows", lambda *a: None)
    layer, g = _kda_layer()
    errors = _tail_after_spec_step_errors(layer, g)
    assert errors[0] < 1e-5 and min(errors[1:]) > 1e-3, errors


def test_spread_conv_windows_writes_each_columns_window():
    width, cols = 4, [1, 2, 3]
    buf = torch.arange(2 * 3 * 5 * 6, dtype=torch.float32).reshape(5, 6, 6)[:, :2]  # [5, 2, 6]
    before = buf.clone()
    cpu_kernels.spread_conv_windows(buf, cols, width)
    assert torch.equal(buf[1], before[1])  # column cur: vLLM's own buffer, untouched
    for t in (1, 2):
        assert torch.equal(buf[cols[t], :, : width - 1], before[1, :, t : t + width - 1])
        assert torch.equal(buf[cols[t], :, width - 1 :], before[cols[t], :, width - 1 :])
    assert torch.equal(buf[0], before[0]) and torch.equal(buf[4], before[4])
