"""Stable sorts of row ids: CUB's radix sort on the GPU where it imports, ``torch.sort`` elsewhere.

The prefetch and the backward each group a batch's lookups by row with a stable sort of the
rows (the backward takes the prefetch's when every table is cached). ``torch.sort`` sorts all
bits of its keys and carries int64 positions; CUB's ``DeviceRadixSort`` through NVIDIA's
``cuda-cccl`` package (``cuda.compute``) carries int32 positions, a third fewer bytes each
pass: on an H200 2.1M int32 keys sorted in 0.119 ms against torch's 0.155, 1.7M in
0.087 against 0.125 (CUDA-graph replays; results/measurements.jsonl). Both are stable, so
both give the same order, bit for bit; the backend changes speed
only. ``TIERED_TBE_SORT=torch`` forces ``torch.sort``.

Row ids of a module rarely reach 2^31, so the sorts run on int32 keys when they fit: an int64
key costs about twice an int32 one.

Building a CUB sort JIT-compiles it (NVRTC): ~2 s per dtype pair on the H200 machine, in every
process. A built sort is kept on disk (``cuda.compute.serialize``, cuda-cccl >= 1.1) in
:func:`sorter_cache_dir`, one file per dtype pair, GPU architecture and cuda-cccl version, and
a later process loads it instead (counted as ``cub compiled`` / ``cub loaded``, ``base/compiling.py``).

:func:`compact` moves selected entries to the front in order where a sort would only be used for
that: one pass instead of a sort's several.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from . import compiling
from .codes import INT32_MAX, INT64_MAX
from .mode import SIMULATION

_BACKEND = os.environ.get("TIERED_TBE_SORT", "cub")
if _BACKEND not in ("cub", "torch"):
    raise ValueError(f"TIERED_TBE_SORT must be 'cub' or 'torch', got {_BACKEND!r}")

_cuda_compute = None  # the cuda.compute module once imported; False when it cannot be used
_sorters: dict[tuple[torch.dtype, torch.dtype], object] = {}  # CUB radix sorts built, by (key, value) dtype


def _cub():
    """``cuda.compute``, or None when the sorts use ``torch.sort`` (simulation, not installed, or
    ``TIERED_TBE_SORT=torch``)."""
    global _cuda_compute
    if _cuda_compute is None:
        _cuda_compute = False
        if _BACKEND == "cub" and not SIMULATION:
            try:
                import cuda.compute as cuda_compute
            except Exception:  # noqa: BLE001 - not installed, or no CUDA toolkit it can load
                cuda_compute = False
            _cuda_compute = cuda_compute
    return _cuda_compute or None


def _disable_cub(error: Exception) -> None:
    global _cuda_compute
    _cuda_compute = False
    warnings.warn(f"tiered_tbe: cuda-cccl imports but its radix sort does not build here ({type(error).__name__}: "
                  f"{error}); sorting with torch.sort (the same results, slower)", RuntimeWarning, stacklevel=3)


def sort_backend(device: torch.device | str) -> str:
    """``"cub"`` or ``"torch"``: which sort :func:`stable_sort` runs for tensors on ``device``."""
    return "cub" if torch.device(device).type == "cuda" and _cub() is not None else "torch"


class _CudaStream:
    """A torch stream in the ``__cuda_stream__`` protocol that ``cuda.compute`` reads."""

    __slots__ = ("handle",)

    def __init__(self, stream: torch.cuda.Stream):
        self.handle = stream.cuda_stream

    def __cuda_stream__(self):
        return (0, self.handle)


def _cub_sort(cuda_compute, keys: torch.Tensor, values: torch.Tensor | None,
              end_bit: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`stable_sort` through CUB; None when CUB's sort cannot be built (then disabled)."""
    if values is None:
        values = torch.arange(keys.numel(), dtype=torch.int32, device=keys.device)
    sorted_keys, sorted_values = torch.empty_like(keys), torch.empty_like(values)
    arrays = dict(d_in_keys=keys, d_out_keys=sorted_keys, d_in_values=values, d_out_values=sorted_values)
    sorter = _sorters.get((keys.dtype, values.dtype))
    if sorter is None:
        path = _sorter_file(cuda_compute, keys, values)
        sorter = _load_sorter(cuda_compute, path)
        if sorter is None:
            try:  # JIT-compiles CUB (NVRTC), once for each dtype pair
                sorter = cuda_compute.make_radix_sort(**arrays, order=cuda_compute.SortOrder.ASCENDING)
            except Exception as error:  # noqa: BLE001 - cuda-cccl imports but cannot build here (no NVRTC, old driver)
                _disable_cub(error)
                return None
            compiling.count("cub", compiled=1)
            _save_sorter(cuda_compute, sorter, path)
        _sorters[keys.dtype, values.dtype] = sorter
    call = dict(arrays, num_items=keys.numel(), begin_bit=0, end_bit=end_bit,
                stream=_CudaStream(torch.cuda.current_stream(keys.device)))
    # The first call only sizes the scratch space (no launch); the caching allocator gives it
    # back to this stream, so a CUDA graph captures the sort like any torch op.
    scratch_bytes = sorter(temp_storage=None, **call)
    sorter(temp_storage=torch.empty(max(scratch_bytes, 1), dtype=torch.uint8, device=keys.device), **call)
    return sorted_keys, sorted_values


