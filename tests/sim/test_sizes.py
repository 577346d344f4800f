"""Sizes on the command line."""

import pytest

from hybridcache.sim.sizes import format_bytes, parse_size, parse_sizes


def test_parse_sizes():
    assert parse_size("64GiB") == 64 << 30 and parse_size("512MiB") == 512 << 20
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size("12345") == 12345
    assert parse_sizes("8GiB, 1TiB") == [8 << 30, 1 << 40]
    # One capacity written twice (or in two units) is replayed once, in its first place.
    assert parse_sizes("8GiB,1TiB,8192MiB,1TiB") == [8 << 30, 1 << 40]
    for bad in ("", "GiB", "12 parsecs", "0", "-1GiB"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_format_bytes():
    assert format_bytes(64 << 30) == "64GiB" and format_bytes(1536 << 20) == "1.50GiB"
    assert format_bytes(100) == "100B"
