#!/usr/bin/env bash
# Compile the Triton kernels (tools/compile_kernels.py: registers, shared memory, 16-byte loads)
# with the Triton the GPU machine runs, not the one installed here: the two lay out tiles and keep
# alignment hints differently (docs/PITFALLS.md), so a check made with a newer local Triton can
# say the opposite of what the device compiles. Needs pip's network once; nothing runs on a GPU.
#
#   bash tools/compile_like_device.sh [compile_kernels.py arguments]
#   TIERED_TBE_BACKWARD=2,8,2,32 bash tools/compile_like_device.sh --optimizers sgd
# Environment: TRITON_VERSION (default 3.6.0, the H200 machine's in results/measurements.jsonl), TRITON_DIR.
set -euo pipefail
version=${TRITON_VERSION:-3.6.0}
dir=${TRITON_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tiered-tbe/triton-$version}
if [[ ! -d $dir/triton ]]; then
    python3 -m pip install -q --no-deps --target "$dir" "triton==$version"
fi
PYTHONPATH=$dir${PYTHONPATH:+:$PYTHONPATH} exec python3 "$(dirname "$0")/compile_kernels.py" "$@"
