"""A batch's runs by column group: the backward updates each group's rows with tiles of its own width.

The backward's sort puts a batch's runs (its distinct rows) in global row order, and a table's rows
are one range of global rows, so each table's runs are one range of run numbers. The row-update
kernel of a column group (``RowStores.table_groups``: the tables whose dims round up alike) walks
the runs of its tables only, as if they were numbered ``0, 1, ...`` group by group: *grouped run*
``v`` of the group whose tables sit at entries ``j`` of ``TableGroups.tables`` is run ``v +
run_shift[j]`` for the entry with ``runs_end[j - 1] <= v < runs_end[j]``. On the mixed benchmark shape
a dim-8 row then takes 8 columns of a tile of 16 rows rather than 256 columns of a tile of one.

``plan_run_groups`` computes ``runs_end`` and ``run_shift`` on the device (one program: a binary
search of each table's first global row in the sorted rows), so nothing is read back and a CUDA
graph of the backward serves every batch of its shape; ``grouped_runs`` maps a tile's grouped runs
to run numbers inside the row-update kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rows import TableGroups


@triton.jit
def _lower_bound(
    sorted_ptr,  # int32/int64 [N]: ascending values
    values,  # int64 tensor: the values to find
    n,  # N
    STEPS: tl.constexpr,  # at least N's bit length: the search's halvings
):
    """int64, the shape of ``values``: the first position whose value is ``>= values`` (N if none)."""
    low = tl.zeros_like(values)
    high = tl.zeros_like(values) + n
    for _ in range(STEPS):
        searching = low < high
        middle = (low + high) // 2
        below = tl.load(sorted_ptr + middle, mask=searching, other=0).to(tl.int64) < values
        low = tl.where(searching & below, middle + 1, low)
        high = tl.where(searching & ~below, middle, high)
    return low


@triton.jit
def _run_of_position(
    positions,  # int64 tensor: sorted positions, each the first of its run, or N
    run_count_ptr,  # int32 [N]: runs begun up to and including each position
    num_runs_ptr,  # int32 [1]: runs of the batch
    n,  # N
):
    """int64: the run each position begins (the batch's count of runs for N)."""
    inside = positions < n
    runs = tl.load(run_count_ptr + positions, mask=inside, other=0).to(tl.int64) - 1
    return tl.where(inside, runs, tl.load(num_runs_ptr).to(tl.int64))


@triton.jit
def _plan_kernel(
    runs_end_ptr,  # int32 [T] out: runs of the tables up to and including each entry of `tables` (grouped runs)
    run_shift_ptr,  # int32 [T] out: run number minus grouped run, for the runs of each entry's table
    tables_ptr,  # int32 [T]: the tables, group by group (TableGroups.tables)
    row_starts_ptr,  # int64 [T + 1]: global row of each table's row 0, then the end of all rows
    sorted_rows_ptr,  # int32/int64 [N]: the batch's global rows, ascending
    run_count_ptr,  # int32 [N]: runs begun up to and including each sorted position
    num_runs_ptr,  # int32 [1]: runs of the batch
    num_tables,  # T
    num_lookups,  # N
    STEPS: tl.constexpr,  # at least N's bit length
    BLOCK_T: tl.constexpr,  # a power of two >= T: one program plans every table
):
    entries = tl.arange(0, BLOCK_T)
    inside = entries < num_tables
    tables = tl.load(tables_ptr + entries, mask=inside, other=0)
    first_rows = tl.load(row_starts_ptr + tables, mask=inside, other=0)
    end_rows = tl.load(row_starts_ptr + tables + 1, mask=inside, other=0)
    first_runs = _run_of_position(_lower_bound(sorted_rows_ptr, first_rows, num_lookups, STEPS), run_count_ptr,
                                  num_runs_ptr, num_lookups)
    end_runs = _run_of_position(_lower_bound(sorted_rows_ptr, end_rows, num_lookups, STEPS), run_count_ptr,
                                num_runs_ptr, num_lookups)
    runs = tl.where(inside, end_runs - first_runs, 0)
    runs_end = tl.cumsum(runs, axis=0)
    tl.store(runs_end_ptr + entries, runs_end.to(tl.int32), mask=inside)
    tl.store(run_shift_ptr + entries, (first_runs - (runs_end - runs)).to(tl.int32), mask=inside)


def plan_run_groups(groups: TableGroups, sorted_rows: torch.Tensor, run_count: torch.Tensor,
                    num_runs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(runs_end, run_shift)``, int32 [T] each on the device (the module docstring): where the
    runs of each table of ``groups.tables`` lie among the batch's runs.

    Args:
        groups: the stores' tables by column tile.
        sorted_rows: int32/int64 [N], the batch's global rows, ascending (``SortedLookups``).
        run_count: int32 [N], runs begun up to and including each sorted position.
        num_runs: int32 [1], the batch's runs.
    """
    num_tables = groups.tables.numel()
    num_lookups = sorted_rows.numel()
    runs_end = torch.empty(num_tables, dtype=torch.int32, device=sorted_rows.device)
    run_shift = torch.empty_like(runs_end)
    _plan_kernel[(1,)](runs_end, run_shift, groups.tables, groups.row_starts, sorted_rows, run_count, num_runs,
                       num_tables, num_lookups, STEPS=max(1, num_lookups.bit_length()),
                       BLOCK_T=triton.next_power_of_2(num_tables))
    return runs_end, run_shift


@triton.jit
def grouped_runs(
    grouped,  # int32/int64 [ROWS]: grouped runs of one column group, each below the group's end
    valid,  # bool [ROWS]: which of them exist
    runs_end_ptr,  # int32 [T]: plan_run_groups' runs_end
    run_shift_ptr,  # int32 [T]: plan_run_groups' run_shift
    group_begin,  # the group's first entry of TableGroups.tables
    group_end,  # one past its last
    TABLE_STEPS: tl.constexpr,  # at least T's bit length
):
    """int64 [ROWS]: the run numbers of ``grouped`` (``valid`` ones; others unspecified): the entry
    of each by a binary search of ``runs_end`` within the group."""
    grouped = grouped.to(tl.int64)
    low = tl.zeros_like(grouped) + group_begin
    high = tl.zeros_like(grouped) + (group_end - 1)  # the entry is at most the group's last
    for _ in range(TABLE_STEPS):
        searching = valid & (low < high)
        middle = (low + high) // 2
        past = tl.load(runs_end_ptr + middle, mask=searching, other=0).to(tl.int64) > grouped
        low = tl.where(searching & ~past, middle + 1, low)
        high = tl.where(searching & past, middle, high)
    return grouped + tl.load(run_shift_ptr + low, mask=valid, other=0).to(tl.int64)
