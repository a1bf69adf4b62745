"""Declaring and launching the slot cache's Numba kernels on torch tensors, on torch's current stream.

Three jobs, kept out of the cache logic: declaring a kernel with numba's on-disk cache
(:func:`cached_kernel`), turning torch tensors into what a Numba kernel takes (a device array
view on the GPU, a numpy view of the same memory in the CUDA simulator), and launching
grid-stride kernels on the stream torch's work is ordered on.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import torch

from tiered_tbe.base import compiling
from tiered_tbe.base.mode import SIMULATION
from tiered_tbe.base.streams import device_index

# The sources the cache's GPU kernels are compiled from: the kernels, and the policy and descriptor
# definitions they call or read. Numba's on-disk cache checks a kernel's own file only: an edit of
# policy.py alone would keep running the kernels compiled before it. The cache folder is named by
# a hash of all of them (and numba-cuda's version), so any edit compiles afresh.
_PACKAGE = Path(__file__).resolve().parent
KERNEL_SOURCES = (_PACKAGE / "_kernels.py", _PACKAGE / "batch_kernels.py", _PACKAGE / "policy_kernels.py",
                  _PACKAGE / "policy.py", _PACKAGE.parent / "base" / "descriptors.py")


def kernel_cache_dir(sources=KERNEL_SOURCES) -> Path:
    """Where the cache's compiled Numba kernels are kept: ``$NUMBA_CACHE_DIR`` (else
    ``$XDG_CACHE_HOME/tiered-tbe/numba``, default ``~/.cache``) / ``tiered-tbe-<hash of the
    kernels' sources and numba-cuda's version>``."""
    root = os.environ.get("NUMBA_CACHE_DIR")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tiered-tbe" / "numba"
    stamps = tuple((str(source), os.stat(source).st_mtime_ns, os.stat(source).st_size) for source in sources)
    return Path(root) / f"tiered-tbe-{_sources_digest(stamps)}"


@functools.lru_cache(maxsize=8)
def _sources_digest(stamps: tuple[tuple[str, int, int], ...]) -> str:
    """The hash of the files ``stamps`` names (path, mtime, size: read again when a file changes)."""
    digest = hashlib.sha256()
    try:
        from importlib.metadata import version

        digest.update(version("numba-cuda").encode())
    except Exception:  # not installed as a distribution: the sources alone
        pass
    for source, _, _ in stamps:
        digest.update(Path(source).read_bytes())
    return digest.hexdigest()[:16]


def cached_kernel(function):
    """``numba.cuda.jit(function)`` with numba's on-disk cache in :func:`kernel_cache_dir`: a new
    process loads the kernels an earlier one compiled (each took ~1 s to compile on the H200
    machine) instead of compiling them again. The simulator compiles nothing: a plain kernel."""
    import numba
    from numba import cuda

    if numba.config.ENABLE_CUDASIM:  # (not SIMULATION: compile_cache_kernels.py compiles for a GPU without one)
        return cuda.jit(function)
    settings = _numba_configs()
    saved = [config.CACHE_DIR for config in settings]
    folder = str(kernel_cache_dir())
    try:
        for config in settings:  # read by numba's cache locator when the kernel is declared, and only then
            config.CACHE_DIR = folder
        return cuda.jit(cache=True)(function)
    except RuntimeError:  # no folder numba can write: compiled in each process, as without the cache
        return cuda.jit(function)
    finally:
        for config, value in zip(settings, saved):
            config.CACHE_DIR = value


def _numba_configs() -> list:
    """numba's configuration modules whose CACHE_DIR the CUDA cache locator may read (numba-cuda
    0.30 has its own, older versions read numba's)."""
    import numba.core.config

    configs = [numba.core.config]
    try:
        import numba.cuda.core.config

        if numba.cuda.core.config is not numba.core.config:
            configs.append(numba.cuda.core.config)
    except ImportError:
        pass
    return configs


def _count_compiles(kernel) -> None:
    """Tell :mod:`tiered_tbe.base.compiling` what ``kernel`` compiled or loaded from disk since it
    was last asked (its new overloads' cache misses and hits)."""
    stats = kernel.stats
    misses, hits = sum(stats.cache_misses.values()), sum(stats.cache_hits.values())
    seen_misses, seen_hits = _COUNTED.get(kernel, (0, 0))
    _COUNTED[kernel] = misses, hits
    compiling.count("numba", compiled=misses - seen_misses, loaded=hits - seen_hits)


_COUNTED: dict = {}

# Threads per launch in the CUDA simulator, where each is a Python thread (~0.2 ms to start).
# The kernels are grid-stride loops, correct for any count; long CPU tests set 1 for speed
# (TIERED_TBE_SIMULATED_THREADS=1), the cache's own tests keep several so threads interleave.
# Read at every launch: tests may change it.
SIMULATED_THREADS = int(os.environ.get("TIERED_TBE_SIMULATED_THREADS", "32"))
# Simulated threads of a kernel that calls device functions in its inner loop (the policy's ranks):
# the simulator takes a global lock at every device-function call, and with 32 threads polled by a
# main thread that never sleeps each handoff waited out a GIL switch interval. A prefetch of 100 rows
# into 16 sets of 16 ways took 11-44 s with 32 threads, 0.5 s with one (2-core machine).
DEVICE_CALL_THREADS = 2


