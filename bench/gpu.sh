#!/usr/bin/env bash
# The GPU checks of issue 15, in under 8 minutes on one H200 (JAX with CUDA, Optax, Flax,
# pyarrow, pytest and hypothesis installed; Keras, dp-accounting and tensorboardX need
# not be: their tests skip). Everything it measures goes to $OUT:
#
#   progress.txt      what ran when, and each part's summary line
#   devices.txt       JAX's version and devices, nvidia-smi
#   tests-*.txt       pytest over the packages that run device code, in 4 shards at
#                     once (not-slow tests; the CPU CI runs the rest)        ~3 minutes
#   precision.txt     bench/strategy_agreement.py at the default matmul precision and at
#                     'highest': per-round differences between strategies and the
#                     accuracies after 5 rounds (is it TF32, or rounding amplified by
#                     training, that moved vmap's accuracy?), run beside the tests
#   bench_gpu.txt     the GPU table alone on the device (bench/run_simulation.py --plan
#                     gpu): fedlang's strategies, centralized and the hand-written
#                     vmapped FedAvg per configuration, round 1, compilations  ~4 minutes
#   bench_gpu.json    the same in full (with what 'auto' measured), bench_gpu.stderr
#
# Usage, from the repository root on the device machine:  OUT=/some/dir bash bench/gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the directory for results}
PY=${PYTHON:-python}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export FEDLANG_CACHE_DIR="$OUT/cache"   # auto's decisions: measured afresh, kept with the results
mkdir -p "$OUT"
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start )) s] $*" | tee -a "$OUT/progress.txt"; }

{ $PY -c "import jax; print('jax', jax.__version__); print(jax.devices())"; nvidia-smi; } \
  > "$OUT/devices.txt" 2>&1
stamp "devices: $(head -2 "$OUT/devices.txt" | tr '\n' ' ')"
# fedlang's dependencies that may be missing there (a missing one fails the tests using it).
missing=$($PY - <<'PY'
import importlib.util as u
mods = ["numpy", "optax", "flatbuffers", "ml_dtypes", "pyarrow", "rich", "typer", "matplotlib",
        "cryptography", "flax", "hypothesis", "keras", "dp_accounting", "tensorboardX"]
print(" ".join(m for m in mods if u.find_spec(m) is None) or "none")
PY
)
stamp "modules missing: $missing"

# 1. Tests (4 processes sharing the GPU: no preallocation) and the precision check.
stamp "tests and precision check"
shard() {  # name, paths...
  local name=$1; shift
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 $PY -m pytest -v -m "not slow" \
    -p no:cacheprovider "$@" > "$OUT/tests-$name.txt" 2>&1
  echo "exit $?" >> "$OUT/tests-$name.txt"
}
shard core tests/core tests/backends tests/test_layering.py tests/test_public_api.py &
shard runtime tests/runtime &
shard aggregators tests/aggregators &
shard learning tests/learning &
(
  # Per round: how far vmap (wide groups), scan and rounding-size perturbations of the
  # initial weights move the model from loop's; at the default matmul precision (TF32
  # on recent GPUs) and at full precision.
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 $PY bench/strategy_agreement.py \
    --rounds 5 --out "$OUT/agreement.json" > "$OUT/precision.txt" 2>&1
  XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_DEFAULT_MATMUL_PRECISION=highest timeout 150 \
    $PY bench/strategy_agreement.py --rounds 5 >> "$OUT/precision.txt" 2>&1
) &
wait
for f in "$OUT"/tests-*.txt; do
  stamp "$(basename "$f"): $(grep -E '[0-9]+ (passed|failed)' "$f" | tail -1) $(tail -1 "$f")"
done
stamp "$(grep accuracy "$OUT/precision.txt" 2>/dev/null | tr '\n' ';')"

# 2. The GPU table, alone on the device.
stamp "bench table"
timeout 250 $PY bench/run_simulation.py --plan gpu --out "$OUT/bench_gpu.json" \
  > "$OUT/bench_gpu.txt" 2> "$OUT/bench_gpu.stderr"
echo "exit $?" >> "$OUT/bench_gpu.txt"
stamp "bench table: $(tail -1 "$OUT/bench_gpu.txt")"
stamp "done"
