"""Copy N Kimi-Linear-sized state snapshots; compare the batched path, a per-slot loop and
one large ``copy_`` of the same bytes (the device's practical copy limit).

A snapshot is 20 KDA layers x (fp32 recurrent state 32x128x128 = 2 MiB + bf16 conv state
(12288, 3) = 72 KiB) = 41.4 MiB. Slots live in one arena buffer, slot-major, exactly as the
library carves them: every state tensor is a strided view ``[2N, ...]`` over that buffer.
The plan copies slots 0..N-1 to N..2N-1.

* batched: ``copy_states(plan, tensors)`` (auto backend: Triton on CUDA, torch on CPU; on
  CUDA the torch path is timed too); ``batched_shuffled`` uses the same sources with the
  destinations in a random order, so consecutive snapshots are not adjacent in memory;
* loop: one ``copy_`` per (pair, tensor), what a caller would write without the kernels;
* large: ``arena[N slots:].copy_(arena[:N slots])``, one contiguous copy of the same bytes.

GB/s counts each copied byte once (the memory traffic is twice that). Usage::

    python benchmarks/bench_copy.py --device cpu --snapshots 64
    python benchmarks/bench_copy.py --device cuda --snapshots 64 --json out.json
    python benchmarks/bench_copy.py --device cpu --row-sweep   # batching threshold evidence
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from hybridcache.kernels import copy_states
from hybridcache.kernels.torch_copy import BATCH_MAX_ROW_BYTES

LAYERS = 20
RECURRENT = (32, 128, 128)  # fp32
CONV = (12288, 3)  # bf16: conv_dim x (kernel - 1)
RECURRENT_BYTES = 32 * 128 * 128 * 4
CONV_BYTES = 12288 * 3 * 2
SLOT_BYTES = LAYERS * (RECURRENT_BYTES + CONV_BYTES)


def kimi_arena(num_slots: int, device: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One uint8 arena of ``num_slots`` snapshots and its 40 strided state views."""
    arena = torch.empty(num_slots * SLOT_BYTES, dtype=torch.uint8, device=device)
    # touch every page before timing; each slot gets its own byte so a wrong source shows
    slot_ids = torch.arange(num_slots, device=device, dtype=torch.int64) % 251 + 1
    arena.view(num_slots, SLOT_BYTES).copy_(
        slot_ids[:, None].to(torch.uint8).expand(-1, SLOT_BYTES)
    )
    tensors: list[torch.Tensor] = []
    off = 0
    for _ in range(LAYERS):
        for shape, dtype, nbytes in (
            (RECURRENT, torch.float32, RECURRENT_BYTES),
            (CONV, torch.bfloat16, CONV_BYTES),
        ):
            esize = torch.empty((), dtype=dtype).element_size()
            flat = arena[off:].view(dtype)
            row_strides = torch.empty(shape).stride()
            tensors.append(
                torch.as_strided(flat, (num_slots, *shape), (SLOT_BYTES // esize, *row_strides))
            )
            off += nbytes
    return arena, tensors


def run_once(fn: Callable[[], object], device: str) -> float:
    """Seconds for one call (CUDA events on GPU)."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_methods(methods: dict[str, Callable[[], object]], device: str, repeats: int) -> dict:
    """Median seconds per method; one warm-up each, then round-robin repeats.

    Interleaving keeps the ratios fair when the machine's load changes during the run
    (shared CI or development machines).
    """
    for fn in methods.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            samples[name].append(run_once(fn, device))
    return {name: statistics.median(v) for name, v in samples.items()}


def bench_snapshots(n: int, device: str, repeats: int) -> dict:
    """Time the three ways of copying ``n`` snapshots; returns GB/s and ratios."""
    arena, tensors = kimi_arena(2 * n, device)
    plan = [(i, n + i) for i in range(n)]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    shuffled = [(i, n + perm[i]) for i in range(n)]
    nbytes = n * SLOT_BYTES

    def loop() -> None:
        for s, d in plan:
            for t in tensors:
                t[d].copy_(t[s])

    def large() -> None:
        arena[nbytes:].copy_(arena[:nbytes])

    methods: dict[str, Callable[[], object]] = {
        "batched": lambda: copy_states(plan, tensors),
        "batched_shuffled": lambda: copy_states(shuffled, tensors),
    }
    if device == "cuda":
        methods["batched_torch"] = lambda: copy_states(plan, tensors, backend="torch")
    methods.update(loop=loop, large=large)

    def check(name: str) -> None:
        """Every method must really copy; checked once, outside the timing."""
        if name == "large":
            return
        pairs = shuffled if name == "batched_shuffled" else plan
        for s, d in pairs[:: max(1, n // 8)]:
            src = arena[s * SLOT_BYTES : (s + 1) * SLOT_BYTES]
            assert torch.equal(arena[d * SLOT_BYTES : (d + 1) * SLOT_BYTES], src), name

    for name, fn in methods.items():  # correctness first, outside the timing
        arena[nbytes:].zero_()
        fn()
        check(name)
    seconds = time_methods(methods, device, repeats)
    result: dict = {"snapshots": n, "device": device, "bytes": nbytes, "repeats": repeats}
    result["gbps"] = {name: nbytes / s / 1e9 for name, s in seconds.items()}
    g = result["gbps"]
    result["batched_vs_large"] = g["batched"] / g["large"]
    result["shuffled_vs_large"] = g["batched_shuffled"] / g["large"]
    result["batched_vs_loop"] = g["batched"] / g["loop"]
    return result


def copy_with_threshold(plan: list[tuple[int, int]], t: torch.Tensor, threshold: int) -> None:
    """copy_states on the torch path with the batching threshold moved for this call."""
    from hybridcache.kernels import torch_copy

    torch_copy.BATCH_MAX_ROW_BYTES = threshold
    try:
        copy_states(plan, [t], backend="torch")
    finally:
        torch_copy.BATCH_MAX_ROW_BYTES = BATCH_MAX_ROW_BYTES


def row_sweep(device: str, repeats: int) -> list[dict]:
    """GB/s of the torch path batched vs looped for 64 rows of each size (threshold evidence)."""
    rows = []
    for row_bytes in (512, 4096, 16384, 32768, 65536, 262144, 2 << 20):
        # rows separated by a 64-byte gap, as in an arena, so they cannot merge into runs
        base = torch.randint(0, 255, (128, row_bytes + 64), dtype=torch.uint8, device=device)
        t = base[:, :row_bytes]
        plan = [(i, 64 + i) for i in range(64)]
        entry = {"row_bytes": row_bytes}
        methods = {
            name: lambda p=plan, x=t, th=threshold: copy_with_threshold(p, x, th)
            for name, threshold in (("batched", 1 << 40), ("loop", 0))
        }
        for name, s in time_methods(methods, device, repeats).items():
            entry[name] = 64 * row_bytes / s / 1e9
        rows.append(entry)
    return rows


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--snapshots", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=None, help="timed runs (median reported)")
    ap.add_argument("--row-sweep", action="store_true", help="also sweep torch-path row sizes")
    ap.add_argument("--json", help="write all numbers to this file")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (20 if args.device == "cuda" else 5)
    out = {"machine": machine(), "snapshot_bytes": SLOT_BYTES}
    res = bench_snapshots(args.snapshots, args.device, repeats)
    out["snapshots"] = res
    print(
        f"{args.snapshots} snapshots x {SLOT_BYTES / 2**20:.1f} MiB on {args.device} "
        f"({out['machine']}); median of {repeats}"
    )
    print(f"{'method':<18}{'GB/s':>9}{'x large':>9}")
    for name, gbps in res["gbps"].items():
        print(f"{name:<18}{gbps:>9.2f}{gbps / res['gbps']['large']:>9.2f}")
    print(
        f"batched / large = {res['batched_vs_large']:.2f}x   "
        f"shuffled / large = {res['shuffled_vs_large']:.2f}x   "
        f"batched / loop = {res['batched_vs_loop']:.2f}x"
    )
    if args.row_sweep:
        out["row_sweep"] = row_sweep(args.device, repeats)
        print(f"{'row bytes':>10}{'batched':>10}{'loop':>10}   (torch path, 64 rows, GB/s)")
        for r in out["row_sweep"]:
            print(f"{r['row_bytes']:>10}{r['batched']:>10.2f}{r['loop']:>10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
