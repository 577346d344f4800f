#!/usr/bin/env bash
# Builds the sdist and the wheel, checks what the wheel holds, installs it (not editable)
# into a clean virtual env without system packages, and runs the console script from there.
# Usage: bash scripts/check_release.sh [work folder]   (needs the `build` package: dev extra)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
WORK=${1:-$(mktemp -d)}
mkdir -p "$WORK"
"$PY" -m build -q -o "$WORK/dist" . >/dev/null
WHEEL=$(ls "$WORK"/dist/hybridcache_llm-*.whl)
ls "$WORK"/dist/hybridcache_llm-*.tar.gz >/dev/null

"$PY" - "$WHEEL" <<'PY'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
need = ["hybridcache/manager.py", "hybridcache/py.typed", "hybridcache/adapters/hf/__init__.py",
        "hybridcache/adapters/vllm/plugin.py", "hybridcache/kernels/__init__.py",
        "hybridcache/sim/cli.py", "hybridcache/tiers/__init__.py"]
missing = [n for n in need if n not in names]
if missing:
    sys.exit(f"wheel lacks {missing}")
print(f"wheel {sys.argv[1].rsplit('/', 1)[-1]}: {len(names)} files, subpackages present")
PY

"$PY" -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q "$WHEEL"
cd "$WORK"  # away from the source tree: the import must come from the installed wheel
"$WORK/venv/bin/hybridcache-sim" --version
"$WORK/venv/bin/hybridcache-sim" demo --out "$WORK/demo" --no-progress >"$WORK/demo.log"
tail -n 1 "$WORK/demo.log"
"$WORK/venv/bin/python" - <<'PY'
import importlib.util, json, hybridcache
assert "site-packages" in hybridcache.__file__, hybridcache.__file__
assert importlib.util.find_spec("torch") is None, "the wheel's base install pulled torch"
doc = json.load(open("demo/hybridcache-demo.json"))
assert doc["hybridcache_version"] == hybridcache.__version__
print(f"installed {hybridcache.__version__} from the wheel without torch; demo wrote "
      f"{len(doc['results'])} results")
PY
