"""Kernel tests run the Triton kernel in Triton's interpreter on CPU.

``triton.jit`` decides at decoration time whether it builds a compiled or an interpreted
kernel, so ``TRITON_INTERPRET=1`` must be set before ``hybridcache.kernels.triton_copy`` is
imported; this conftest is imported before any test module of this folder. The setting is
process-wide and stays set: Triton cannot mix modes in one process (its own lazily
imported modules, e.g. ``triton.experimental.gluon``, assert that functions decorated
earlier match the current mode), so restoring it after import breaks later launches.
Any other test in the same pytest process that launches Triton kernels on CPU tensors
runs them in the interpreter too.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
