"""HostRows (the staged mover's host side): both copies against plain torch indexing."""

from __future__ import annotations

import pytest
import torch

from tiered_tbe.cache.host_rows import HOST_COPIES, HostRows
from tiered_tbe.cache.tables import CachedTable


def tables_of(layout, dtype):
    """Cached tables over shared flat buffers: ``layout`` is a list of (num_rows, dim, state_width,
    buffer name); tables naming one buffer sit in it one after another (one segment)."""
    sizes, tables, start = {}, [], 0
    for num_rows, dim, width, name in layout:
        sizes.setdefault(name, [0, 0])
        sizes[name][0] += num_rows * dim
        sizes[name][1] += num_rows * width
    buffers = {name: ((torch.randn(w) * 100).to(dtype), torch.randn(s)) for name, (w, s) in sizes.items()}
    used = {name: [0, 0] for name in sizes}
    for num_rows, dim, width, name in layout:
        weights_buffer, state_buffer = buffers[name]
        w0, s0 = used[name]
        weights = weights_buffer[w0: w0 + num_rows * dim].view(num_rows, dim)
        state = state_buffer[s0: s0 + num_rows * width].view(num_rows, width) if width else None
        used[name] = [w0 + num_rows * dim, s0 + num_rows * width]
        tables.append(CachedTable(start, num_rows, dim, weights, state))
        start += num_rows + 3  # a gap of rows no table has
    return tables


LAYOUTS = {
    "one segment": [(50, 8, 1, "a"), (1, 8, 1, "a"), (30, 8, 1, "a")],
    "segments of odd dims, one without state": [(40, 5, 2, "a"), (7, 3, 0, "b"), (25, 5, 2, "c")],
}


@pytest.mark.parametrize("copy", HOST_COPIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # fp16 moves as bf16 does: 2-byte words
@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_gather_and_scatter_match_torch_indexing(copy, dtype, layout):
    tables = tables_of(LAYOUTS[layout], dtype)
    host = HostRows(tables, copy)
    row_width, state_width = max(t.dim for t in tables) + 1, max(t.state_width for t in tables) + 1
    rows = torch.cat([t.global_row_start + torch.randperm(t.num_rows)[: max(1, t.num_rows // 2)] for t in tables])
    rows = rows.sort().values
    weights_out = torch.full((rows.numel(), row_width), float("nan")).to(dtype)  # poisoned
    state_out = torch.full((rows.numel(), state_width), float("nan"))
    host.gather(rows, weights_out, state_out)
    for i, row in enumerate(rows.tolist()):
        table = next(t for t in tables if t.global_row_start <= row < t.global_row_end)
        local = row - table.global_row_start
        assert torch.equal(weights_out[i, : table.dim], table.weights[local]), (i, row)
        if table.state is not None:
            assert torch.equal(state_out[i, : table.state_width], table.state[local])
    # Scatter new values back to the same rows; every other row keeps its value.
    before = [(t.weights.clone(), None if t.state is None else t.state.clone()) for t in tables]
    new_weights = (torch.randn(rows.numel(), row_width) * 100).to(dtype)
    new_state = torch.randn(rows.numel(), state_width)
    host.scatter(rows, new_weights, new_state)
    for table, (weights, state) in zip(tables, before):
        mine = (rows >= table.global_row_start) & (rows < table.global_row_end)
        local = rows[mine] - table.global_row_start
        weights[local] = new_weights[mine, : table.dim]
        assert torch.equal(table.weights, weights)
        if state is not None:
            state[local] = new_state[mine, : table.state_width]
            assert torch.equal(table.state, state)


@pytest.mark.parametrize("copy", HOST_COPIES)
def test_no_rows_copy_nothing_and_unknown_copy_is_refused(copy):
    tables = tables_of(LAYOUTS["one segment"], torch.float32)
    host = HostRows(tables, copy)
    out = torch.zeros(0, 8), torch.zeros(0, 1)
    host.gather(torch.empty(0, dtype=torch.int64), *out)
    host.scatter(torch.empty(0, dtype=torch.int64), *out)
    with pytest.raises(ValueError, match="host copy must be one of"):
        HostRows(tables, "memcpy")
