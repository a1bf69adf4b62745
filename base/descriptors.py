"""Table descriptors: how a kernel finds a table's rows, one int64 row of one tensor per table.

A descriptor tensor is int64 ``[G, DESCRIPTOR_COLUMNS]``, row ``g`` describing one group of
lookups: where row 0 of its table's weights and optimizer state lives (a byte address: any
memory the GPU addresses, HBM, pinned host memory or managed memory), the strides between rows,
the table's dim, rows and global row offset, the group's first column in a pooled output row,
and the row's own number. The TBE kernels (Triton, ``kernels/``) read the rows of
:class:`~tiered_tbe.kernels.rows.RowStores`' descriptor (a row per feature; two features of one
table have the same table columns); the slot cache's copy kernel (Numba, ``cache/_kernels.py``)
reads the rows of the cached tables of one buffer. Both read the columns by the names below, so
no kernel takes a table's facts as separate arrays.

A kernel may also be handed a copy of some of a descriptor's rows (the forward launches once per
group of features of similar dims, each launch over its group's rows: ``kernels/rows.py``
``ColumnGroup``): column ``FEATURE`` keeps each row's number in the descriptor it was made in.

A row is 16 int64 values, 128 bytes: one cache line, so the loads of a table's facts on the
hot path (a program's table, a run's row) touch one line. The int32 columns (dim, output
column) are read by the Triton kernels as the low 32-bit word of their int64 value
(little-endian, as every CUDA device and host), so those loads stay 32-bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

WEIGHTS_ADDRESS = 0  # byte address of row 0 of the table's weights
WEIGHTS_STRIDE = 1  # elements between consecutive rows of the weights
STATE_ADDRESS = 2  # byte address of row 0 of the table's fp32 optimizer state (0: no state)
STATE_STRIDE = 3  # fp32 values between consecutive rows of the state
STATE_WIDTH = 4  # fp32 state values a row (0: no state)
ROW_OFFSET = 5  # global row id of the table's row 0 (a module's tables share one global row space)
NUM_ROWS = 6  # rows of the table
DIM = 7  # embedding_dim of the table (an int32 value)
OUTPUT_OFFSET = 8  # first column of the group in a pooled output row (an int32 value)
FEATURE = 9  # the row's own number g (an int32 value), kept by a copy of some of the rows
DESCRIPTOR_COLUMNS = 16  # columns 10-15 are zero: a row is one 128-byte cache line

# Columns whose values fit int32, read as 32-bit words by the Triton kernels.
INT32_COLUMNS = (DIM, OUTPUT_OFFSET, FEATURE)
COLUMN_NAMES = ("weights_address", "weights_stride", "state_address", "state_stride", "state_width", "row_offset",
                "num_rows", "dim", "output_offset", "feature")


def describe_tables(
    weights: Sequence[torch.Tensor],
    states: Sequence[torch.Tensor | None],
    row_offsets: Sequence[int],
    output_offsets: Sequence[int] | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """int64 ``[G, DESCRIPTOR_COLUMNS]`` on ``device``: row ``g`` describes ``weights[g]``
    (``[num_rows, dim]``, rows of contiguous elements) and its fp32 state ``states[g]``
    (``[num_rows, width]`` or ``None``), global row ``row_offsets[g]`` at its row 0, output
    column ``output_offsets[g]`` (default 0). The tensors must stay alive while the
    descriptor is used: it holds their addresses, not references."""
    if not len(weights) == len(states) == len(row_offsets):
        raise ValueError("describe_tables needs one state entry and one row offset per weights tensor")
    output_offsets = [0] * len(weights) if output_offsets is None else list(output_offsets)
    rows = torch.zeros(len(weights), DESCRIPTOR_COLUMNS, dtype=torch.int64)
    for g, (table, state) in enumerate(zip(weights, states)):
        rows[g, WEIGHTS_ADDRESS] = table.data_ptr()
        rows[g, WEIGHTS_STRIDE] = table.stride(0)
        if state is not None:
            rows[g, STATE_ADDRESS] = state.data_ptr()
            rows[g, STATE_STRIDE] = state.stride(0)
            rows[g, STATE_WIDTH] = state.shape[1]
        rows[g, ROW_OFFSET] = row_offsets[g]
        rows[g, NUM_ROWS] = table.shape[0]
        rows[g, DIM] = table.shape[1]
        rows[g, OUTPUT_OFFSET] = output_offsets[g]
        rows[g, FEATURE] = g
    if len(weights) and int(rows[:, list(INT32_COLUMNS)].max()) > torch.iinfo(torch.int32).max:
        raise ValueError("a dim or output column past 2^31 does not fit the descriptor's int32 columns")
    return rows.to(device)


def descriptor_row(descriptor: torch.Tensor, g: int) -> dict[str, int]:
    """Row ``g`` of a descriptor as ``{column name: value}`` (tests, debugging)."""
    return dict(zip(COLUMN_NAMES, (int(v) for v in descriptor[g, :len(COLUMN_NAMES)].cpu())))
