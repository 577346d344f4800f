"""Throughput of the offload tiers for Kimi-Linear-sized snapshots, beside raw redis-py.

One snapshot = 20 KDA layers x (fp32 recurrent state 32x128x128 + bf16 conv state 12288x3)
= 41.4 MiB in 40 pieces. The benchmark starts its own redis-server (persistence off) on a
free loopback port and measures, for the same bytes:

* ``raw 1 value``: redis-py ``SET``/``GET`` of the whole snapshot as one value;
* ``raw pieces``: one pipelined round trip of 40 ``SET``s / one ``MGET`` of the 40 pieces;
* ``RedisTier``: ``put`` x N then ``flush()`` (background writer, chunk MACs, chunk keys then
  manifest), and ``get`` (manifest + chunks, MAC checks, zero-copy decode);
* ``HostTier``: put (copy into host memory) and get (zero-copy views), for reference.

Puts write *new* keys in every run on both sides, as caching new prefixes does (the tier
never overwrites chunks in place); each run's keys are deleted untimed after it, so Redis
memory stays at a steady state. The variants run *interleaved* (raw, tier, raw, tier...), so
that a busy machine slows them alike (the order rotates every round), and each figure is
the median over ``--reps`` runs.
The ratio divides RedisTier's throughput by the best raw variant: the limit of redis-py.

Run: ``python benchmarks/bench_tiers.py [--entries 8] [--reps 7] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import redis
import torch

from hybridcache.tiers import Entry, EntryKey, HostTier, RedisTier

LAYERS = 20
STATE_SHAPE = (32, 128, 128)  # fp32 recurrent state per KDA layer
CONV_SHAPE = (12288, 3)  # bf16 short-conv state per KDA layer
FINGERPRINT = "b3ac0ffee0ddf00d"
SECRET = b"benchmark-secret-not-for-production"

#: A timed case: run(rep) is timed, cleanup(rep) is not.
Case = tuple[Callable[[int], object], Callable[[int], object]]


def snapshot(seed: int) -> Entry:
    gen = torch.Generator().manual_seed(seed)
    pieces: dict[str, torch.Tensor] = {}
    for layer in range(LAYERS):
        pieces[f"kda.{layer}.state"] = torch.randn(STATE_SHAPE, generator=gen)
        pieces[f"kda.{layer}.conv"] = torch.randn(CONV_SHAPE, generator=gen).bfloat16()
    return Entry(pieces, meta={"tokens": 4096})


def raw_pieces(entry: Entry) -> list[memoryview]:
    return [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in entry.pieces.values()]


def start_redis(workdir: str) -> tuple[subprocess.Popen, int]:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not os.path.exists(binary):
        sys.exit("redis-server not found (Debian package: redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
            "no", "--dir", workdir, "--loglevel", "warning"]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(500):
        try:
            if client.ping():
                return proc, port
        except redis.ConnectionError:
            time.sleep(0.02)
    proc.kill()
    sys.exit("redis-server did not start")


#: Every run's GB/s, for the JSON output (the table shows medians).
ALL_RUNS: dict[str, list[float]] = {}


def interleaved(cases: dict[str, Case], nbytes: int, reps: int, op: str = "") -> dict[str, float]:
    """Median GB/s (10^9 B/s) of each case, the cases taking turns in every round."""
    rates: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for rep in range(reps):
        # Rotate the order every round, so no case always follows the same one.
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            run, cleanup = cases[name]
            start = time.perf_counter()
            run(rep)
            rates[name].append(nbytes / (time.perf_counter() - start) / 1e9)
            cleanup(rep)
    for name, r in rates.items():
        ALL_RUNS[f"{op}{name}"] = [round(x, 3) for x in r]
    return {name: statistics.median(r) for name, r in rates.items()}


def raw_cases(client: redis.Redis, entries: list[Entry]) -> tuple[dict, dict]:
    """(put cases, get cases) of redis-py alone."""
    blobs = [b"".join(raw_pieces(e)) for e in entries]
    pieces = [raw_pieces(e) for e in entries]

    def set_one(rep: int) -> None:
        for i, blob in enumerate(blobs):
            client.set(f"raw:{rep}:{i}", blob)

    def set_pieces(rep: int) -> None:
        for i, ps in enumerate(pieces):
            pipe = client.pipeline(transaction=False)
            for j, p in enumerate(ps):
                pipe.set(f"rawp:{rep}:{i}:{j}", p)
            pipe.execute()

    def get_one(rep: int) -> None:
        for i in range(len(blobs)):
            assert client.get(f"raw:-1:{i}") is not None

    def get_pieces(rep: int) -> None:
        for i, ps in enumerate(pieces):
            assert None not in client.mget([f"rawp:-1:{i}:{j}" for j in range(len(ps))])

    def forget(prefix: str) -> Callable[[int], None]:
        return lambda rep: client.unlink(*client.keys(f"{prefix}:{rep}:*"))

    set_one(-1)  # what the reads read, written untimed
    set_pieces(-1)
    puts = {"raw_1value": (set_one, forget("raw")), "raw_pieces": (set_pieces, forget("rawp"))}
    nothing: Callable[[int], None] = lambda rep: None  # noqa: E731
    gets = {"raw_1value": (get_one, nothing), "raw_pieces": (get_pieces, nothing)}
    return puts, gets


def tier_cases(writer: RedisTier, reader: RedisTier, entries: list[Entry]) -> tuple[dict, dict]:
    def keys(rep: int) -> list[EntryKey]:
        return [
            EntryKey.from_int("bench", FINGERPRINT, (rep + 1) << 32 | i)
            for i in range(len(entries))
        ]

    def put_all(rep: int) -> None:
        for k, e in zip(keys(rep), entries, strict=True):
            assert writer.put(k, e)
        assert writer.flush(600)

    def forget(rep: int) -> None:
        for k in keys(rep):
            writer.delete(k)
        writer.flush(600)

    def get_all(rep: int) -> None:
        for k in keys(-1):
            assert reader.get(k) is not None

    put_all(-1)  # what the reads read, written untimed
    return {"tier": (put_all, forget)}, {"tier": (get_all, lambda rep: None)}


def bench_host(entries: list[Entry], reps: int) -> dict[str, float]:
    tier = HostTier(sum(e.nbytes for e in entries) * 2)
    keys = [EntryKey.from_int("bench", FINGERPRINT, i) for i in range(len(entries))]
    total = sum(e.nbytes for e in entries)
    cases: dict[str, Case] = {
        "host_put": (
            lambda _: [tier.put(k, e) for k, e in zip(keys, entries, strict=True)],
            lambda _: tier.clear(),
        ),  # fmt: skip
    }
    out = interleaved(cases, total, reps)
    for k, e in zip(keys, entries, strict=True):
        tier.put(k, e)
    out.update(interleaved({"host_get": (lambda _: [tier.get(k) for k in keys], lambda _: None)},
                           total, reps))  # fmt: skip
    return out


def machine() -> dict[str, str]:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    server = subprocess.run(
        [shutil.which("redis-server") or "redis-server", "--version"],
        capture_output=True,
        text=True,
    ).stdout.split()
    return {
        "nproc": str(os.cpu_count()),
        "cpu": cpu,
        "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "python": platform.python_version(),
        "redis-py": redis.__version__,
        "redis-server": next((w.split("=")[1] for w in server if w.startswith("v=")), "?"),
    }


def report(res: dict[str, dict[str, float]], n: int, nbytes: int, info: dict[str, str]) -> None:
    print(f"machine: {info['nproc']} CPUs, {info['cpu']}, load average {info['loadavg']}; "
          f"Python {info['python']}, redis-py {info['redis-py']}, "
          f"redis-server {info['redis-server']}")  # fmt: skip
    print(f"{n} snapshots of {nbytes / 2**20:.1f} MiB ({LAYERS} KDA layers, 40 pieces)\n")
    print(f"{'op':<5}{'raw 1 value':>13}{'raw pieces':>12}{'RedisTier':>11}{'ratio':>8}"
          f"{'HostTier':>10}   (GB/s)")  # fmt: skip
    for op in ("put", "get"):
        r = res[op]
        best = max(r["raw_1value"], r["raw_pieces"])
        print(
            f"{op:<5}{r['raw_1value']:>13.2f}{r['raw_pieces']:>12.2f}{r['tier']:>11.2f}"
            f"{r['tier'] / best:>7.2f}x{res['host'][f'host_{op}']:>10.2f}"
        )
    print("\nratio = RedisTier / the faster raw variant (medians of interleaved runs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entries", type=int, default=8, help="snapshots per run")
    parser.add_argument("--reps", type=int, default=7, help="runs per measurement (median)")
    parser.add_argument("--chunk-mib", type=float, default=4.0, help="RedisTier chunk size")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    entries = [snapshot(i) for i in range(args.entries)]
    total = sum(e.nbytes for e in entries)
    with tempfile.TemporaryDirectory() as workdir:
        proc, port = start_redis(workdir)
        url = f"redis://127.0.0.1:{port}"
        chunk = int(args.chunk_mib * 2**20)
        writer = RedisTier(url, secret=SECRET, chunk_bytes=chunk)
        reader = RedisTier(url, secret=SECRET, chunk_bytes=chunk)
        try:
            raw_put, raw_get = raw_cases(redis.Redis(port=port), entries)
            tier_put, tier_get = tier_cases(writer, reader, entries)
            res = {
                "put": interleaved({**raw_put, **tier_put}, total, args.reps, "put_"),
                "get": interleaved({**raw_get, **tier_get}, total, args.reps, "get_"),
            }
            stats, rstats = writer.stats(), reader.stats()
            assert stats.dropped_writes == 0 and stats.errors == 0, stats
            assert rstats.corrupt == 0 and rstats.misses == 0, rstats
        finally:
            writer.close()
            reader.close()
            proc.terminate()
            proc.wait(10)
    res["host"] = bench_host(entries, args.reps)
    info = machine()
    report(res, args.entries, entries[0].nbytes, info)
    if args.json:
        with open(args.json, "w") as f:
            body = {"machine": info, "entries": args.entries, "gbps": res, "runs": ALL_RUNS}
            json.dump(body, f, indent=2)


if __name__ == "__main__":
    main()
