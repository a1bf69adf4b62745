"""Launching the slot cache's Numba kernels on torch tensors, on torch's current stream.

Two jobs, kept out of the cache logic: turning torch tensors into what a Numba kernel takes
(a device array view on the GPU, a numpy view of the same memory in the CUDA simulator),
and launching grid-stride kernels on the stream torch's work is ordered on.
"""

from __future__ import annotations

import os

import torch

from tiered_tbe.base.mode import SIMULATION

# Threads per launch in the CUDA simulator, where each is a Python thread (~0.2 ms to start).
# The kernels are grid-stride loops, correct for any count; long CPU tests set 1 for speed
# (TIERED_TBE_SIMULATED_THREADS=1), the cache's own tests keep several so threads interleave.
# Read at every launch: tests may change it.
SIMULATED_THREADS = int(os.environ.get("TIERED_TBE_SIMULATED_THREADS", "32"))


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
        return device_array(tensor)

    def launch(self, kernel, num_items: int, *args) -> None:
        """Launch a 1-D grid-stride kernel over ``num_items`` entries."""
        self.launch_configured(kernel, *self.shape_of(num_items), *args)

    @staticmethod
    def shape_of(num_items: int, max_blocks: int = 65535, max_threads: int = 256) -> tuple[int, int]:
        """``(blocks, threads a block)`` of a 1-D grid-stride launch over ``num_items`` entries:
        blocks of ``max_threads`` on the GPU, one block of a few threads in the simulator."""
        if SIMULATION:
            return 1, max(1, min(num_items, SIMULATED_THREADS, max_threads))
        return max(1, min(-(-num_items // max_threads), max_blocks)), max_threads

    def launch_configured(self, kernel, grid, block, *args) -> None:
        """Launch ``kernel[grid, block]`` on torch's current stream; tensors become kernel arrays."""
        args = [self.array(a) if isinstance(a, torch.Tensor) else a for a in args]
        if SIMULATION:
            kernel[grid, block](*args)
            return
        from numba import cuda

        # torch's current stream, so the kernels are ordered with torch's work on it.
        pointer = torch.cuda.current_stream(self.device).cuda_stream
        if pointer != self._stream_pointer:
            self._stream_pointer, self._numba_stream = pointer, cuda.external_stream(pointer)
        with cuda.gpus[self.device.index if self.device.index is not None else torch.cuda.current_device()]:
            kernel[grid, block, self._numba_stream](*args)


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
