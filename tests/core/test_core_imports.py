"""The core imports neither torch nor an adapter: engines without torch (or with their own
tensors) use the manager and the port as they are."""

from __future__ import annotations

import subprocess
import sys


def test_core_import_path_has_no_torch_and_no_adapter():
    code = (
        "import sys\n"
        "import hybridcache, hybridcache.manager, hybridcache.port, hybridcache.port_import\n"
        "import hybridcache.policies, hybridcache.room, hybridcache.invariants, hybridcache.events\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('hybridcache.adapters')]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", out.stdout
