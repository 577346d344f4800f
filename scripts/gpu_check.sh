#!/usr/bin/env bash
# Check and time the state-copy kernels (hybridcache.kernels) on a GPU machine.
#
#   scripts/gpu_check.sh --out DIR [--skip-tests] [--snapshots N] [--cpu-dry-run]
#
# --cpu-dry-run runs the same steps on the CPU with tiny sizes, to test this script
# itself on a machine without a GPU (its numbers are not GPU numbers).
#
# Steps (each bounded by `timeout`, 5 minutes in all at worst):
#   1. the CPU kernel tests (Triton interpreter), exactly as CI runs them;
#   2. python -m hybridcache.kernels.selfcheck --device cuda: every kernel (copy_states,
#      copy_kv_pages whole and partial, gather_to_host, scatter_from_host) on the GPU with
#      the Triton and torch backends against a reference, the PTX vector-access check, then
#      timings of every kernel and backend next to a plain copy of the same bytes;
#   3. benchmarks/bench_copy.py --device cuda --snapshots N (headline: 64 Kimi-Linear
#      snapshots, batched vs per-slot loop vs one large copy_).
# Full outputs go to DIR (pytest.txt, selfcheck.json/.txt, bench_copy.json/.txt,
# nvidia-smi.txt); a short table is printed last. Exit status: 0 when every check passed.
set -uo pipefail

OUT=""
SKIP_TESTS=0
SNAPSHOTS=64
DEVICE=cuda
SELF_SNAPSHOTS=16
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --skip-tests) SKIP_TESTS=1; shift ;;
    --snapshots) SNAPSHOTS="$2"; shift 2 ;;
    --cpu-dry-run) DEVICE=cpu; SNAPSHOTS=2; SELF_SNAPSHOTS=2; shift ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
if [ -z "$OUT" ]; then
  echo "usage: $0 --out DIR [--skip-tests] [--snapshots N]" >&2
  exit 2
fi
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export TRITON_DEFAULT_FP_FUSION=1  # silences a Triton 3.9 notice; copies do no float math

if [ "$DEVICE" = cuda ] && ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch sees no CUDA device; run this on a GPU machine" >&2
  exit 2
fi
if ! python -c "import hybridcache.kernels" 2>/dev/null; then
  echo "gpu_check: installing the package (editable, no dependencies)"
  pip install --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || {
    echo "gpu_check: install failed, see $OUT/install.log" >&2; exit 2; }
fi
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true

STATUS=0
TESTS="skipped"
if [ "$SKIP_TESTS" = 0 ]; then
  if timeout 90 python -m pytest tests/kernels -q -p no:cacheprovider >"$OUT/pytest.txt" 2>&1; then
    TESTS="passed"
  else
    TESTS="FAILED"; STATUS=1
  fi
fi

timeout 120 python -m hybridcache.kernels.selfcheck --device "$DEVICE" --out "$OUT" \
  --snapshots "$SELF_SNAPSHOTS" >"$OUT/selfcheck.txt" 2>&1 || STATUS=1
timeout 90 python benchmarks/bench_copy.py --device "$DEVICE" --snapshots "$SNAPSHOTS" \
  --json "$OUT/bench_copy.json" >"$OUT/bench_copy.txt" 2>&1 || STATUS=1

NAME=$(python -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu dry run")' 2>/dev/null)
echo "== gpu_check ($NAME) =="
echo "cpu kernel tests: $TESTS"
cat "$OUT/selfcheck.txt"
echo "-- bench_copy --"
cat "$OUT/bench_copy.txt"
echo "full numbers: $OUT"
exit $STATUS