class KernelLauncher:
    """Launches Numba kernels for one device on torch's current stream of that device."""

    def __init__(self, device: torch.device):
        self.device = device
        self._stream_pointer = None
        self._numba_stream = None

    def array(self, tensor: torch.Tensor):
        """What a Numba kernel takes for ``tensor``: a device array view on the GPU (see
        :func:`device_array`), a simulator device array over a numpy view (same memory) in the
        CUDA simulator."""
        if SIMULATION:
            # A simulator device array over the numpy view: a plain numpy argument is copied in
            # and written back after the launch, so two arguments over the same memory (a row's
            # weights and its state in one buffer: state_layout="with_rows") would lose writes.
            from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

            return FakeCUDAArray(tensor.detach().numpy())
        from numba import cuda

        with cuda.gpus[device_index(self.device)]:  # (see launch_configured)
            return device_array(tensor)

    def launch(self, kernel, num_items: int, *args) -> None:
        """Launch a 1-D grid-stride kernel over ``num_items`` entries."""
        self.launch_configured(kernel, *self.shape_of(num_items), *args)

    @staticmethod
    def shape_of(num_items: int, max_blocks: int = 65535, max_threads: int = 256,
                 simulated_threads: int | None = None) -> tuple[int, int]:
        """``(blocks, threads a block)`` of a 1-D grid-stride launch over ``num_items`` entries:
        blocks of ``max_threads`` on the GPU, one block of a few threads in the simulator (at most
        ``simulated_threads`` when given: see ``DEVICE_CALL_THREADS``)."""
        if SIMULATION:
            most = SIMULATED_THREADS if simulated_threads is None else min(SIMULATED_THREADS, simulated_threads)
            return 1, max(1, min(num_items, most, max_threads))
        return max(1, min(-(-num_items // max_threads), max_blocks)), max_threads

    def launch_configured(self, kernel, grid, block, *args) -> None:
        """Launch ``kernel[grid, block]`` on torch's current stream; tensors become kernel arrays."""
        if SIMULATION:
            kernel[grid, block](*(self.array(a) if isinstance(a, torch.Tensor) else a for a in args))
            return
        from numba import cuda

        known = len(kernel.overloads)
        # Numba binds streams and arrays to its current context: this device's, also in a process that drives
        # several GPUs or on a thread where another device is current (no context is made on GPU 0 for them).
        with cuda.gpus[device_index(self.device)]:
            args = [device_array(a) if isinstance(a, torch.Tensor) else a for a in args]
            # torch's current stream, so the kernels are ordered with torch's work on it.
            pointer = torch.cuda.current_stream(self.device).cuda_stream
            if pointer != self._stream_pointer:
                self._stream_pointer, self._numba_stream = pointer, cuda.external_stream(pointer)
            kernel[grid, block, self._numba_stream](*args)
        if len(kernel.overloads) != known:  # compiled or loaded for these argument types
            _count_compiles(kernel)


# Numba device-array views of torch tensors, by (address, shape, strides, dtype). Building one
# (``numba.cuda.as_cuda_array``) costs ~14 us of host time on an H200 machine, and a prefetch
# converts a dozen temporaries; torch's caching allocator hands the same addresses out step
# after step, so most are found here. The views do not own their memory: each is used only for
# a launch whose caller holds the tensor.
_DEVICE_ARRAYS: dict[tuple, object] = {}
_DEVICE_ARRAYS_MAX = 1024
_TYPESTR = {torch.int64: "<i8", torch.int32: "<i4", torch.int16: "<i2", torch.int8: "|i1", torch.uint8: "|u1",
            torch.bool: "|b1", torch.float32: "<f4", torch.float64: "<f8", torch.float16: "<f2"}


def device_array(tensor: torch.Tensor):
    """A Numba device array over ``tensor``'s memory (no copy, no ownership, no sync)."""
    key = (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype, tensor.device.index)
    array = _DEVICE_ARRAYS.get(key)
    if array is None:
        from numba import cuda

        if len(_DEVICE_ARRAYS) >= _DEVICE_ARRAYS_MAX:
            _DEVICE_ARRAYS.clear()
        item = tensor.element_size()
        interface = {"shape": tuple(tensor.shape), "strides": tuple(s * item for s in tensor.stride()),
                     "typestr": _TYPESTR[tensor.dtype], "data": (tensor.data_ptr(), False), "version": 3}
        array = _DEVICE_ARRAYS[key] = cuda.from_cuda_array_interface(interface, owner=None, sync=False)
    return array


def flat_view(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """1-D ``dtype`` view of the whole buffer (untyped storage) under ``tensor``."""
    storage = tensor.untyped_storage()
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.empty(0, dtype=dtype, device=tensor.device).set_(storage, 0, (storage.nbytes() // size,))
