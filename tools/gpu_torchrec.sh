#!/usr/bin/env bash
# tiered-tbe inside TorchRec on GPUs, in one device call or a few: unpack the FBGEMM peer with TorchRec
# (carried as .peer, see CONTRIBUTING.md), then the parts named in PARTS; logs and JSON lines under $OUT.
#
#   TIERED_TBE_COMMIT=<commit> OUT=$OUT bash tools/gpu_torchrec.sh
#   PARTS="scale" SKIP_INSTALL=1 OUT=$OUT bash tools/gpu_torchrec.sh      # a later call on the same machine
#
# Parts (PARTS, default "tests train bench vbe"; "scale" needs several GPUs and is in the default there):
#   tests  the gpu-marked TorchRec tests (NCCL; those of two GPUs skip on one): every plan against TorchRec's
#          FBGEMM kernels, 2 ranks against 1, checkpoints across world sizes, the prefetch pipeline
#   train  `tiered-tbe train --torchrec` under torchrun on NPROC GPUs, the prefetch pipeline
#   bench  `tiered-tbe bench torchrec` on NPROC GPUs (with --profile: the all-to-alls' share of the step), and
#          with several GPUs the same on 1 GPU: weak scaling, samples/s of all ranks, N GPUs against 1
#   scale  the same weak scaling with every table's rows x SCALE_ROWS (default 4: ~69 GB of Criteo tables,
#          fused_uvm_caching only: SCALE_CONFIGS, default "cached cached-prefetch")
#   vbe    the benchmark with a variable batch size per feature (--vbe; fused and cached)
# With several GPUs, tools/torchrec_scaling.py then pairs each N-GPU record with its 1-GPU one ($OUT/scaling.md).
# Environment (all optional):
#   TESTS          pytest targets of the tests part (default tests/test_torchrec.py)
#   TESTS_TIMEOUT  seconds for the tests (default 420)
#   CONFIGS        bench_torchrec configurations (default: fused cached cached-prefetch)
#   STEPS, WARMUP  timed and warm-up steps per side (default 120, 20)
#   NPROC          GPUs (ranks) (default: every GPU of the machine)
#   PROFILE=0      skip bench_torchrec --profile (on by default)
#   SKIP_INSTALL=1 the project and wheels are installed already (a later call on the same machine); auto:
#                  install unless a call on this machine did (tools/gpu_install.sh)
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
NEED_PEER=1 source tools/gpu_install.sh
python3 -c "import tiered_tbe, torch, torchrec, fbgemm_gpu; print(tiered_tbe.describe_mode(), 'torch', torch.__version__, \
'torchrec', torchrec.__version__, 'fbgemm_gpu', fbgemm_gpu.__version__, 'GPUs', torch.cuda.device_count())" 2>&1 | tail -1
NPROC=${NPROC:-$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")}
PARTS=${PARTS:-tests train bench vbe$([[ $NPROC -gt 1 ]] && echo " scale")}
part() { [[ " $PARTS " == *" $1 "* ]]; }

if part tests; then
    # shellcheck disable=SC2086
    timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest -m gpu -q -p no:cacheprovider -rs ${TESTS:-tests/test_torchrec.py} \
        >"$OUT/gpu-tests.log" 2>&1
    echo "gpu tests: rc=$? $(tail -n 1 "$OUT/gpu-tests.log")"
fi
if part train; then
    timeout 300 python3 -m torch.distributed.run --nproc-per-node "$NPROC" -m tiered_tbe train --torchrec --steps 60 \
        --torchrec-pipeline prefetch >"$OUT/train-torchrec.log" 2>&1
    echo "train --torchrec ($NPROC GPU(s), prefetch pipeline): rc=$? $(grep '^loss' "$OUT/train-torchrec.log")"
fi
bench() {  # bench <ranks> <log name> <bench_torchrec flags...>
    local ranks=$1 log=$2
    shift 2
    python3 -m torch.distributed.run --nproc-per-node "$ranks" -m tiered_tbe bench torchrec --steps "${STEPS:-120}" \
        --warmup "${WARMUP:-20}" --record "$OUT/bench_torchrec.jsonl" "$@" 2>&1 | tee "$OUT/$log" | grep -v -i "warn"
}
PROFILING=$([[ ${PROFILE:-1} == 1 ]] && echo --profile)
if part bench; then
    # shellcheck disable=SC2086
    bench "$NPROC" bench_torchrec.log --configs ${CONFIGS:-fused cached cached-prefetch} $PROFILING
    if [[ $NPROC -gt 1 ]]; then  # weak scaling: the same per-rank batch on one GPU
        # shellcheck disable=SC2086
        bench 1 bench_torchrec_1gpu.log --configs ${CONFIGS:-fused cached cached-prefetch}
    fi
fi
if part scale; then  # tables larger than a GPU's share of HBM, behind the caches, N GPUs and 1
    # shellcheck disable=SC2086
    bench "$NPROC" bench_torchrec_scaled.log --rows-scale "${SCALE_ROWS:-4}" \
        --configs ${SCALE_CONFIGS:-cached cached-prefetch} $PROFILING
    # shellcheck disable=SC2086
    bench 1 bench_torchrec_scaled_1gpu.log --rows-scale "${SCALE_ROWS:-4}" --configs ${SCALE_CONFIGS:-cached cached-prefetch}
fi
if part vbe; then
    bench "$NPROC" bench_torchrec_vbe.log --vbe --configs fused cached
fi
if [[ $NPROC -gt 1 && -f $OUT/bench_torchrec.jsonl ]]; then  # N GPUs against 1, both sides: a markdown table
    python3 tools/torchrec_scaling.py "$OUT/bench_torchrec.jsonl" | tee "$OUT/scaling.md"
fi
