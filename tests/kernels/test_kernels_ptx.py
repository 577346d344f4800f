"""The compiled kernel uses 16-byte global loads and stores (checked without a GPU).

Triton ships its CUDA toolchain, so the kernel can be compiled to PTX for sm_90 on a CPU
machine. This runs in a subprocess because this test session imports the kernel module in
interpreter mode (see conftest.py), where it is not compiled at all.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _has_triton(), reason="triton is not importable")

SCRIPT = """
from hybridcache.kernels.selfcheck import ptx_memory_ops
print(" ".join(ptx_memory_ops(90)))
"""


def test_compiled_kernel_uses_16_byte_accesses():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("Triton's bundled ptxas is missing")
    assert proc.returncode == 0, proc.stderr[-2000:]
    ops = proc.stdout.split()
    assert "ld.global.v4.b32" in ops and "st.global.v4.b32" in ops, ops
