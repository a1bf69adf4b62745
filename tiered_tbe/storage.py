"""Lay the tables of a module out in their memory tiers and describe them to the kernels.

Every tier (DEVICE, HOST, MANAGED) holds one flat weights buffer and one flat fp32
optimizer-state buffer; table ``t`` occupies a contiguous run of each, at element offsets
computed here. ``*_CACHED`` tables live in the buffer of their backing tier; the slot cache
(``tiered_tbe.cache``) keeps copies of their hot rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tiered_tbe.cache.slot_cache import CachedTable
from tiered_tbe.cache.tiers import TierBuffer, allocate
from tiered_tbe.kernels.rows import RowStores
from tiered_tbe.specs import Placement, TableSpec


@dataclass
class TableStorage:
    """Where the rows of every table of a module are (one per module)."""

    tables: list[TableSpec]
    weight_buffers: dict[Placement, TierBuffer]  # keyed by backing placement
    state_buffers: dict[Placement, TierBuffer]
    weight_offset: list[int]  # element offset of row 0 of table t in its tier's weights
    state_offset: list[int]
    state_width: list[int]  # fp32 optimizer-state values per row of table t
    row_offset: list[int]  # global row id of row 0 of table t

    def weights(self, t: int) -> torch.Tensor:
        """[num_embeddings, embedding_dim] view of table t's backing rows."""
        spec = self.tables[t]
        flat = self.weight_buffers[spec.placement.backing].tensor
        start = self.weight_offset[t]
        return flat[start : start + spec.num_embeddings * spec.embedding_dim].view(
            spec.num_embeddings, spec.embedding_dim
        )

    def state(self, t: int) -> torch.Tensor | None:
        """[num_embeddings, state_width] fp32 view of table t's optimizer state, or None."""
        width = self.state_width[t]
        if width == 0:
            return None
        spec = self.tables[t]
        flat = self.state_buffers[spec.placement.backing].tensor
        start = self.state_offset[t]
        return flat[start : start + spec.num_embeddings * width].view(spec.num_embeddings, width)

    def cached_tables(self) -> list[CachedTable]:
        """The ``*_CACHED`` tables, as the slot cache sees them."""
        return [
            CachedTable(self.row_offset[t], spec.num_embeddings, spec.embedding_dim, self.weights(t), self.state(t))
            for t, spec in enumerate(self.tables)
            if spec.placement.is_cached
        ]

    def row_stores(self, cache_weights: torch.Tensor, cache_state: torch.Tensor) -> RowStores:
        """The kernels' view of every table: its rows and state wherever they live (one table of
        row stores; the kernels never see tiers)."""
        return RowStores(tuple(self.weights(t) for t in range(len(self.tables))),
                         tuple(self.state(t) for t in range(len(self.tables))), cache_weights, cache_state)


def lay_out(
    tables: list[TableSpec],
    state_width: list[int],
    weights_dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator | None = None,
    initial_state: float = 0.0,
) -> TableStorage:
    """Allocate every tier's buffers and initialise the weights.

    Weights start uniform in ``[-1/sqrt(num_embeddings), 1/sqrt(num_embeddings)]`` (TorchRec's
    default for embedding bags); optimizer state starts at ``initial_state``.
    """
    weight_offset, state_offset = [], []
    weight_numel: dict[Placement, int] = {}
    state_numel: dict[Placement, int] = {}
    for spec, width in zip(tables, state_width):
        backing = spec.placement.backing
        weight_offset.append(weight_numel.get(backing, 0))
        weight_numel[backing] = weight_offset[-1] + spec.num_embeddings * spec.embedding_dim
        state_offset.append(state_numel.get(backing, 0))
        state_numel[backing] = state_offset[-1] + spec.num_embeddings * width
    storage = TableStorage(
        tables=list(tables),
        weight_buffers={p: allocate(p, n, weights_dtype, device) for p, n in weight_numel.items()},
        state_buffers={p: allocate(p, n, torch.float32, device) for p, n in state_numel.items() if n > 0},
        weight_offset=weight_offset,
        state_offset=state_offset,
        state_width=list(state_width),
        row_offset=[sum(s.num_embeddings for s in tables[:t]) for t in range(len(tables))],
    )
    for t, spec in enumerate(tables):
        bound = 1.0 / math.sqrt(spec.num_embeddings)
        _fill_uniform(storage.weights(t), bound, generator)
        state = storage.state(t)
        if state is not None:
            state.fill_(initial_state)
    return storage


def _fill_uniform(rows: torch.Tensor, bound: float, generator: torch.Generator | None) -> None:
    """Uniform init in chunks of rows: a table in host memory may be far larger than a temporary."""
    chunk_rows = max(1, (1 << 26) // rows.shape[1])
    for start in range(0, rows.shape[0], chunk_rows):
        block = rows[start : start + chunk_rows]
        values = torch.empty(block.shape, dtype=torch.float32, device=block.device)
        values.uniform_(-bound, bound, generator=generator)
        block.copy_(values)
