"""Backing stores: one flat allocation per tier, exposed as a tensor the GPU reads and writes in place.

=========  ==============================================================================
DEVICE     ``torch.empty`` in GPU memory.
HOST       pinned host memory of exactly the size asked (``cudaHostAlloc``; torch's pinned
           allocator rounds up to a power of two, so a 70 GB table would take 128 GB), mapped
           into the GPU's address space and exposed as a CUDA tensor over the same memory:
           Triton kernels, Numba kernels and torch indexing read it in place over the bus.
MANAGED    CUDA unified memory (``cudaMallocManaged``) advised to stay on the host
           (``SetPreferredLocation`` = host) and to be mapped for the GPU and the CPU
           (``SetAccessedBy`` both), so the GPU reads it in place instead of migrating pages
           and the host's copies do not fault; exposed as a CUDA tensor.
=========  ==============================================================================

In simulation mode, or for ``device="cpu"``, every tier is a plain CPU tensor.

How ``HOST``'s pinned memory is made (``TIERED_TBE_HOST_MEMORY``, read at each allocation; one of
:data:`HOST_MEMORY_KINDS`): ``host_alloc`` (default, ``cudaHostAlloc``), or anonymous memory mapped
by the process, advised into 4 KiB pages (``registered``) or 2 MiB transparent huge pages
(``registered_huge_pages``) and pinned with ``cudaHostRegister``. SM reads and writes of scattered
rows in place ran ~3x faster out of managed memory than out of ``cudaHostAlloc`` memory on the
H200 machine; whether the pages' size is why is what ``tools/bench_host_memory.py`` measures.

Who first touches a ``MANAGED`` store's pages (``TIERED_TBE_MANAGED_FIRST_TOUCH``): ``device`` (default)
or ``host``, which zeroes the store from the host as it is made. On an H100 machine the GPU gathered
scattered 64- and 128-byte rows 1.2-1.4x faster from managed memory the host had written first
(``tools/bench_host_memory.py``, ``managed_host_written``; 256 bytes and up, and scatters, alike).

The CUDA calls go through ``cuda.bindings.runtime`` (installed with ``numba-cuda[cu13]``);
pinned host memory falls back to CuPy when the bindings are missing. (CuPy's memory advice
builds the host location wrongly on CUDA 13, so managed memory needs the bindings.)
"""

from __future__ import annotations

import ctypes
import os

import torch

from tiered_tbe.base.codes import Placement
from tiered_tbe.base.mode import SIMULATION


