"""The generator refuses what it cannot honour, naming the argument, before any work.

A tenant count of 0 or -2 used to give one tenant (and the command line then reported
"0 tenants"), 5.5 requests gave six, ``True`` gave one, and a negative seed failed inside
NumPy with "expected non-negative integer".
"""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.sim.cli import main
from hybridcache.sim.generate import generate, generate_change

BAD = [
    (("nope", 5), {}, "unknown workload kind 'nope'"),
    (("chat", 0), {}, "requests must be an int >= 1, got 0"),
    (("chat", -1), {}, "requests must be an int >= 1, got -1"),
    (("chat", 5.5), {}, "requests must be an int >= 1, got 5.5"),
    (("chat", True), {}, "requests must be an int >= 1, got True"),
    (("chat", 5), {"seed": -1}, "seed must be an int >= 0, got -1"),
    (("chat", 5), {"seed": 1.0}, "seed must be an int >= 0, got 1.0"),
    (("chat", 5), {"tenants": 0}, "tenants must be an int >= 1, got 0"),
    (("chat", 5), {"tenants": -2}, "tenants must be an int >= 1, got -2"),
    (("chat", 5), {"tenants": 2.5}, "tenants must be an int >= 1, got 2.5"),
]


@pytest.mark.parametrize(("args", "kwargs", "message"), BAD)
def test_generate_refuses_a_bad_argument(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(*args, **kwargs)


def test_generate_takes_numpy_ints():
    """Integral types other than int (a count read from an array) are counts as well."""
    reqs = generate("chat", np.int64(7), seed=np.int64(3), tenants=np.int32(3))
    same = generate("chat", 7, seed=3, tenants=3)
    assert len(reqs) == 7
    assert all(np.array_equal(a.input_ids, b.input_ids) and a.tenant == b.tenant for a, b in zip(reqs, same))


@pytest.mark.parametrize(("requests", "message"), [
    ((5, 0), "requests must be an int >= 1, got 0"),
    ((5,), r"requests must be two counts \(before, after the change\), got \(5,\)"),
    (5, "requests must be two counts"),
])
def test_generate_change_refuses_a_bad_count_of_either_part(requests, message):
    with pytest.raises(ValueError, match=message):
        generate_change("chat", "docs", requests)
    with pytest.raises(ValueError, match="unknown workload kind 'nope'"):
        generate_change("chat", "nope", (5, 5))


def test_cli_generate_refuses_zero_tenants_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    assert main(["generate", "--kind", "chat", "--requests", "5", "--tenants", "0", "-o", str(out)]) == 2
    assert "tenants must be an int >= 1, got 0" in capsys.readouterr().err
    assert not out.exists()
