#!/usr/bin/env bash
# Ours beside FBGEMM_GPU on a GPU machine, in one call: install the project (and FBGEMM_GPU from
# .peer/ when its wheels were copied there with an install-on-device.sh script), run the kernels'
# gpu-marked tests, then `tiered-tbe bench fbgemm` on the configurations asked for; logs, JSON and
# the measurements (one JSON line each, to append to results/measurements.jsonl) under $OUT.
#
#   TIERED_TBE_COMMIT=<commit> OUT=$OUT bash tools/gpu_fbgemm.sh
# Environment (all optional):
#   CONFIGS        bench fbgemm configurations (default: the HBM ones and the managed cached Criteo ones; the
#                  mixed-dim ones, each allocating its tables on both sides, in a call of their own:
#                  CONFIGS="$(python3 -m tiered_tbe bench fbgemm --list | awk '/mixed|odd-dims/ {print $1}')")
#   SWEEP_CONFIGS  configurations also timed with each backward tile shape of SWEEP (default: none)
#   SWEEP          backward tile shapes "rows,lanes,warps,chunk[,tiles,hot_windows,sum_windows,sum_warps] ..."
#                  (kernels/backward.BackwardConfig; default: a few)
#   TESTS          pytest targets run first (default: the kernel and compile gpu tests); "" skips
#   PYTEST_ARGS    extra pytest flags (default -x); TESTS_TIMEOUT seconds for the tests (default 240)
#   STEPS, WARMUP  timed and warm-up steps per side (default 20, 8)
#   MOVER          our cache's row mover for the cached configurations (default: CacheConfig's)
#   STATE_LAYOUT   where our backing stores keep the optimizer state: separate (default) or with_rows
#   PROFILE=1      also profile each configuration (bench fbgemm --profile: kernels, copy-bandwidth fractions)
#   TRACE_CONFIGS  configurations also traced phase by phase, ours beside FBGEMM (tools/trace_step.py; default: none)
#   BENCH_ARGS     more bench fbgemm flags (e.g. --backward-one-launch)
#   SKIP_INSTALL=1 the project and wheels are installed already; auto: install unless a call on this machine did
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
source tools/gpu_install.sh
python3 -c "import tiered_tbe, tiered_tbe.kernels, tiered_tbe.cache, torch, triton; print(tiered_tbe.describe_mode(), \
torch.__version__, triton.__version__); from tiered_tbe.base.sorting import sort_backend; print('sort:', sort_backend('cuda'))" \
    || exit 1
python3 -c "import fbgemm_gpu; print('fbgemm_gpu', fbgemm_gpu.__version__)" 2>&1 | tail -1

TESTS=${TESTS-tests/test_forward.py tests/test_backward.py tests/test_backward_groups.py tests/test_graphs.py tests/test_compile_once.py tests/test_sorting.py}
if [[ -n $TESTS ]]; then
    # shellcheck disable=SC2086
    timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -m gpu -q ${PYTEST_ARGS--x} -p no:cacheprovider $TESTS \
        >"$OUT/gpu-tests.log" 2>&1
    echo "gpu tests: rc=$? $(tail -n 1 "$OUT/gpu-tests.log")"
fi
CONFIGS=${CONFIGS:-criteo-adagrad criteo-adagrad-z1.2 criteo-adagrad-fp16 criteo-sgd criteo-adam big-uniform-sgd \
big-uniform-adagrad big-zipf-sgd big-zipf-adagrad big-zipf-adagrad-fp16 cached-managed-lru cached-managed-lfu \
cached-managed-lru-pipelined}
# shellcheck disable=SC2086
python3 benchmarks/bench_fbgemm.py --configs $CONFIGS --steps "${STEPS:-20}" --warmup "${WARMUP:-8}" \
    ${MOVER:+--mover "$MOVER"} ${STATE_LAYOUT:+--state-layout "$STATE_LAYOUT"} ${PROFILE:+--profile} ${BENCH_ARGS:-} \
    --json "$OUT/bench_fbgemm.json" --record "$OUT/measurements.jsonl" 2>&1 | tee "$OUT/bench_fbgemm.log" \
    | grep -v -i "warn"
if [[ -n ${TRACE_CONFIGS:-} ]]; then
    # shellcheck disable=SC2086
    python3 tools/trace_step.py --configs $TRACE_CONFIGS 2>&1 | tee "$OUT/trace_step.log" | grep -v -i "warn"
fi
if [[ -n ${SWEEP_CONFIGS:-} ]]; then
    SWEEP=${SWEEP:-2,1,2,32 4,1,2,32 2,1,1,32 2,2,2,32 2,1,2,64 2,1,2,32,16,16,4,2}
    # shellcheck disable=SC2086
    python3 benchmarks/bench_fbgemm.py --configs $SWEEP_CONFIGS --steps "${STEPS:-20}" --warmup "${WARMUP:-8}" \
        --backward-configs $SWEEP --json "$OUT/bench_sweep.json" --record "$OUT/measurements.jsonl" 2>&1 \
        | tee "$OUT/bench_sweep.log" | grep -v -i "warn"
fi
