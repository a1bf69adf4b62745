#!/usr/bin/env bash
# Pack the Python packages a GPU machine without network access lacks into one small archive to
# copy there with the working tree: numpy 2.4 (numpy 2.5 breaks numba-cuda) and NVIDIA's
# cuda-cccl (CUB's radix sort for the backward's and the prefetch's sorts: base/sorting.py),
# the CUDA 13 build only, tests dropped: ~11.4 MiB from 22.6 MiB of wheels.
#
#   (a numpy 2.4 cp312 wheel in .whl/, e.g. pip download numpy==2.4.* -d .whl --only-binary=:all:)
#   bash tools/pack_gpu_site.sh                  # -> .gpusite/site.tar.xz
# On the device:  mkdir -p /tmp/site && tar -xJf .gpusite/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
CCCL_VERSION=${CCCL_VERSION:-1.2.1}
numpy_wheel=$(ls .whl/numpy-*-cp312-*.whl 2>/dev/null | head -n 1) \
    || { echo "no numpy cp312 wheel in .whl/: download one first"; exit 1; }
mkdir -p .gpusite/wheels
grep -qx "/.gpusite/" .git/info/exclude 2>/dev/null || echo "/.gpusite/" >> .git/info/exclude
cccl_wheel=.gpusite/wheels/cuda_cccl-$CCCL_VERSION-cp312-cp312-manylinux_2_26_x86_64.whl
[[ -f $cccl_wheel ]] || python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_26_x86_64 -d .gpusite/wheels "cuda-cccl==$CCCL_VERSION"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m zipfile -e "$numpy_wheel" "$work"
python3 -m zipfile -e "$cccl_wheel" "$work"
rm -rf "$work"/cuda/compute/cu12 "$work"/numpy/_core/tests "$work"/numpy/*/tests "$work"/numpy/tests "$work"/numpy/f2py
XZ_OPT=-9T2 tar -cJf .gpusite/site.tar.xz -C "$work" .
ls -l .gpusite/site.tar.xz
