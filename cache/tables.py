"""The tables a slot cache holds rows of, as the cache sees them (no pooling, no optimizer)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

# Integer type of the same size as each element size: copies move bits, not numbers.
BITS_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class CachedTable(NamedTuple):
    """One table whose rows the slot cache may hold.

    ``weights`` is a 2-D view [num_rows, dim] of the table's rows in its backing store,
    ``state`` a 2-D fp32 view [num_rows, state_width] of their optimizer state (``None`` when
    the optimizer keeps none). With the zero-copy mover both must be readable and writable in
    place by the cache's device (on the GPU: device, pinned-host or managed memory exposed as
    CUDA tensors); the staged mover reads and writes them from the host instead (pinned-host or
    managed memory). Global rows ``global_row_start .. global_row_start + num_rows - 1`` are
    this table's.
    """

    global_row_start: int
    num_rows: int
    dim: int
    weights: torch.Tensor
    state: torch.Tensor | None = None

    @property
    def state_width(self) -> int:
        return 0 if self.state is None else self.state.shape[1]

    @property
    def global_row_end(self) -> int:
        return self.global_row_start + self.num_rows


def check_tables(tables: Sequence[CachedTable], device: torch.device) -> list[CachedTable]:
    """The tables sorted by global row; ``ValueError`` naming the table for anything a cache cannot hold."""
    tables = sorted(tables, key=lambda t: t.global_row_start)
    if not tables:
        raise ValueError("SlotCache needs at least one cached table")
    for i, t in enumerate(tables):
        where = f"cached table {i} (global rows {t.global_row_start}..)"
        if t.global_row_start < 0 or t.num_rows < 1 or t.dim < 1:
            raise ValueError(f"{where}: global_row_start >= 0, num_rows >= 1 and dim >= 1 needed")
        if i and t.global_row_start < tables[i - 1].global_row_end:
            raise ValueError(f"{where} overlaps the table before it")
        if t.weights.dim() != 2 or tuple(t.weights.shape) != (t.num_rows, t.dim):
            raise ValueError(f"{where}: weights must be [{t.num_rows}, {t.dim}], got {tuple(t.weights.shape)}")
        if t.weights.dtype != tables[0].weights.dtype:
            raise ValueError(f"{where}: weights dtype {t.weights.dtype} differs from "
                             f"{tables[0].weights.dtype}: one cache holds one dtype")
        if t.weights.element_size() not in BITS_OF_SIZE:
            raise ValueError(f"{where}: unsupported weights dtype {t.weights.dtype}")
        if t.weights.stride(1) != 1:
            raise ValueError(f"{where}: rows of contiguous elements needed (weights.stride(1) == 1)")
        if t.state is not None:
            if t.state.dim() != 2 or t.state.shape[0] != t.num_rows or t.state.dtype != torch.float32:
                raise ValueError(f"{where}: state must be fp32 [{t.num_rows}, width], got "
                                 f"{t.state.dtype} {tuple(t.state.shape)}")
            if t.state.stride(1) != 1:
                raise ValueError(f"{where}: optimizer state rows of contiguous values needed")
        for name, tensor in (("weights", t.weights), ("state", t.state)):
            if tensor is not None and tensor.device.type != device.type:
                raise ValueError(f"{where}: {name} on {tensor.device}, the cache on {device}")
    return tables


def in_cached_tables(rows: torch.Tensor, table_starts: torch.Tensor, table_ends: torch.Tensor) -> torch.Tensor:
    """bool [N]: which of ``rows`` (int64 [N], global rows) lie in a cached table (``table_starts[t] <= row <
    table_ends[t]``; int64 [T], ascending). Padding, ``NOT_CACHED`` and negative rows are outside."""
    table = torch.searchsorted(table_starts, rows, right=True) - 1
    return (table >= 0) & (rows < table_ends[table.clamp(min=0)])