class TierBuffer:
    """A flat backing-store allocation of ``numel`` elements of ``dtype``.

    ``tensor`` is a 1-D tensor over the whole allocation (a CUDA tensor for every GPU tier,
    even when the memory is on the host). ``owner`` is the object that frees pinned or managed
    memory when it goes (None for torch's own allocations); the tensor and every view of it
    hold a reference to it, so the memory lives as long as any of them does. :meth:`release`
    drops this object's references.
    """

    def __init__(self, placement: Placement, tensor: torch.Tensor, owner: object | None = None):
        self.placement = placement
        self.tensor: torch.Tensor | None = tensor
        self.owner = owner

    @property
    def nbytes(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel() * self.tensor.element_size()

    def release(self) -> None:
        """Drop this buffer's references; the memory is freed once no view of it remains."""
        self.tensor = None
        self.owner = None

    def __repr__(self) -> str:
        if self.tensor is None:
            return f"TierBuffer({self.placement.name}, released)"
        where = f"{self.tensor.numel()} x {self.tensor.dtype} on {self.tensor.device}"
        return f"TierBuffer({self.placement.name}, {where})"


def allocate(placement_backing: Placement, numel: int, dtype: torch.dtype,
             device: torch.device | str | None = None) -> TierBuffer:
    """Allocate a flat backing store of ``numel`` elements (uninitialized) in one tier.

    Args:
        placement_backing: ``DEVICE``, ``HOST`` or ``MANAGED`` (a cached placement means its
            backing store: ``HOST_CACHED`` -> ``HOST``).
        numel: elements to allocate.
        dtype: element type.
        device: the GPU that reads the store (``cuda`` / ``cuda:1``); ``cpu`` (and simulation
            mode) gives a plain CPU tensor for every tier. Default ``tiered_tbe.default_device()``.

    Returns:
        A TierBuffer whose ``.tensor`` is 1-D [numel] of ``dtype``.

    Example::

        store = allocate(Placement.HOST, 200_000_000 * 128, torch.float32, "cuda")
        table = store.tensor.view(200_000_000, 128)   # a CUDA tensor over pinned host memory
    """
    from tiered_tbe.base.mode import default_device

    placement = Placement(placement_backing).backing
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    device = torch.device(device) if device is not None else default_device()
    if SIMULATION or device.type == "cpu":
        return TierBuffer(placement, torch.empty(numel, dtype=dtype))
    if device.type != "cuda":
        raise ValueError(f"backing stores live on cuda or cpu, not {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    cuda_device = torch.device("cuda", index)
    if placement is Placement.DEVICE:
        return TierBuffer(placement, torch.empty(numel, dtype=dtype, device=cuda_device))

    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return TierBuffer(placement, torch.empty(0, dtype=dtype, device=cuda_device))
    with torch.cuda.device(index):
        torch.cuda.init()  # the primary context the runtime calls below use
        if placement is Placement.HOST:
            memory = _pinned_host_memory(nbytes)
        else:
            memory = _managed_memory(nbytes, index)
        # torch keeps `memory` alive as long as the tensor (or any view) lives, and reads the
        # pointer's device from the driver: pinned and managed memory become CUDA tensors.
        tensor = torch.as_tensor(memory, device=cuda_device)
        if placement is Placement.MANAGED and managed_first_touch() == "host":
            host_view(tensor).zero_()  # the host places every page before any kernel touches one
    return TierBuffer(placement, tensor.view(dtype), owner=memory)


class _CudaMemory:
    """Raw CUDA-addressable bytes, shown to torch through ``__cuda_array_interface__``; freed
    (with ``free``) when the last reference goes."""

    def __init__(self, pointer: int, nbytes: int, free, what: str):
        self.pointer = pointer
        self.nbytes = nbytes
        self.what = what
        self._free = free
        # One flat byte array; the caller views it as its dtype (bf16 has no typestr).
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (pointer, False), "version": 3,
            "strides": None, "stream": None,
        }

    def __del__(self):
        free, self._free = self._free, None
        if free is not None:
            try:
                free(self.pointer)
            except Exception:  # noqa: BLE001 - interpreter shutdown may have unloaded CUDA
                pass


def host_view(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over the same memory as ``tensor`` (same shape, strides and dtype), for the
    host to read and write a backing store that the GPU also sees: ``tensor`` itself when it is
    a CPU tensor; for a CUDA tensor over pinned host memory (``HOST``) or managed memory
    (``MANAGED``), a view through the memory's host address. ``ValueError`` for GPU memory.

    The view does not keep the memory alive: the caller holds ``tensor`` (or its buffer).
    """
    if tensor.device.type == "cpu":
        return tensor
    storage = tensor.untyped_storage()
    base = _host_address(storage.data_ptr())
    flat = torch.frombuffer((ctypes.c_uint8 * storage.nbytes()).from_address(base), dtype=torch.uint8)
    return flat.view(tensor.dtype).as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


def is_pinned_host_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (a CUDA tensor) lies in pinned host memory (``HOST``), not managed or device
    memory. False for CPU tensors (simulation) and when no CUDA runtime binding imports."""
    if tensor.device.type != "cuda":
        return False
    runtime = _runtime()
    if runtime is not None:
        attributes = _check(runtime, runtime.cudaPointerGetAttributes(tensor.data_ptr()), "cudaPointerGetAttributes")
        return attributes.type == runtime.cudaMemoryType.cudaMemoryTypeHost
    cupy = _cupy()
    if cupy is not None:
        return cupy.cuda.runtime.pointerGetAttributes(tensor.data_ptr()).type == 1  # cudaMemoryTypeHost
    return False


def _host_address(device_pointer: int) -> int:
    """The host address of CUDA-addressable memory at ``device_pointer`` (pinned host or managed)."""
    runtime = _runtime()
    if runtime is not None:
        attributes = _check(runtime, runtime.cudaPointerGetAttributes(device_pointer), "cudaPointerGetAttributes")
        kinds = runtime.cudaMemoryType
        kind, host = attributes.type, int(attributes.hostPointer or 0)
        if kind not in (kinds.cudaMemoryTypeHost, kinds.cudaMemoryTypeManaged) or not host:
            raise ValueError(f"memory at {device_pointer:#x} is {kind.name}: the host cannot read it (the staged "
                             "mover needs a backing store in pinned host or managed memory)")
        return host
    cupy = _cupy()
    if cupy is not None:
        attributes = cupy.cuda.runtime.pointerGetAttributes(device_pointer)
        if attributes.type not in (1, 3) or not attributes.hostPointer:  # cudaMemoryTypeHost, cudaMemoryTypeManaged
            raise ValueError(f"memory at {device_pointer:#x} (type {attributes.type}) is not readable by the host")
        return int(attributes.hostPointer)
    raise RuntimeError("the staged mover needs cuda-bindings or CuPy to find the host address of a backing store")


def _runtime():
    """``cuda.bindings.runtime`` (cuda-bindings >= 12.6; older: ``cuda.cudart``), or None."""
    try:
        from cuda.bindings import runtime
        return runtime
    except ImportError:
        pass
    try:
        from cuda import cudart
        return cudart
    except ImportError:
        return None


def _cupy():
    try:
        import cupy
    except ImportError:
        return None
    return cupy if cupy.cuda.is_available() else None


def _check(runtime, result, call: str):
    """Unpack a cuda-bindings result tuple ``(err, *values)``; raise on an error."""
    err, *values = result
    if err != runtime.cudaError_t.cudaSuccess:
        _, message = runtime.cudaGetErrorString(err)
        raise RuntimeError(f"{call} failed: {err.name}: {message.decode() if isinstance(message, bytes) else message}")
    return values[0] if len(values) == 1 else values


HOST_MEMORY_KINDS = ("host_alloc", "registered", "registered_huge_pages")
# Who first touches each page of a MANAGED store (TIERED_TBE_MANAGED_FIRST_TOUCH, read at each allocation).
MANAGED_FIRST_TOUCHES = ("device", "host")
HUGE_PAGE_BYTES = 2 << 20  # an x86-64 transparent huge page


def host_memory_kind() -> str:
    """How ``HOST`` memory is allocated: ``$TIERED_TBE_HOST_MEMORY``, default ``host_alloc``."""
    return _setting("TIERED_TBE_HOST_MEMORY", HOST_MEMORY_KINDS)


def managed_first_touch() -> str:
    """Who first touches the pages of ``MANAGED`` memory: ``$TIERED_TBE_MANAGED_FIRST_TOUCH``, ``device``
    (default: the pages are placed as kernels first reach them, a module's initialization) or ``host``
    (the host zeroes the store as it is made, placing every page)."""
    return _setting("TIERED_TBE_MANAGED_FIRST_TOUCH", MANAGED_FIRST_TOUCHES)


def _setting(variable: str, choices: tuple[str, ...]) -> str:
    """The environment variable ``variable``, one of ``choices`` (default: the first), checked."""
    return _checked_choice(os.environ.get(variable, choices[0]), choices, f"{variable}=")


def _checked_choice(value: str, choices: tuple[str, ...], named: str) -> str:
    if value not in choices:
        raise ValueError(f"{named}{value!r}: choose one of {', '.join(choices)}")
    return value


def _pinned_host_memory(nbytes: int, kind: str | None = None) -> _CudaMemory:
    """``nbytes`` of pinned host memory mapped for the GPU, made the ``kind`` way (default
    :func:`host_memory_kind`)."""
    kind = host_memory_kind() if kind is None else _checked_choice(kind, HOST_MEMORY_KINDS, "host memory kind ")
    runtime = _runtime()
    if kind != "host_alloc":
        if runtime is None:
            raise RuntimeError(f"host memory kind {kind!r} needs cuda-bindings (pip install 'numba-cuda[cu13]')")
        return _registered_host_memory(runtime, nbytes, huge_pages=kind == "registered_huge_pages")
    if runtime is not None:
        flags = runtime.cudaHostAllocMapped | runtime.cudaHostAllocPortable
        host_pointer = _check(runtime, runtime.cudaHostAlloc(nbytes, flags), f"cudaHostAlloc({nbytes} bytes)")
        device_pointer = _check(runtime, runtime.cudaHostGetDevicePointer(host_pointer, 0), "cudaHostGetDevicePointer")
        return _CudaMemory(int(device_pointer), nbytes,
                           lambda _: runtime.cudaFreeHost(host_pointer), "pinned host")
    cupy = _cupy()
    if cupy is not None:
        rt = cupy.cuda.runtime
        host_pointer = rt.hostAlloc(nbytes, rt.hostAllocMapped | rt.hostAllocPortable)
        return _CudaMemory(int(rt.hostGetDevicePointer(host_pointer, 0)), nbytes,
                           lambda _: rt.freeHost(host_pointer), "pinned host")
    raise RuntimeError("Placement.HOST needs cuda-bindings (pip install 'numba-cuda[cu13]' or "
                       "'cuda-bindings') or CuPy (pip install cupy-cuda13x) to allocate pinned host memory "
                       "of exact size")


_MADV_HUGEPAGE, _MADV_NOHUGEPAGE = 14, 15  # linux/mman.h
_PROT_READ_WRITE, _MAP_PRIVATE_ANONYMOUS = 0x1 | 0x2, 0x02 | 0x20


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def map_host_memory(nbytes: int, huge_pages: bool) -> tuple[int, int]:
    """``(address, length)`` of ``nbytes`` (rounded up to 2 MiB) of anonymous memory this process maps
    at a 2 MiB boundary, advised into transparent huge pages (``huge_pages``) or out of them (4 KiB
    pages). Nothing is touched yet; :func:`unmap_host_memory` gives it back."""
    libc = _libc()
    length = -(-max(nbytes, 1) // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    # One huge page more than asked, then the ends trimmed: a huge page needs an aligned 2 MiB range.
    mapped = libc.mmap(None, length + HUGE_PAGE_BYTES, _PROT_READ_WRITE, _MAP_PRIVATE_ANONYMOUS, -1, 0)
    if mapped in (None, ctypes.c_void_p(-1).value):
        raise MemoryError(f"mmap of {length + HUGE_PAGE_BYTES} bytes failed (errno {ctypes.get_errno()})")
    start = -(-mapped // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    if start > mapped:
        libc.munmap(mapped, start - mapped)
    libc.munmap(start + length, mapped + HUGE_PAGE_BYTES - start)
    if libc.madvise(start, length, _MADV_HUGEPAGE if huge_pages else _MADV_NOHUGEPAGE) != 0:
        error = ctypes.get_errno()
        libc.munmap(start, length)
        raise OSError(error, f"madvise into {'huge' if huge_pages else '4 KiB'} pages failed")
    return start, length


def unmap_host_memory(address: int, length: int) -> None:
    _libc().munmap(address, length)


def _registered_host_memory(runtime, nbytes: int, huge_pages: bool) -> _CudaMemory:
    """:func:`map_host_memory`, then pinned and mapped for the GPU with ``cudaHostRegister`` (which
    faults every page in). Freed by unregistering and unmapping it."""
    start, length = map_host_memory(nbytes, huge_pages)
    flags = runtime.cudaHostRegisterMapped | runtime.cudaHostRegisterPortable
    try:
        _check(runtime, runtime.cudaHostRegister(start, length, flags), f"cudaHostRegister({length} bytes)")
    except BaseException:
        unmap_host_memory(start, length)
        raise
    try:
        device_pointer = _check(runtime, runtime.cudaHostGetDevicePointer(start, 0), "cudaHostGetDevicePointer")
    except BaseException:
        runtime.cudaHostUnregister(start)
        unmap_host_memory(start, length)
        raise

    def free(_):
        runtime.cudaHostUnregister(start)
        unmap_host_memory(start, length)

    return _CudaMemory(int(device_pointer), nbytes, free, "registered huge pages" if huge_pages else "registered")


def _managed_memory(nbytes: int, device_index: int) -> _CudaMemory:
    runtime = _runtime()
    if runtime is None:
        raise RuntimeError("Placement.MANAGED needs cuda-bindings (pip install 'numba-cuda[cu13]' or "
                           "'cuda-bindings'): CuPy cannot advise managed memory to stay on the host under "
                           "CUDA 13")
    pointer = _check(runtime, runtime.cudaMallocManaged(nbytes, runtime.cudaMemAttachGlobal),
                     f"cudaMallocManaged({nbytes} bytes)")
    memory = _CudaMemory(int(pointer), nbytes, lambda p: runtime.cudaFree(p), "managed")
    advice = runtime.cudaMemoryAdvise
    # Never let the GPU migrate the pages in (it would thrash past the card's size): keep them
    # on the host, mapped into the GPU's page tables so it reads them in place.
    _advise(runtime, pointer, nbytes, advice.cudaMemAdviseSetPreferredLocation, host=True, device_index=-1)
    _advise(runtime, pointer, nbytes, advice.cudaMemAdviseSetAccessedBy, host=False, device_index=device_index)
    # Mapped for the CPU's page tables too (the staged mover's host copies): without it the
    # host's first touch of each page faults into the driver. On the H200 machine a host
    # scatter of 32K written-back rows in training took 47 ms without, 5.1 ms with it (pinned
    # memory: 0.9 ms; results/measurements.jsonl).
    _advise(runtime, pointer, nbytes, advice.cudaMemAdviseSetAccessedBy, host=True, device_index=-1)
    return memory


def _advise(runtime, pointer, nbytes: int, advice, host: bool, device_index: int) -> None:
    """cudaMemAdvise with a cudaMemLocation (CUDA 13; ``cudaMemAdvise_v2`` in CUDA 12 bindings)."""
    advise = getattr(runtime, "cudaMemAdvise_v2", runtime.cudaMemAdvise)
    _check(runtime, advise(pointer, nbytes, advice, _location(runtime, host, device_index)),
           f"cudaMemAdvise({advice.name})")


def _location(runtime, host: bool, device_index: int):
    location = runtime.cudaMemLocation()
    kinds = runtime.cudaMemLocationType
    location.type = kinds.cudaMemLocationTypeHost if host else kinds.cudaMemLocationTypeDevice
    location.id = 0 if host else device_index
    return location


def prefetch_managed_to_host(pointer: int, nbytes: int) -> None:
    """Place every page of managed memory at ``pointer`` on the host now, in one call
    (``cudaMemPrefetchAsync`` to the host, then a device sync), rather than page by page as kernels
    first touch them. ``tools/bench_host_memory.py`` measures whether the GPU then reads and writes
    scattered rows of it at another rate."""
    runtime = _runtime()
    if runtime is None:
        raise RuntimeError("prefetching managed memory needs cuda-bindings (pip install 'numba-cuda[cu13]')")
    prefetch = getattr(runtime, "cudaMemPrefetchAsync_v2", runtime.cudaMemPrefetchAsync)
    _check(runtime, prefetch(pointer, nbytes, _location(runtime, True, -1), 0, 0), "cudaMemPrefetchAsync(host)")
    _check(runtime, runtime.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
