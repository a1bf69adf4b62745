"""Lay the tables of a module out in their memory tiers and describe them to the kernels.

Every tier (DEVICE, HOST, MANAGED) holds one flat weights buffer and one flat fp32
optimizer-state buffer (``state_layout="separate"``), or one buffer of rows each followed by its
state (``"with_rows"``); table ``t`` occupies a contiguous run of each. ``*_CACHED`` tables live
in the buffer of their backing tier; the slot cache (``tiered_tbe.cache``) keeps copies of their
hot rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tiered_tbe.base.codes import Placement
from tiered_tbe.cache.slot_cache import CachedTable
from tiered_tbe.cache.tiers import TierBuffer, allocate
from tiered_tbe.kernels.rows import RowStores
from tiered_tbe.specs import TableSpec

STATE_LAYOUTS = ("separate", "with_rows")
# With the state beside the rows, each row's bytes (so each table's and row's start) are padded
# to a multiple of this, so the kernels load rows as 16-byte vectors.
_ROW_ALIGN_BYTES = 16


@dataclass
class TableStorage:
    """Where the rows of every table of a module are (one per module)."""

    tables: list[TableSpec]
    buffers: list[TierBuffer]  # every buffer the views below point into (kept alive here)
    table_weights: list[torch.Tensor]  # [num_embeddings, embedding_dim] view of table t's backing rows
    table_state: list[torch.Tensor | None]  # fp32 [num_embeddings, state_width] view of its state, or None
    row_offset: list[int]  # global row id of row 0 of table t

    def cached_tables(self) -> list[CachedTable]:
        """The ``*_CACHED`` tables, as the slot cache sees them."""
        return [
            CachedTable(self.row_offset[t], spec.num_embeddings, spec.embedding_dim, self.table_weights[t],
                        self.table_state[t])
            for t, spec in enumerate(self.tables)
            if spec.placement.is_cached
        ]

    def row_stores(self, cache_weights: torch.Tensor, cache_state: torch.Tensor,
                   feature_table_map: list[int] | None = None) -> RowStores:
        """The kernels' view of every table: its rows and state wherever they live (one table of
        row stores; the kernels never see tiers), looked up by the features of ``feature_table_map``
        (the table of each feature; default: feature t is table t)."""
        return RowStores(tuple(self.table_weights), tuple(self.table_state), cache_weights, cache_state,
                         None if feature_table_map is None else tuple(feature_table_map))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _with_rows_bytes(dim: int, state_width: int, element: int) -> tuple[int, int]:
    """``state_layout="with_rows"``: (bytes of a row's weights, padded to 4; bytes of the row with its
    state, padded to 16)."""
    weight_bytes = _round_up(dim * element, 4)
    return weight_bytes, _round_up(weight_bytes + 4 * state_width, _ROW_ALIGN_BYTES)


def tier_bytes(tables: list[TableSpec], state_width: list[int], weights_dtype: torch.dtype,
               state_layout: str = "separate") -> dict[Placement, tuple[str, int]]:
    """What :func:`lay_out` will allocate in each tier, by backing placement: ``(what, bytes)``, the
    tables it holds named, weights and optimizer state counted."""
    element = weights_dtype.itemsize
    sizes = {}
    for placement in dict.fromkeys(spec.placement.backing for spec in tables):
        members = [t for t, spec in enumerate(tables) if spec.placement.backing is placement]
        if state_layout == "with_rows":
            nbytes = sum(tables[t].num_embeddings * _with_rows_bytes(tables[t].embedding_dim, state_width[t],
                                                                     element)[1] for t in members)
        else:
            nbytes = sum(tables[t].num_embeddings * (tables[t].embedding_dim * element + 4 * state_width[t])
                         for t in members)
        names = ", ".join(tables[t].name or f"table {t}" for t in members)
        sizes[placement] = (f"{placement.name} tables ({names})", nbytes)
    return sizes


def lay_out(
    tables: list[TableSpec],
    state_width: list[int],
    weights_dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator | None = None,
    initial_state: float = 0.0,
    state_layout: str = "separate",
) -> TableStorage:
    """Allocate every tier's buffers and initialise the weights.

    ``state_layout``: ``"separate"`` gives each tier one flat weights buffer and one flat fp32
    state buffer, table ``t`` a contiguous run of each. ``"with_rows"`` gives each tier one
    buffer where each row's optimizer state follows its weights (rows padded to 16 bytes), so
    a row moved between a backing store and the cache is one stretch of memory (one host page)
    instead of two; the kernels see the same views with longer row strides.

    Weights start uniform in ``[-1/sqrt(num_embeddings), 1/sqrt(num_embeddings)]`` (TorchRec's
    default for embedding bags); optimizer state starts at ``initial_state``.
    """
    if state_layout not in STATE_LAYOUTS:
        raise ValueError(f"state_layout must be one of {STATE_LAYOUTS}, got {state_layout!r}")
    element = torch.empty(0, dtype=weights_dtype).element_size()
    placements = list(dict.fromkeys(spec.placement.backing for spec in tables))
    table_weights: list[torch.Tensor | None] = [None] * len(tables)
    table_state: list[torch.Tensor | None] = [None] * len(tables)
    buffers = []
    for placement in placements:
        members = [t for t, spec in enumerate(tables) if spec.placement.backing is placement]
        if state_layout == "with_rows":
            buffers.append(_lay_out_with_rows(tables, state_width, members, placement, weights_dtype, element,
                                              device, table_weights, table_state))
            continue
        weight_numel = sum(tables[t].num_embeddings * tables[t].embedding_dim for t in members)
        state_numel = sum(tables[t].num_embeddings * state_width[t] for t in members)
        weights = allocate(placement, weight_numel, weights_dtype, device)
        state = allocate(placement, state_numel, torch.float32, device) if state_numel else None
        buffers += [b for b in (weights, state) if b is not None]
        weight_at = state_at = 0
        for t in members:
            rows, dim, width = tables[t].num_embeddings, tables[t].embedding_dim, state_width[t]
            table_weights[t] = weights.tensor[weight_at : weight_at + rows * dim].view(rows, dim)
            if width:
                table_state[t] = state.tensor[state_at : state_at + rows * width].view(rows, width)
            weight_at, state_at = weight_at + rows * dim, state_at + rows * width
    storage = TableStorage(
        tables=list(tables),
        buffers=buffers,
        table_weights=table_weights,
        table_state=table_state,
        row_offset=[sum(s.num_embeddings for s in tables[:t]) for t in range(len(tables))],
    )
    for t, spec in enumerate(tables):
        bound = 1.0 / math.sqrt(spec.num_embeddings)
        _fill_uniform(storage.table_weights[t], bound, generator)
        state = storage.table_state[t]
        if state is not None:
            state.fill_(initial_state)
    return storage


def _lay_out_with_rows(tables, state_width, members, placement, weights_dtype, element, device, table_weights,
                       table_state) -> TierBuffer:
    """One buffer of ``placement`` for the tables ``members``, each row's state after its weights;
    fills in their views."""
    row_bytes, weight_bytes = {}, {}
    for t in members:
        weight_bytes[t], row_bytes[t] = _with_rows_bytes(tables[t].embedding_dim, state_width[t], element)
    buffer = allocate(placement, sum(tables[t].num_embeddings * row_bytes[t] for t in members), torch.uint8, device)
    at = 0
    for t in members:
        rows, dim, width = tables[t].num_embeddings, tables[t].embedding_dim, state_width[t]
        table_rows = buffer.tensor[at : at + rows * row_bytes[t]].view(rows, row_bytes[t])
        table_weights[t] = table_rows[:, : dim * element].view(weights_dtype)
        if width:
            table_state[t] = table_rows[:, weight_bytes[t] : weight_bytes[t] + 4 * width].view(torch.float32)
        at += rows * row_bytes[t]
    return buffer


def _fill_uniform(rows: torch.Tensor, bound: float, generator: torch.Generator | None) -> None:
    """Uniform init in chunks of rows: a table in host memory may be far larger than a temporary."""
    chunk_rows = max(1, (1 << 26) // rows.shape[1])
    for start in range(0, rows.shape[0], chunk_rows):
        block = rows[start : start + chunk_rows]
        values = torch.empty(block.shape, dtype=torch.float32, device=block.device)
        values.uniform_(-bound, bound, generator=generator)
        block.copy_(values)
