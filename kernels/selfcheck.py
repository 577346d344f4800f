"""Self-check: every kernel against the torch path and a reference, then timings.

Run on a GPU machine (``scripts/gpu_check.sh`` wraps it)::

    python -m hybridcache.kernels.selfcheck --device cuda --out DIR

It also runs on CPU: ``--device cpu`` times the torch path, and with ``TRITON_INTERPRET=1``
set in the environment it checks the Triton kernel in the interpreter too (use ``--quick``:
the interpreter is slow and its timings mean nothing). Writes ``selfcheck.json`` (all
numbers) into ``--out`` and prints a short table last. Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from . import (
    allocate_staging,
    copy_kv_pages,
    copy_states,
    gather_to_host,
    scatter_from_host,
    staging_views,
)
from .dispatch import triton_module

# (dtype, row shape) of a small mixed arena: fp32 recurrent state, bf16 conv, fp16, int8, uint8
CHECK_SPECS = [
    (torch.float32, (4, 16, 16)),
    (torch.bfloat16, (96, 3)),
    (torch.float16, (7,)),
    (torch.int8, (33,)),
    (torch.uint8, (1000,)),
]
KIMI_SPECS = [(torch.float32, (32, 128, 128)), (torch.bfloat16, (12288, 3))] * 20


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def arena_views(buf: torch.Tensor, specs, num_slots: int, base: int = 0) -> list[torch.Tensor]:
    """Slot-major strided views over ``buf`` (rows back to back, 16-byte aligned)."""
    offsets, pos = [], 0
    for dtype, shape in specs:
        pos = (pos + 15) // 16 * 16
        offsets.append(pos)
        pos += int(np.prod(shape, dtype=np.int64)) * _esize(dtype)
    slot = (pos + 15) // 16 * 16
    views = []
    for (dtype, shape), off in zip(specs, offsets):
        e = _esize(dtype)
        flat = buf[base + off :].view(dtype)
        row_strides = torch.empty(shape).stride()
        views.append(torch.as_strided(flat, (num_slots, *shape), (slot // e, *row_strides)))
    return views


def arena_bytes(specs, num_slots: int, base: int = 0) -> int:
    pos = 0
    for dtype, shape in specs:
        pos = (pos + 15) // 16 * 16 + int(np.prod(shape, dtype=np.int64)) * _esize(dtype)
    return base + num_slots * ((pos + 15) // 16 * 16)


def _reference(views: list[torch.Tensor], pairs, nbytes: list[list[int]] | None = None) -> None:
    for j, t in enumerate(views):
        snap = {s: t[s].reshape(-1).view(torch.uint8).clone() for s, _ in pairs}
        for i, (s, d) in enumerate(pairs):
            row = t[d].reshape(-1).view(torch.uint8)
            n = row.numel() if nbytes is None else nbytes[j][i]
            row[:n] = snap[s][:n]


def check_device_copies(device: str, backends: list[str]) -> dict[str, bool]:
    """copy_states and copy_kv_pages (whole and partial pages) on every backend vs reference."""
    results = {}
    pairs = [(0, 5), (0, 6), (1, 7), (3, 3), (4, 8)]
    real = [(s, d) for s, d in pairs if s != d]
    for base in (0, 4):  # aligned, and rows 4 bytes off a 16-byte boundary
        nbytes = arena_bytes(CHECK_SPECS, 10, base)
        gen = torch.Generator().manual_seed(base)
        start = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).to(device)
        expected = start.clone()
        _reference(arena_views(expected, CHECK_SPECS, 10, base), real)
        kv_specs = [sp for sp in CHECK_SPECS if len(sp[1]) >= 2]
        kv_expected = start.clone()
        kv_views = arena_views(kv_expected, kv_specs, 10, base)
        counts = [2, 1, 3, 0]
        _reference(
            kv_views,
            real,
            [[c * t[0, 0].numel() * t.element_size() for c in counts] for t in kv_views],
        )
        for backend in backends:
            buf = start.clone()
            copy_states(pairs, arena_views(buf, CHECK_SPECS, 10, base), backend=backend)
            results[f"copy_states/{backend}/base{base}"] = torch.equal(buf, expected)
            buf = start.clone()
            views = arena_views(buf, kv_specs, 10, base)
            copy_kv_pages(pairs, views, num_tokens=[2, 1, 3, 3, 0], backend=backend)
            results[f"copy_kv_pages_partial/{backend}/base{base}"] = torch.equal(buf, kv_expected)
    return results


def check_host_transfers(device: str, backends: list[str]) -> dict[str, bool]:
    """gather_to_host then scatter_from_host on every backend; compares rows and staging."""
    results = {}
    nbytes = arena_bytes(CHECK_SPECS, 10)
    gen = torch.Generator().manual_seed(7)
    start = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).to(device)
    slots = [4, 1, 9]
    for backend in backends:
        buf = start.clone()
        views = arena_views(buf, CHECK_SPECS, 10)
        staging = allocate_staging(views, 4)
        staging.fill_(0xA5)
        gather_to_host(slots, views, staging, backend=backend)
        ok = all(
            torch.equal(
                st[k].cpu().reshape(-1).view(torch.uint8), t[s].cpu().reshape(-1).view(torch.uint8)
            )
            for t, st in zip(views, staging_views(staging, views))
            for k, s in enumerate(slots)
        )
        results[f"gather_to_host/{backend}"] = ok
        scatter_from_host([(0, 0), (1, 2), (2, 3)], views, staging, backend=backend)
        expected = start.clone()
        ev = arena_views(expected, CHECK_SPECS, 10)
        _reference(ev, [(4, 0), (1, 2), (9, 3)])
        results[f"scatter_from_host/{backend}"] = torch.equal(buf, expected)
    return results


def timed(fn: Callable[[], object], device: str, repeats: int) -> float:
    """Median seconds over ``repeats`` runs after a warm-up."""
    fn()
    out = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def time_device_copies(device: str, backends: list[str], snaps: int, repeats: int) -> list[dict]:
    """Kimi snapshots (copy_states) and MLA-like KV pages (copy_kv_pages) per backend."""
    rows = []
    slot = arena_bytes(KIMI_SPECS, 1)
    buf = torch.zeros(arena_bytes(KIMI_SPECS, 2 * snaps), dtype=torch.uint8, device=device)
    views = arena_views(buf, KIMI_SPECS, 2 * snaps)
    perm = torch.randperm(snaps, generator=torch.Generator().manual_seed(0)).tolist()
    plan = [(i, snaps + perm[i]) for i in range(snaps)]
    n = snaps * slot
    big = _gbps(n, timed(lambda: buf[n : 2 * n].copy_(buf[:n]), device, repeats))
    rows.append({"kernel": "copy_states", "backend": "large_copy_", "gbps": big})
    for backend in backends:
        s = timed(lambda b=backend: copy_states(plan, views, backend=b), device, repeats)
        rows.append({"kernel": "copy_states", "backend": backend, "gbps": _gbps(n, s)})
        # one copy-on-extend: a single snapshot, where launch and table overheads show
        s = timed(lambda b=backend: copy_states(plan[:1], views, backend=b), device, repeats)
        rows.append(
            {
                "kernel": "copy_states_1snap",
                "backend": backend,
                "gbps": _gbps(slot, s),
                "us": round(s * 1e6, 1),
            }
        )
    pages = 64 * snaps
    kv_specs = [(torch.bfloat16, (16, 576))] * 7  # MLA: 16-token pages, 7 layers
    kv = [torch.zeros(2 * pages, *shape, dtype=dtype, device=device) for dtype, shape in kv_specs]
    kv_perm = torch.randperm(pages, generator=torch.Generator().manual_seed(1)).tolist()
    kv_plan = [(i, pages + kv_perm[i]) for i in range(pages)]  # shuffled: pages do not merge
    for label, tokens in (("copy_kv_pages", None), ("copy_kv_pages_7tok", 7)):
        nb = pages * 7 * 576 * 2 * (16 if tokens is None else tokens)
        for backend in backends:
            s = timed(
                lambda b=backend, t=tokens: copy_kv_pages(kv_plan, kv, num_tokens=t, backend=b),
                device,
                repeats,
            )
            rows.append({"kernel": label, "backend": backend, "gbps": _gbps(nb, s)})
    return rows


def time_host_transfers(device: str, backends: list[str], snaps: int, repeats: int) -> list[dict]:
    """Kimi snapshots to and from one host staging buffer, vs one plain copy of the bytes."""
    rows = []
    slot = arena_bytes(KIMI_SPECS, 1)
    buf = torch.zeros(arena_bytes(KIMI_SPECS, 2 * snaps), dtype=torch.uint8, device=device)
    views = arena_views(buf, KIMI_SPECS, 2 * snaps)
    staging = allocate_staging(views, snaps)
    slots = list(range(0, 2 * snaps, 2))  # every other slot: not one contiguous run
    n = snaps * slot
    flat = staging.view(-1)[:n]
    d2h = _gbps(n, timed(lambda: flat.copy_(buf[:n], non_blocking=True), device, repeats))
    h2d = _gbps(n, timed(lambda: buf[:n].copy_(flat, non_blocking=True), device, repeats))
    rows.append({"kernel": "gather_to_host", "backend": "large_copy_", "gbps": d2h})
    rows.append({"kernel": "scatter_from_host", "backend": "large_copy_", "gbps": h2d})
    for backend in backends:
        if backend == "triton" and device == "cuda" and not staging.is_pinned():
            continue
        g = timed(
            lambda b=backend: gather_to_host(slots, views, staging, backend=b), device, repeats
        )
        s = timed(
            lambda b=backend: scatter_from_host(slots, views, staging, backend=b), device, repeats
        )
        rows.append({"kernel": "gather_to_host", "backend": backend, "gbps": _gbps(n, g)})
        rows.append({"kernel": "scatter_from_host", "backend": backend, "gbps": _gbps(n, s)})
    return rows


def ptx_memory_ops(arch: int = 90) -> list[str]:
    """Global load/store instructions in the kernel's PTX for ``sm_<arch>``.

    Compiling needs no GPU (Triton ships its CUDA toolchain), so this checks the claim that
    the body is copied with 16-byte ``v4.b32`` accesses anywhere, but only when the kernel
    module was imported without ``TRITON_INTERPRET=1`` (then the kernel is not compiled).
    """
    import re

    import triton
    from triton.backends.compiler import GPUTarget

    tc = triton_module()
    if tc is None or tc.INTERPRETED:
        raise RuntimeError("needs triton, imported without TRITON_INTERPRET=1")
    src = triton.compiler.ASTSource(
        fn=tc.copy_chunks_kernel,
        signature={"table": "*i64", "WORD_BLOCK": "constexpr", "BYTE_BLOCK": "constexpr"},
        constexprs={"WORD_BLOCK": tc.WORD_BLOCK, "BYTE_BLOCK": tc.BYTE_BLOCK},
    )
    target = GPUTarget("cuda", arch, 32)
    compiled = triton.compile(src, target=target, options={"num_warps": tc.NUM_WARPS})
    return sorted(set(re.findall(r"(?:ld|st)\.global[\w.]*", compiled.asm["ptx"])))


def available_backends(device: str) -> list[str]:
    """torch always; triton where it can run (CUDA, or CPU under TRITON_INTERPRET=1)."""
    tc = triton_module()
    ok = tc is not None and tc.unavailable_reason(torch.device(device)) is None
    return ["torch", "triton"] if ok else ["torch"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Check and time the state-copy kernels.")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--out", required=True, help="folder for selfcheck.json")
    ap.add_argument("--snapshots", type=int, default=16, help="Kimi snapshots to time")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="correctness only, no timings")
    args = ap.parse_args(argv)
    backends = available_backends(args.device)
    checks = check_device_copies(args.device, backends)
    checks.update(check_host_transfers(args.device, backends))
    timings: list[dict] = []
    tc = triton_module()
    # interpreter timings mean nothing and would take hours at Kimi sizes
    timed_backends = [b for b in backends if b != "triton" or not tc.INTERPRETED]
    if not args.quick:
        timings += time_device_copies(args.device, timed_backends, args.snapshots, args.repeats)
        half = max(1, args.snapshots // 2)
        timings += time_host_transfers(args.device, timed_backends, half, args.repeats)
    info = {
        "device": args.device,
        "backends": backends,
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
        "torch": torch.__version__,
    }
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    if tc is not None and not tc.INTERPRETED:
        major, minor = torch.cuda.get_device_capability() if args.device == "cuda" else (9, 0)
        ops = ptx_memory_ops(10 * major + minor)
        info["ptx_memory_ops"] = ops
        checks["ptx_16_byte_accesses"] = "ld.global.v4.b32" in ops and "st.global.v4.b32" in ops
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "selfcheck.json").write_text(
        json.dumps({"info": info, "checks": checks, "timings": timings}, indent=2)
    )
    failed = [k for k, v in checks.items() if not v]
    print(
        f"checks: {len(checks) - len(failed)}/{len(checks)} passed"
        + (f"; FAILED: {', '.join(failed)}" if failed else "")
    )
    if timings:
        print(f"{'kernel':<22}{'backend':<14}{'GB/s':>9}")
        for r in timings:
            print(f"{r['kernel']:<22}{r['backend']:<14}{r['gbps']:>9.2f}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
