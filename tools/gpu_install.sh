# Sourced by the device scripts (gpu_fbgemm.sh, gpu_torchrec.sh) from the repository root, with OUT set:
# unpack numpy 2.4 and cuda-cccl (CUB's sorts) when their archive came with the tree (tools/pack_gpu_site.sh),
# install the project offline, and unpack the FBGEMM_GPU peer (and TorchRec's wheels) when .peer came too.
# NEED_PEER=1: a missing .peer is an error. SKIP_INSTALL=1: nothing to do. SKIP_INSTALL=auto: nothing to do where
# an earlier call on this machine installed (its mark in /tmp), else install: a call that may land on a warm
# machine or a fresh one (a fresh one has a numpy, but one numba-cuda cannot compile with).
INSTALLED_MARK=/tmp/tiered_tbe_installed
if [[ ${SKIP_INSTALL:-0} == auto ]]; then
    if [[ -f $INSTALLED_MARK ]]; then SKIP_INSTALL=1; else SKIP_INSTALL=0; fi
fi
if [[ ${SKIP_INSTALL:-0} != 1 ]]; then
    if [[ -f .gpusite/site.tar.xz ]]; then
        mkdir -p /tmp/site && tar -xJf .gpusite/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
    fi
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
        || { cat "$OUT/install.log"; exit 1; }
    if [[ -d .peer ]]; then
        bash .peer/install-on-device.sh .peer >>"$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
        export PYTHONPATH=/tmp/fbsite:${PYTHONPATH:-}
    elif [[ ${NEED_PEER:-0} == 1 ]]; then
        echo "no .peer: carry the FBGEMM_GPU peer archive with TorchRec's wheels (CONTRIBUTING.md)"; exit 1
    fi
    touch "$INSTALLED_MARK"
fi
# A later call on the same machine (SKIP_INSTALL=1) starts a fresh shell: find what an earlier one unpacked.
for site in /tmp/site /tmp/fbsite; do
    [[ -d $site && :${PYTHONPATH:-}: != *:$site:* ]] && export PYTHONPATH=$site:${PYTHONPATH:-}
done
# NVLink multicast stays off on the shared GPU hosts (NCCL, PyTorch's symmetric memory, NVSHMEM), also for the
# processes torchrun and mp.spawn start, which inherit these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
