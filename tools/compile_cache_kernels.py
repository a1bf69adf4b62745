"""Compile the slot cache's Numba kernels for a GPU on a machine without one, and report them.

The CUDA simulator runs the cache's kernels as Python: it never types them for the GPU, so a
kernel can pass every CPU test and still fail to compile on the H200. This script records the
argument types of every launch a small cache makes in simulation (a child process: prefetches
of int32 and int64 rows under every policy of the registry (lookahead with hints), both movers, unlock with and
without dirty marks, flush, write-back, lookup), then compiles each kernel for each recorded
signature with numba-cuda's compiler (NVVM; no driver, nothing launched) and prints its PTX
size and whether it spills to local memory.

    python tools/compile_cache_kernels.py             # sm_90 (H100 / H200)
    python tools/compile_cache_kernels.py --arch 80

NVVM comes with ``pip install nvidia-cuda-nvcc-cu12 nvidia-cuda-nvrtc-cu12`` (not a project
dependency: only this check needs it on a machine without CUDA).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys

RECORD_FLAG = "--record-launches"


def record_launches() -> list[dict]:
    """In simulation: drive a small cache through every operation; the distinct kernel signatures."""
    import numpy as np
    import torch

    from tiered_tbe.cache import CachedTable, SlotCache, launch
    from tiered_tbe.cache.policy import POLICIES

    seen: dict[tuple, dict] = {}
    launch_configured = launch.KernelLauncher.launch_configured

    def describe(arg):
        if isinstance(arg, torch.Tensor):
            return ["array", str(arg.dtype).removeprefix("torch."), arg.dim(), "C" if arg.is_contiguous() else "A"]
        arg = getattr(arg, "_ary", arg)  # a simulator device array: its numpy view
        if isinstance(arg, np.ndarray):  # a kernel view made once (the cache's per-slot tensors)
            return ["array", arg.dtype.name, arg.ndim, "C" if arg.flags.c_contiguous else "A"]
        if isinstance(arg, bool | np.bool_):
            return ["boolean"]
        if isinstance(arg, int | np.integer):
            return ["int64"]
        raise TypeError(f"unexpected kernel argument {type(arg).__name__}")

    def recording(self, kernel, grid, block, *args):
        function = kernel.py_func
        entry = {"module": function.__module__, "kernel": function.__name__, "args": [describe(a) for a in args]}
        seen.setdefault(json.dumps(entry, sort_keys=True), entry)
        return launch_configured(self, kernel, grid, block, *args)

    launch.KernelLauncher.launch_configured = recording
    try:
        for policy in POLICIES:
            for mover in ("zero_copy", "staged"):
                tables = [CachedTable(0, 40, 4, torch.randn(40, 4), torch.randn(40, 2)),
                          CachedTable(50, 30, 6, torch.randn(30, 6), None)]
                if mover == "zero_copy" and policy == "lru":  # one buffer for both: the one-launch moves
                    weights, state = torch.randn(40 * 4 + 30 * 6), torch.randn(40 * 2 + 30 * 2)
                    tables = [CachedTable(0, 40, 4, weights[:160].view(40, 4), state[:80].view(40, 2)),
                              CachedTable(50, 30, 6, weights[160:].view(30, 6), state[80:].view(30, 2))]
                cache = SlotCache(tables, num_slots=8, associativity=4, policy=policy, mover=mover)
                if POLICIES[policy].reads_window:
                    cache.add_upcoming(torch.tensor([1, 2, 55]), cache.step + 2)
                first = cache.prefetch(torch.tensor([1, 2, 2, 55, 45, 79, 3, 4, 5, 6, 7]))
                cache.wait_filled(first)
                second = cache.prefetch(torch.tensor([9, 10, 11, 12, 13, 60], dtype=torch.int32))
                cache.wait_filled(second)
                cache.mark_dirty(first)
                cache.unlock(first)
                cache.unlock(second, mark_dirty=True)
                cache.lookup(torch.tensor([1, 60]))
                cache.write_back(torch.tensor([0, 1, -1], dtype=torch.int32))
                cache.flush()
                cache.close()
    finally:  # the recording is for this drive only, not for whoever launches next in the process
        launch.KernelLauncher.launch_configured = launch_configured
    return list(seen.values())


def numba_type(description):
    import numpy as np
    from numba import from_dtype, types

    if description[0] == "array":
        _, dtype, ndim, layout = description
        return types.Array(from_dtype(np.dtype(dtype)), ndim, layout)
    return getattr(types, description[0])


def compile_recorded(launches: list[dict], arch: int) -> list[dict]:
    """Compile each recorded signature for ``sm_<arch>``; one report per signature."""
    from numba import cuda
    from numba.cuda import dispatcher

    class Target:  # what device functions ask the driver for, which a machine without a GPU lacks
        compute_capability = (arch // 10, arch % 10)

    dispatcher.get_current_device = Target
    reports = []
    for entry in launches:
        kernel = getattr(importlib.import_module(entry["module"]), entry["kernel"])
        signature = tuple(numba_type(d) for d in entry["args"])
        ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(arch // 10, arch % 10))
        reports.append({"kernel": entry["kernel"], "signature": ", ".join(str(t) for t in signature),
                        "ptx_bytes": len(ptx), "local_memory": ".local" in ptx})
    return reports


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: H100/H200)")
    parser.add_argument(RECORD_FLAG, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.record_launches:  # the child: simulation mode, set by the parent's environment
        print(json.dumps(record_launches()))
        return 0
    child_env = dict(os.environ, TIERED_TBE_SIMULATE="1", TIERED_TBE_SIMULATED_THREADS="1")
    child = subprocess.run([sys.executable, __file__, RECORD_FLAG], env=child_env, capture_output=True, text=True)
    if child.returncode != 0:
        sys.stderr.write(child.stderr)
        return child.returncode
    launches = json.loads(child.stdout.strip().splitlines()[-1])
    # This process compiles for the GPU: no simulator, and tiered_tbe told it only compiles.
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
    os.environ["TIERED_TBE_COMPILE_ONLY"] = "1"
    import tiered_tbe  # noqa: F401  (before numba.cuda loads)

    reports = compile_recorded(launches, args.arch)
    for report in sorted(reports, key=lambda r: r["kernel"]):
        spill = "  LOCAL MEMORY" if report["local_memory"] else ""
        print(f"{report['kernel']:<28} {report['ptx_bytes']:>7} bytes of PTX{spill}  ({report['signature']})")
    print(f"{len(reports)} signatures of {len({r['kernel'] for r in reports})} kernels compiled for sm_{args.arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
