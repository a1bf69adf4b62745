"""Lay the tables of a module out in their memory tiers and describe them to the kernels.

Every tier (DEVICE, HOST, MANAGED) holds one flat weights buffer and one flat fp32
optimizer-state buffer, in the same tier (``state_layout="separate"``) or in device memory
(``"device"``), or one buffer of rows each followed by its state (``"with_rows"``); table ``t``
occupies a contiguous run of each. ``*_CACHED`` tables live in the buffer of their backing tier;
the slot cache (``tiered_tbe.cache``) keeps copies of their hot rows.

``"auto"`` (the module's default) is ``"device"`` for a row-wise optimizer state (a few values a
row, whatever its dim: row-wise Adagrad's one float) and ``"separate"`` otherwise. A row's state
in host memory costs each move of the row a second small read and write over the bus: on the
H200 the zero-copy mover moved 2.35M mixed-dim rows in and out in 29.3 ms with the state in
managed memory, 23.3 ms with it in HBM (results/measurements.jsonl, 2026-12-04). Row-wise state
is 1/dim of the weights (4 bytes a row), so HBM holds it for tables far larger than HBM.
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

STATE_LAYOUTS = ("auto", "separate", "device", "with_rows")
# "auto" keeps a row-wise state in device memory while it takes at most this share of the free device memory.
_DEVICE_STATE_SHARE = 0.25
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


def resolve_state_layout(state_layout: str, row_wise_state: bool, tables: list[TableSpec], state_width: list[int],
                         mover: str | None, device_free_bytes: int | None) -> str:
    """The layout ``state_layout`` means for these tables: ``"auto"`` becomes ``"device"`` when the
    optimizer's state is row-wise (``row_wise_state``: its width does not grow with the dim), the
    state of the tables outside device memory takes at most a quarter of ``device_free_bytes``
    (None: no limit known) and no staged mover reads it from the host (``mover``: the cache's
    mover, None without a cache); ``"separate"`` otherwise.

    Raises:
        ValueError: an unknown layout, or ``"device"`` with the staged mover.
    """
    if state_layout not in STATE_LAYOUTS:
        raise ValueError(f"state_layout must be one of {STATE_LAYOUTS}, got {state_layout!r}")
    if state_layout == "device" and mover == "staged":
        raise ValueError("state_layout='device' needs the zero-copy mover: the staged mover's host threads read "
                         "each moved row's state from the backing store")
    if state_layout != "auto":
        return state_layout
    state_bytes = sum(4 * width * spec.num_embeddings for spec, width in zip(tables, state_width)
                      if spec.placement.backing is not Placement.DEVICE)
    fits = device_free_bytes is None or state_bytes <= _DEVICE_STATE_SHARE * device_free_bytes
    return "device" if row_wise_state and state_bytes and fits and mover != "staged" else "separate"


def _state_placement(placement: Placement, state_layout: str) -> Placement:
    """Where the state buffer of the tables backed by ``placement`` lives under a resolved layout."""
    return Placement.DEVICE if state_layout == "device" else placement


def tier_bytes(tables: list[TableSpec], state_width: list[int], weights_dtype: torch.dtype,
               state_layout: str = "separate") -> dict[Placement, tuple[str, int]]:
    """What :func:`lay_out` will allocate in each tier, by placement: ``(what, bytes)``, the
    tables it holds named, weights and optimizer state counted where each lives (a resolved
    layout: not ``"auto"``)."""
    element = weights_dtype.itemsize
    parts: dict[Placement, list[tuple[str, int]]] = {}
    for placement in dict.fromkeys(spec.placement.backing for spec in tables):
        members = [t for t, spec in enumerate(tables) if spec.placement.backing is placement]
        names = ", ".join(tables[t].name or f"table {t}" for t in members)
        if state_layout == "with_rows":
            nbytes = sum(tables[t].num_embeddings * _with_rows_bytes(tables[t].embedding_dim, state_width[t],
                                                                     element)[1] for t in members)
            parts.setdefault(placement, []).append((f"{placement.name} tables ({names})", nbytes))
            continue
        weight_bytes = sum(tables[t].num_embeddings * tables[t].embedding_dim * element for t in members)
        state_bytes = sum(tables[t].num_embeddings * 4 * state_width[t] for t in members)
        state_placement = _state_placement(placement, state_layout)
        if state_placement is placement:
            parts.setdefault(placement, []).append((f"{placement.name} tables ({names})", weight_bytes + state_bytes))
        else:
            parts.setdefault(placement, []).append((f"{placement.name} tables ({names})", weight_bytes))
            parts.setdefault(state_placement, []).append(
                (f"the optimizer state of the {placement.name} tables", state_bytes))
    return {placement: ("; ".join(what for what, _ in entries), sum(n for _, n in entries))
            for placement, entries in parts.items()}


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

    ``state_layout`` (resolved: not ``"auto"``, see :func:`resolve_state_layout`): ``"separate"``
    gives each tier one flat weights buffer and one flat fp32 state buffer, table ``t`` a
    contiguous run of each; ``"device"`` the same with every state buffer in device memory.
    ``"with_rows"`` gives each tier one buffer where each row's optimizer state follows its
    weights (rows padded to 16 bytes), so a row moved between a backing store and the cache is
    one stretch of memory (one host page) instead of two; the kernels see the same views with longer row strides.

    Weights start uniform in ``[-1/sqrt(num_embeddings), 1/sqrt(num_embeddings)]`` (TorchRec's
    default for embedding bags); optimizer state starts at ``initial_state``.
    """
    if state_layout not in STATE_LAYOUTS or state_layout == "auto":
        raise ValueError(f"state_layout must be one of {STATE_LAYOUTS[1:]}, got {state_layout!r}")
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
        state = (allocate(_state_placement(placement, state_layout), state_numel, torch.float32, device)
                 if state_numel else None)
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
