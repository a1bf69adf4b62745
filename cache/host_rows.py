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
so a gather is one ``torch.index_select`` for the weights and one for the state: each runs
on torch's intra-op thread pool with the GIL released (measured on the H200 machine: 42-59
GB/s with 16 threads, where splitting the rows over Python threads fell to 2-17 GB/s).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from tiered_tbe.cache.tables import CachedTable
from tiered_tbe.cache.tiers import host_view


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

    Rows passed to :meth:`gather` and :meth:`scatter` are CPU int64 global rows of these
    tables in ascending order (each table's rows contiguous); staging rows are laid out as the
    cache's slots: weights ``[M, row_width]``, state ``[M, state_width]`` fp32, of which a
    table uses its first ``dim`` / ``state_width`` columns.
    """

    def __init__(self, tables: Sequence[CachedTable]):
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
        for segment, begin, end in self._runs(rows):
            local = rows[begin:end] - segment.start
            dim = segment.weights.shape[1]
            torch.index_select(segment.weights, 0, local, out=weights_out[begin:end, :dim])
            if segment.state is not None:
                torch.index_select(segment.state, 0, local, out=state_out[begin:end, : segment.state.shape[1]])

    def scatter(self, rows: torch.Tensor, weights_in: torch.Tensor, state_in: torch.Tensor) -> None:
        """The backing row ``rows[i]`` (int64 [M], distinct) = ``weights_in[i, :dim], state_in[i, :width]``."""
        for segment, begin, end in self._runs(rows):
            local = rows[begin:end] - segment.start
            dim = segment.weights.shape[1]
            segment.weights.index_copy_(0, local, weights_in[begin:end, :dim])
            if segment.state is not None:
                segment.state.index_copy_(0, local, state_in[begin:end, : segment.state.shape[1]])
