"""The plug-in's fix of vLLM 0.32's copy-on-write block copy (``adapters/vllm/copy_fix.py``).

The caches are laid out as vLLM's CPU runner lays them out for the tiny Qwen3-Next (read
from a running engine: one allocation per (GDN, attention) layer pair, the GDN view an
``int8`` ``(blocks, 1, 1, state_bytes)`` view and the attention view a ``bfloat16``
``(blocks, 2, block_size, 128)`` view, both starting at the same address, GDN first).
vLLM's own function is called, unpatched and patched.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
try:
    from hybridcache.adapters.vllm import copy_fix
except ImportError as exc:  # pragma: no cover - unsupported vLLM
    pytest.skip(f"vLLM adapter not importable: {exc}", allow_module_level=True)

from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy  # noqa: E402
from vllm.v1.worker import utils as worker_utils  # noqa: E402

NUM_BLOCKS = 6
TOKENS = 48  # tokens per block (vLLM's inflated block, scaled down)
HEAD = 128
PAGE = 2 * TOKENS * HEAD * 2  # bytes of one attention page (K and V, bf16)
STATE = PAGE - 3 * HEAD * 2  # the state page is a little smaller, as in vLLM


def _shared_layers(pairs: int = 2, gdn_first: bool = True) -> tuple[torch.Tensor, list]:
    """``pairs`` allocations, each viewed by a GDN layer and an attention layer."""
    raw = torch.randint(-128, 127, (pairs, NUM_BLOCKS, PAGE), dtype=torch.int8)
    views = []
    for p in range(pairs):
        page = raw[p]
        gdn = page[:, :STATE].view(NUM_BLOCKS, 1, 1, STATE)
        attn = page.view(torch.bfloat16).view(NUM_BLOCKS, 2, TOKENS, HEAD)
        views += [gdn, attn] if gdn_first else [attn, gdn]
    return raw, views


def _copy(fn, views, copies) -> None:
    fn(views, NUM_BLOCKS, [KVCacheBlockCopy(src, dst) for src, dst in copies])


def _unpatched():
    fn = worker_utils.copy_kv_cache_blocks_inplace
    return getattr(fn, "__wrapped__", fn)


@pytest.mark.parametrize("gdn_first", [True, False])
def test_patched_copy_moves_whole_pages(gdn_first):
    raw, views = _shared_layers(gdn_first=gdn_first)
    before = raw.clone()
    _copy(copy_fix.whole_page_copy(_unpatched()), views, [(1, 4), (2, 5)])
    for p in range(raw.shape[0]):
        assert torch.equal(raw[p, 4], before[p, 1]) and torch.equal(raw[p, 5], before[p, 2])
        for b in (0, 1, 2, 3):
            assert torch.equal(raw[p, b], before[p, b])


def test_vllm_copy_skips_the_page_tail_when_the_state_view_comes_first():
    """The bug itself, in vLLM's unpatched function (fails once vLLM fixes it upstream)."""
    raw, views = _shared_layers(gdn_first=True)
    before = raw.clone()
    _copy(_unpatched(), views, [(1, 4)])
    assert torch.equal(raw[0, 4, :STATE], before[0, 1, :STATE])
    assert not torch.equal(raw[0, 4, STATE:], before[0, 1, STATE:])  # stale V tail


def test_widest_first_keeps_every_view_and_distinct_addresses():
    _, views = _shared_layers(pairs=2, gdn_first=True)
    out = copy_fix.widest_first(views)
    assert [v.data_ptr() for v in out[::3]] == [views[0].data_ptr(), views[2].data_ptr()]
    assert out[0] is views[1] and out[3] is views[3]  # the attention views lead
    assert copy_fix.block_span_bytes(views[1]) == PAGE
    assert copy_fix.block_span_bytes(views[0]) == STATE


def test_install_patches_vllm_and_is_idempotent(monkeypatch):
    monkeypatch.setattr(worker_utils, "copy_kv_cache_blocks_inplace", _unpatched())
    assert copy_fix.install() and copy_fix.install()
    fn = worker_utils.copy_kv_cache_blocks_inplace
    assert getattr(fn, "_hybridcache_whole_page", False) and fn.__wrapped__ is _unpatched()
    raw, views = _shared_layers()
    before = raw.clone()
    _copy(fn, views, [(0, 3)])
    assert torch.equal(raw[:, 3], before[:, 0])


def test_install_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(worker_utils, "copy_kv_cache_blocks_inplace", _unpatched())
    monkeypatch.setenv(copy_fix.COPY_FIX_ENV, "0")
    assert not copy_fix.install()
    assert worker_utils.copy_kv_cache_blocks_inplace is _unpatched()


def test_vllm_plugin_loader_installs_the_fix_before_and_after_runner_import():
    """Through vLLM's own ``load_general_plugins`` (our entry point), in a fresh process:
    the runner module binds the patched function whether it was imported before or after."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "early = sys.argv[1] == 'early'\n"
        "if early:\n"
        "    import vllm.v1.worker.gpu_model_runner\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "import vllm.v1.worker.gpu_model_runner as g, vllm.v1.worker.utils as u\n"
        "print('FIXED', getattr(g.copy_kv_cache_blocks_inplace, '_hybridcache_whole_page', False),"
        " u.copy_kv_cache_blocks_inplace is g.copy_kv_cache_blocks_inplace)\n"
    )
    for order in ("early", "late"):
        r = subprocess.run([sys.executable, "-c", code, order], capture_output=True, text=True,
                           timeout=300)
        assert "FIXED True True" in r.stdout, (order, r.stdout[-2000:], r.stderr[-3000:])
