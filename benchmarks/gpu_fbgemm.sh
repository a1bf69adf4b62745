#!/usr/bin/env bash
# Ours beside FBGEMM_GPU on the lent H200, in one device call: unpack the FBGEMM peer (carried
# as .peer, see ../shared/peer/README.md), run the kernels' gpu-marked tests, then
# benchmarks/bench_fbgemm.py on the configurations asked for; logs and JSON under $OUT.
#
#   TIERED_TBE_COMMIT=<commit> OUT=$OUT bash benchmarks/gpu_fbgemm.sh
# Environment (all optional):
#   CONFIGS        bench_fbgemm configurations (default: the HBM ones and two cached ones)
#   SWEEP_CONFIGS  configurations also timed with each backward tile shape of SWEEP (default: none)
#   SWEEP          backward tile shapes "rows,lanes,warps,chunk[,tiles,hot_windows,sum_windows,sum_warps] ..."
#                  (kernels/backward.BackwardConfig; default: a few)
#   TESTS          pytest targets run first (default: the kernel and compile gpu tests); "" skips
#   PYTEST_ARGS    extra pytest flags (default -x); TESTS_TIMEOUT seconds for the tests (default 240)
#   STEPS, WARMUP  timed and warm-up steps per side (default 20, 8)
#   MOVER          our cache's row mover for the cached configurations (default: CacheConfig's)
#   STATE_LAYOUT   where our backing stores keep the optimizer state: separate (default) or with_rows
#   PROFILE=1      also profile each configuration (bench_fbgemm --profile: kernels, copy-bandwidth fractions)
#   HOST_SPLIT_CONFIGS configurations whose backward call's host time is split into its parts
#                  (benchmarks/host_split.py, FBGEMM's whole call beside ours; default: none)
#   STEADY_CONFIGS configurations also run as a plain training loop (benchmarks/steady_step.py; default: three
#                  small-step ones, where the host may be the bound; "" skips)
#   SKIP_INSTALL=1 the project and wheels are installed already
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
if [[ ${SKIP_INSTALL:-0} != 1 ]]; then
    # numpy 2.4 and cuda-cccl (CUB's sorts), when their archive was carried (benchmarks/pack_gpu_site.sh)
    if [[ -f .gpusite/site.tar.xz ]]; then
        mkdir -p /tmp/site && tar -xJf .gpusite/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
    fi
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
        || { cat "$OUT/install.log"; exit 1; }
    if [[ -d .peer ]]; then
        bash .peer/install-on-device.sh .peer >>"$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
        export PYTHONPATH=/tmp/fbsite:${PYTHONPATH:-}
    fi
fi
python3 -c "import tiered_tbe, tiered_tbe.kernels, tiered_tbe.cache, torch, triton; print(tiered_tbe.describe_mode(), \
torch.__version__, triton.__version__); from tiered_tbe.base.sorting import sort_backend; print('sort:', sort_backend('cuda'))" \
    || exit 1
python3 -c "import fbgemm_gpu; print('fbgemm_gpu', fbgemm_gpu.__version__)" 2>&1 | tail -1

TESTS=${TESTS-tests/test_kernels.py tests/test_graphs.py tests/test_compile_once.py tests/test_sorting.py}
if [[ -n $TESTS ]]; then
    # shellcheck disable=SC2086
    timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -m gpu -q ${PYTEST_ARGS--x} -p no:cacheprovider $TESTS \
        >"$OUT/gpu-tests.log" 2>&1
    echo "gpu tests: rc=$? $(tail -n 1 "$OUT/gpu-tests.log")"
fi
CONFIGS=${CONFIGS:-criteo-adagrad criteo-adagrad-z1.2 criteo-adagrad-fp16 criteo-sgd criteo-adam big-uniform-sgd \
big-uniform-adagrad big-zipf-sgd big-zipf-adagrad cached-lru cached-lfu cached-managed-lru \
cached-managed-lru-with-rows}
# shellcheck disable=SC2086
python3 benchmarks/bench_fbgemm.py --configs $CONFIGS --steps "${STEPS:-20}" --warmup "${WARMUP:-8}" \
    ${MOVER:+--mover "$MOVER"} ${STATE_LAYOUT:+--state-layout "$STATE_LAYOUT"} ${PROFILE:+--profile} --json "$OUT/bench_fbgemm.json" --record --results-file "$OUT/RESULTS-gpu.md" 2>&1 | tee "$OUT/bench_fbgemm.log" \
    | grep -v -i "warn"
STEADY_CONFIGS=${STEADY_CONFIGS-big-zipf-sgd criteo-adagrad criteo-adagrad-fp16}
if [[ -n $STEADY_CONFIGS ]]; then
    # shellcheck disable=SC2086
    python3 benchmarks/steady_step.py --configs $STEADY_CONFIGS 2>&1 | tee "$OUT/steady_step.log" | grep "^|"
fi
if [[ -n ${HOST_SPLIT_CONFIGS:-} ]]; then
    # shellcheck disable=SC2086
    python3 benchmarks/host_split.py --configs $HOST_SPLIT_CONFIGS --calls 20 2>&1 | tee "$OUT/host_split.log" \
        | grep -v -i "warn"
fi
if [[ -n ${SWEEP_CONFIGS:-} ]]; then
    SWEEP=${SWEEP:-2,1,2,32 4,1,2,32 2,1,1,32 2,2,2,32 2,1,2,64 2,1,2,32,16,16,4,2}
    # shellcheck disable=SC2086
    python3 benchmarks/bench_fbgemm.py --configs $SWEEP_CONFIGS --steps "${STEPS:-20}" --warmup "${WARMUP:-8}" \
        --backward-configs $SWEEP --json "$OUT/bench_sweep.json" --record --results-file "$OUT/RESULTS-gpu.md" 2>&1 \
        | tee "$OUT/bench_sweep.log" | grep -v -i "warn"
fi