def sorter_cache_dir() -> Path:
    """Where built CUB sorts are kept: ``$TIERED_TBE_CUB_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/tiered-tbe/cub`` (default ``~/.cache``)."""
    root = os.environ.get("TIERED_TBE_CUB_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tiered-tbe" / "cub"


def _sorter_file(cuda_compute, keys: torch.Tensor, values: torch.Tensor) -> Path | None:
    """The file of the sort of ``keys``' and ``values``' dtypes on their GPU's architecture, built by
    this cuda-cccl; None where a built sort cannot be saved (cuda-cccl before 1.1)."""
    if not hasattr(cuda_compute, "serialize") or not hasattr(cuda_compute, "deserialize"):
        return None
    try:
        from importlib.metadata import version

        cccl = version("cuda-cccl")
    except Exception:  # noqa: BLE001 - not installed as a distribution: no version to key the file by
        return None
    major, minor = torch.cuda.get_device_capability(keys.device)
    dtypes = f"{str(keys.dtype).removeprefix('torch.')}-{str(values.dtype).removeprefix('torch.')}"
    return sorter_cache_dir() / f"radix-sort-{dtypes}-sm{major}{minor}-cccl{cccl}.cclb"


def _load_sorter(cuda_compute, path: Path | None):
    """The sort saved at ``path``, or None (no file, or one this cuda-cccl cannot read: built again)."""
    if path is None or not path.is_file():
        return None
    try:
        sorter = cuda_compute.deserialize(path.read_bytes())
    except Exception:  # noqa: BLE001 - a stale or truncated file: build afresh (and overwrite it)
        return None
    compiling.count("cub", loaded=1)
    return sorter


def _save_sorter(cuda_compute, sorter, path: Path | None) -> None:
    """Write ``sorter`` to ``path`` whole or not at all (a temporary file renamed: processes that
    start together never read half a file); a folder that cannot be written keeps nothing."""
    if path is None:
        return
    try:
        blob = cuda_compute.serialize(sorter)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temporary.write_bytes(blob)
        os.replace(temporary, path)
    except Exception:  # noqa: BLE001 - not serializable here, or no writable folder: build again next time
        pass


def stable_sort(keys: torch.Tensor, upper_bound: int | None = None,
                values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable ascending sort of non-negative integer keys. No host sync.

    Args:
        keys: int32 or int64 [N], N < 2^31, each in ``[0, upper_bound]`` (inclusive: a "none"
            marker may equal the bound).
        upper_bound: the largest key there can be (default: the dtype's largest); CUB sorts
            only the bits that hold it.
        values: int32 [N] carried with the keys instead of their positions (the backward's bags:
            one gather less when it needs no positions).

    Returns:
        ``(sorted_keys, order)``: the keys ascending (``keys``' dtype [N]) and the input position
        of each (int32 [N]), or ``values`` in that order; equal keys keep their input order.
    """
    n = keys.numel()
    if n >= INT32_MAX:
        raise ValueError(f"stable_sort sorts at most 2^31 - 1 keys, got {n}")
    if values is not None and (values.numel() != n or values.dtype != torch.int32):
        raise ValueError(f"values must be int32 [{n}], got {values.dtype} [{values.numel()}]")
    if upper_bound is None:
        upper_bound = INT32_MAX if keys.dtype == torch.int32 else INT64_MAX
    cuda_compute = _cub() if keys.is_cuda and n > 0 else None
    if cuda_compute is not None:
        result = _cub_sort(cuda_compute, keys, values, max(1, int(upper_bound).bit_length()))
        if result is not None:
            return result
    sorted_keys, order = torch.sort(keys, stable=True)
    return sorted_keys, order.to(torch.int32) if values is None else values[order]


def sort_ids(ids: torch.Tensor, upper_bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`stable_sort` of int64 ids, on int32 keys when they fit.

    Args:
        ids: int64 [N], each in ``[0, upper_bound)`` or equal to ``INT64_MAX`` (a "none" marker,
            which sorts last and comes back unchanged).
        upper_bound: exclusive bound of the ids other than the marker.

    Returns:
        (sorted ids int64 [N], order int32 [N]).
    """
    if upper_bound > INT32_MAX or ids.numel() == 0:
        return stable_sort(ids)
    keys = torch.where(ids == INT64_MAX, INT32_MAX, ids).to(torch.int32)
    sorted_keys, order = stable_sort(keys)
    return torch.where(sorted_keys == INT32_MAX, INT64_MAX, sorted_keys.long()), order


def compact(mask: torch.Tensor, *values: torch.Tensor, fill: int | None = None) -> list[torch.Tensor]:
    """The entries of each of ``values`` where ``mask`` holds, moved to the front in their order.

    Args:
        mask: bool [N].
        values: tensors [N] of any dtype.
        fill: the value of the entries after the selected ones (``None``: left uninitialised).

    Returns:
        a tensor [N] per value. A cumsum and a scatter: no sort, no host sync (the count is
        ``mask.sum()``, left on the device), and CUDA-graph capturable.
    """
    n = mask.numel()
    target = torch.where(mask, torch.cumsum(mask, 0) - 1, n)  # unselected entries go to a spare slot n
    result = []
    for value in values:
        out = (torch.empty(n + 1, dtype=value.dtype, device=value.device) if fill is None
               else torch.full((n + 1,), fill, dtype=value.dtype, device=value.device))
        out.scatter_(0, target, value)
        result.append(out[:n])
    return result
