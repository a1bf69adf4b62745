#!/usr/bin/env bash
# tiered-tbe inside TorchRec on an H200, in one device call: unpack the FBGEMM peer with TorchRec
# 1.6.1 (carried as .peer, see CONTRIBUTING.md), run
# the gpu-marked TorchRec tests (NCCL; those of two GPUs skip on one), `tiered-tbe train --torchrec` under
# torchrun on every GPU, then
# `tiered-tbe bench torchrec`; logs and JSON lines under $OUT.
#
#   TIERED_TBE_COMMIT=<commit> OUT=$OUT bash tools/gpu_torchrec.sh
# Environment (all optional):
#   TESTS          pytest targets run first (default tests/test_torchrec.py); "" skips
#   TESTS_TIMEOUT  seconds for the tests (default 300)
#   CONFIGS        bench_torchrec configurations (default: fused cached cached-prefetch)
#   STEPS, WARMUP  timed and warm-up steps per side (default 120, 20)
#   NPROC          GPUs (ranks) for the training job and the benchmark (default: every GPU of the machine);
#                  above 1 the benchmark runs on 1 GPU too, for weak scaling (samples/s, N against 1)
#   PROFILE=0      skip bench_torchrec --profile (on by default)
#   VBE=0          skip the second benchmark run with a variable batch size per feature (--vbe; fused and cached)
#   SKIP_INSTALL=1 the project and wheels are installed already
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
NEED_PEER=1 source tools/gpu_install.sh
python3 -c "import tiered_tbe, torch, torchrec, fbgemm_gpu; print(tiered_tbe.describe_mode(), 'torch', torch.__version__, \
'torchrec', torchrec.__version__, 'fbgemm_gpu', fbgemm_gpu.__version__)" 2>&1 | tail -1

TESTS=${TESTS-tests/test_torchrec.py}
if [[ -n $TESTS ]]; then
    # shellcheck disable=SC2086
    timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -m gpu -q -p no:cacheprovider $TESTS >"$OUT/gpu-tests.log" 2>&1
    echo "gpu tests: rc=$? $(tail -n 1 "$OUT/gpu-tests.log")"
fi
NPROC=${NPROC:-$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")}
timeout 300 python3 -m torch.distributed.run --nproc-per-node "$NPROC" -m tiered_tbe train --torchrec --steps 60 \
    --torchrec-pipeline prefetch >"$OUT/train-torchrec.log" 2>&1
echo "train --torchrec ($NPROC GPU(s), prefetch pipeline): rc=$? $(grep '^loss' "$OUT/train-torchrec.log")"
bench() {  # bench <ranks> <log name> <bench_torchrec flags...>
    local ranks=$1 log=$2
    shift 2
    python3 -m torch.distributed.run --nproc-per-node "$ranks" -m tiered_tbe bench torchrec --steps "${STEPS:-120}" \
        --warmup "${WARMUP:-20}" --record "$OUT/bench_torchrec.jsonl" "$@" 2>&1 | tee "$OUT/$log" | grep -v -i "warn"
}
# shellcheck disable=SC2086
bench "$NPROC" bench_torchrec.log --configs ${CONFIGS:-fused cached cached-prefetch} \
    $([[ ${PROFILE:-1} == 1 ]] && echo --profile)
if [[ $NPROC -gt 1 ]]; then  # weak scaling: the same per-rank batch on one GPU
    # shellcheck disable=SC2086
    bench 1 bench_torchrec_1gpu.log --configs ${CONFIGS:-fused cached cached-prefetch}
fi
if [[ ${VBE:-1} == 1 ]]; then
    bench "$NPROC" bench_torchrec_vbe.log --vbe --configs fused cached
fi
