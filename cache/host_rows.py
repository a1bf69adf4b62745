"""The backing rows of a cache's tables as the host CPU reads and writes them (the staged mover's side).

The staged mover never asks the GPU to read a backing store in place: the host gathers the
rows a batch misses into staging buffers and scatters written-back rows from them. This
module is that host side, and the only place that knows where a global row lives in host
memory. A backing store the GPU cannot address at all (a memory-mapped file on local disk,
for tables larger than host RAM) would be another implementation of the same two calls.

Tables are grouped into **segments**: consecutive cached tables (by global row) whose rows
share one buffer with one row stride, dim and state width, laid out so that global row ``g``
sits at row ``g - segment.start`` of one strided view. The module's layout (every cached
table of a tier in one flat buffer, in table order) makes the 26 Criteo tables one segment,
so a gather is one parallel call over every row of the batch.

Two implementations of the copies (``copy=``, :data:`HOST_COPIES`):

``torch``
    One ``torch.index_select`` (gather) or ``index_copy_`` (scatter) for the weights and one
    for the state, each on torch's intra-op thread pool with the GIL released. Splitting rows
    over Python threads instead fell to 2-17 GB/s on the H200 machine (issue 11). torch sizes
    its parallel chunks by elements, so the state's one-float rows of a 32K-row chunk are
    copied by one thread.
``numba``
    One Numba ``prange`` loop (``nogil``) that copies each row's weights and state together,
    as machine words: every thread takes whole rows, weights and state alike.

:data:`DEFAULT_HOST_COPY` is the one measured faster (``tools/bench_host_rows.py``).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from typing import NamedTuple

import numba
import numpy as np
import torch

from tiered_tbe.cache.tables import CachedTable
from tiered_tbe.cache.tiers import host_view

HOST_COPIES = ("torch", "numba")
# Measured on the H200 machine (bench_host_rows.py, results/measurements.jsonl; 17 GB pinned
# table, 16 threads, in a worker thread): gather of a 32K-row staging chunk 24.1 GB/s with numba
# against 8.9 with torch (whose state gather of 4-byte rows took 0.44 ms on one thread), 33.6
# against 28.4 for 72K rows; scatter 33.1 against 11.2, 36.1 against 17.0. Overridable for
# benchmarks by the environment (TIERED_TBE_HOST_COPY=torch|numba).
DEFAULT_HOST_COPY = os.environ.get("TIERED_TBE_HOST_COPY", "numba")


class _Segment(NamedTuple):
    start: int  # first global row
    end: int  # one past the last
    weights: torch.Tensor  # host view [end - start, dim]: global row g at row g - start
    state: torch.Tensor | None  # host view [end - start, state_width] fp32, or None


def _layout_key(table: CachedTable) -> tuple:
    """Tables with equal keys, consecutive by global row, form one segment: same buffers, strides
    and widths, and the same element offset of a (virtual) global row 0."""
    def origin(tensor):
        return tensor.storage_offset() - table.global_row_start * tensor.stride(0)

    key = (table.weights.untyped_storage().data_ptr(), table.weights.stride(0), table.dim, origin(table.weights))
    if table.state is None:
        return (*key, None)
    return (*key, table.state.untyped_storage().data_ptr(), table.state.stride(0), table.state_width,
            origin(table.state))


class HostRows:
    """Gather and scatter rows (weights and optimizer state) of the cached tables on the host.

    Args:
        tables: the cache's tables (sorted by global row, as ``check_tables`` returns them);
            their tensors are CPU tensors or CUDA tensors over pinned host or managed memory.
        copy: which implementation copies the rows (:data:`HOST_COPIES`; None: the default).

    Rows passed to :meth:`gather` and :meth:`scatter` are CPU int64 global rows of these
    tables in ascending order (each table's rows contiguous); staging rows are laid out as the
    cache's slots: weights ``[M, row_width]``, state ``[M, state_width]`` fp32, of which a
    table uses its first ``dim`` / ``state_width`` columns.
    """

    def __init__(self, tables: Sequence[CachedTable], copy: str | None = None):
        self.copy = copy or DEFAULT_HOST_COPY
        if self.copy not in HOST_COPIES:
            raise ValueError(f"host copy must be one of {list(HOST_COPIES)}, got {self.copy!r}")
        self.tables = list(tables)  # keeps the memory of the host views alive
        self.segments: list[_Segment] = []
        group: list[CachedTable] = []
        for table in self.tables + [None]:
            if group and (table is None or _layout_key(table) != _layout_key(group[0])):
                self.segments.append(self._segment(group))
                group = []
            if table is not None:
                group.append(table)
        # Boundaries for splitting sorted rows by segment.
        self._starts = np.array([s.start for s in self.segments], dtype=np.int64)

    @staticmethod
    def _segment(group: list[CachedTable]) -> _Segment:
        first, last = group[0], group[-1]
        span = last.global_row_end - first.global_row_start

        def view(tensor, width):
            host = host_view(tensor)
            return host.as_strided((span, width), (tensor.stride(0), 1), host.storage_offset())

        state = view(first.state, first.state_width) if first.state is not None else None
        return _Segment(first.global_row_start, last.global_row_end, view(first.weights, first.dim), state)

    def _runs(self, rows: torch.Tensor):
        """(segment, begin, end): the run of ``rows[begin:end]`` inside each segment that has rows."""
        if len(self.segments) == 1:
            if rows.numel():
                yield self.segments[0], 0, rows.numel()
            return
        bounds = np.searchsorted(rows.numpy(), self._starts).tolist() + [rows.numel()]
        for segment, begin, end in zip(self.segments, bounds, bounds[1:]):
            if end > begin:
                yield segment, begin, end

    def gather(self, rows: torch.Tensor, weights_out: torch.Tensor, state_out: torch.Tensor) -> None:
        """``weights_out[i, :dim], state_out[i, :width]`` = the backing row ``rows[i]`` (int64 [M])."""
        self._copy(rows, weights_out, state_out, to_backing=False)

    def scatter(self, rows: torch.Tensor, weights_in: torch.Tensor, state_in: torch.Tensor) -> None:
        """The backing row ``rows[i]`` (int64 [M], distinct) = ``weights_in[i, :dim], state_in[i, :width]``."""
        self._copy(rows, weights_in, state_in, to_backing=True)

    def _copy(self, rows: torch.Tensor, staged_weights: torch.Tensor, staged_state: torch.Tensor,
              to_backing: bool) -> None:
        for segment, begin, end in self._runs(rows):
            staged = (staged_weights[begin:end, : segment.weights.shape[1]],
                      staged_state[begin:end, : 0 if segment.state is None else segment.state.shape[1]])
            if self.copy == "numba":
                _copy_rows(rows[begin:end], segment.start, segment.weights, segment.state, *staged, to_backing)
                continue
            local = rows[begin:end] - segment.start
            for backing, part in zip((segment.weights, segment.state), staged):
                if backing is None:
                    continue
                if to_backing:
                    backing.index_copy_(0, local, part)
                else:
                    torch.index_select(backing, 0, local, out=part)


def set_copy_threads(threads: int) -> None:
    """Threads each gather or scatter of the calling thread uses (torch's intra-op pool and numba's
    parallel loops: both counts are per calling thread)."""
    torch.set_num_threads(threads)
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))


# ---------------------------------------------------------------------- the numba copies

# cache=True: a new process loads the compiled copy from numba's cache (it calls nothing outside
# this function, so numba's check of this file's stamp is enough).
@numba.njit(parallel=True, nogil=True, cache=True)
def _copy_kernel(rows, first_row, weights, state, staged_weights, staged_state, to_backing):  # pragma: no cover
    """Between backing row ``rows[i] - first_row`` of ``weights``/``state`` and staging row ``i``
    (machine words [*, words]): to the backing store if ``to_backing`` (rows distinct: no two
    threads write one row), else from it. Each thread copies whole rows, weights and state."""
    for i in numba.prange(rows.shape[0]):
        row = rows[i] - first_row
        if to_backing:
            weights[row, :] = staged_weights[i, :]
            state[row, :] = staged_state[i, :]
        else:
            staged_weights[i, :] = weights[row, :]
            staged_state[i, :] = state[row, :]


# The workqueue threading layer (numba's fallback when neither TBB nor OpenMP loads) must not run
# two parallel calls at once; the mover's fill and write-back threads then take turns.
_WORKQUEUE_LOCK = threading.Lock()


def _copy_rows(rows, first_row, weights, state, staged_weights, staged_state, to_backing: bool) -> None:
    """Copy rows between a segment's views (``weights`` [span, dim], ``state`` [span, width] or
    None) and staging views (``staged_*`` [M, dim] / [M, width]) with the numba kernel."""
    if rows.numel() == 0:
        return
    words = _words(weights, staged_weights)
    if state is None:
        states = [np.empty((weights.shape[0], 0), np.uint32), np.empty((rows.numel(), 0), np.uint32)]
    else:
        states = _words(state, staged_state)
    args = (rows.numpy(), first_row, words[0], states[0], words[1], states[1], to_backing)
    if _threading_layer() in (None, "workqueue"):  # not known before the first parallel call
        with _WORKQUEUE_LOCK:
            _copy_kernel(*args)
    else:
        _copy_kernel(*args)


def _threading_layer() -> str | None:
    try:
        return numba.threading_layer()
    except ValueError:  # no parallel call yet
        return None


def _words(*tensors: torch.Tensor) -> list[np.ndarray]:
    """Numpy views of 2-D CPU tensors with contiguous rows of equal bytes, as machine words (the
    widest of 8, 4, 2, 1 bytes dividing every one's row bytes, row stride and address):
    [rows, row_bytes / word] each."""
    size = tensors[0].element_size()
    row_bytes = tensors[0].shape[1] * size
    word = next(w for w in (8, 4, 2, 1) if row_bytes % w == 0 and all(
        t.stride(0) * size % w == 0 and t.data_ptr() % w == 0 for t in tensors))
    dtype = np.dtype(f"u{word}")
    views = []
    for tensor in tensors:
        if tensor.shape[0] == 0 or row_bytes == 0:
            views.append(np.empty((tensor.shape[0], row_bytes // word), dtype))
            continue
        stride_bytes = tensor.stride(0) * size
        span = (tensor.shape[0] - 1) * stride_bytes + row_bytes
        flat = np.frombuffer((ctypes.c_uint8 * span).from_address(tensor.data_ptr()), dtype=np.uint8)
        views.append(np.lib.stride_tricks.as_strided(flat.view(dtype), (tensor.shape[0], row_bytes // word),
                                                     (stride_bytes, word)))
    return views
