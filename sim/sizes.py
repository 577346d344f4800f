"""Byte sizes on the command line: ``64GiB``, ``512MiB``, ``1.5GB``, plain bytes."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
}
_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in ``text``; binary (GiB) and decimal (GB) suffixes, case-insensitive.

    Raises:
        ValueError: not a size, an unknown unit, or not positive.
    """
    m = _RE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"bad size {text!r}: expected e.g. 64GiB, 512MiB, 1.5GB or plain bytes")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"bad size {text!r}: must be positive")
    return n


def parse_sizes(text: str) -> list[int]:
    """Comma-separated sizes (``8GiB,32GiB``), in the order given, a size given twice once
    (``8GiB,8192MiB`` is one capacity: a sweep replays each capacity once)."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError("no capacity given")
    return list(dict.fromkeys(parse_size(p) for p in parts))


def format_bytes(n: int) -> str:
    """``64GiB``, ``512MiB``, ``1.50GiB``, or plain bytes."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            v = n / size
            return f"{v:g}{unit}" if v == int(v) else f"{v:.2f}{unit}"
    return f"{n}B"
