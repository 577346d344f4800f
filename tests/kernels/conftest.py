"""Kernel tests run the Triton kernel in Triton's interpreter on CPU.

``TRITON_INTERPRET`` must be set before ``hybridcache.kernels.triton_copy`` is imported:
``triton.jit`` decides at decoration time whether it builds a compiled or an interpreted
kernel. This conftest is imported before any test module of this folder, so setting it here
is early enough (nothing else in the package imports the Triton module eagerly).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
