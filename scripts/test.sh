#!/usr/bin/env bash
# Installs hybridcache with every extra its tests use, then runs the test suite.
# Usage: bash scripts/test.sh [pytest args...]
#   bash scripts/test.sh -m "not slow"     # the quick subset (a few minutes on 2 cores)
# Set TORCH_INDEX_URL to PyTorch's CPU wheel index on a machine without a GPU, so that pip
# fetches torch's CPU build instead of the default (CUDA) one.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
# The vLLM CPU wheel the tests use pins torch 2.13.0: install it first (kept when present),
# from TORCH_INDEX_URL when given.
TORCH_PIN=2.13.0
if ! "$PY" -c "import torch, sys; sys.exit(not torch.__version__.startswith('$TORCH_PIN'))" 2>/dev/null; then
  "$PY" -m pip install -q "torch==$TORCH_PIN" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
"$PY" -m pip install -q -e ".[dev,torch,redis,vllm]"
# The registry's torchvision does not load beside the CPU torch and breaks vLLM's imports.
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

# Redis tests talk to a real redis-server started by the tests themselves.
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  else
    echo "redis-server is missing (Debian package redis-server): the Redis tests will skip" >&2
  fi
fi

export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 TOKENIZERS_PARALLELISM=false
if [ "$#" -eq 0 ]; then
  echo "running the whole suite (about 15 minutes on 2 cores; the quick subset is" \
       "bash scripts/test.sh -m \"not slow\"); the slowest tests are listed at the end" >&2
fi
exec "$PY" -m pytest -q --durations=10 "$@"
