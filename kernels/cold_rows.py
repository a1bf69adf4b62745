"""Step 3 of the backward (``kernels/backward.py``): the rows of fewer than ``2 * CHUNK - 1`` lookups.

``_row_update_kernel`` takes tiles of ``ROWS`` consecutive runs of the batch's sorted lookups (a
run: the lookups of one row), sums each run's gradient and applies the optimizer to the tile's rows
at once (``kernels/update_rows.py``). Its name keeps the underscore it had in ``backward.py``: the
kernel profiles in ``results/measurements.jsonl`` name it so.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .run_groups import grouped_runs
from .update_rows import (
    grad_output_of_step,
    gradients_of_keys,
    lookup_gradients,
    lookup_keys,
    run_columns,
    update_rows,
)


@triton.jit(do_not_specialize=["num_lookups", "batch_size"])
def _row_update_kernel(
    num_runs_ptr,  # int32 [1]: runs of the batch
    run_end_ptr,  # int32 [N]: one past the last position of each run; N past the last run
    order_ptr,  # int32 [N]: lookup at each sorted position (read for pooling none only)
    sorted_bags_ptr,  # int32 [N]: bag of the lookup at each sorted position
    sorted_weights_ptr,  # fp32 [N]: per-sample weight at each sorted position (if HAS_PER_SAMPLE_WEIGHTS)
    offsets_ptr,  # int32/int64 [F*B+1]: bag boundaries
    step_args_ptr,  # int64 [STEP_ARGS]: this step's arguments (step_arguments: grad_output, seed, step)
    grad_output_stride,  # elements between consecutive rows of grad_output
    descriptor_ptr,  # int64 [F, DESCRIPTOR_COLUMNS]: each feature's table and output column (base/descriptors.py)
    sorted_rows_ptr,  # int32/int64 [N]: global rows, ascending
    sorted_slots_ptr,  # int32 [N]: slot of the row at each sorted position, or -1 (read only if USE_CACHE)
    cache_weights_ptr,  # [num_slots, row_width] slot rows
    cache_weights_stride,  # elements between consecutive slots
    cache_state_ptr,  # fp32 [num_slots, state_width] slot state
    cache_state_stride,  # elements between consecutive slots of cache_state
    hyper_ptr,  # fp32 [NUM_HYPER]: the optimizer's hyper-parameters
    sorted_ranks_ptr,  # int32 [N]: copy row of the row at each sorted position, or -1 (read only if READS_COPIES)
    copies_ptr,  # [num_copies, row_width]: the rows read in place as the forward read them (kernels/in_place_copies.py)
    copies_stride,  # elements between consecutive copy rows
    num_copies,  # copy rows
    rows_end,  # one past the last global row: a padded batch's padding row (never updated)
    runs_end_ptr,  # int32 [T]: grouped runs up to each entry of TableGroups.tables (if GROUPED: kernels/run_groups.py)
    run_shift_ptr,  # int32 [T]: run number minus grouped run of each entry's runs (if GROUPED)
    group_begin,  # the column group's first entry of TableGroups.tables (if GROUPED)
    group_end,  # one past its last (if GROUPED)
    num_lookups,  # N
    batch_size,  # B
    POOLING: tl.constexpr,  # pooling code
    HAS_PER_SAMPLE_WEIGHTS: tl.constexpr,  # whether lookups carry per-sample weights
    ALIGN: tl.constexpr,  # every dim and output column offset is a multiple of this many elements
    GRAD_ALIGN_BYTES: tl.constexpr,  # alignment of grad_output row slices
    SHARED_TABLES: tl.constexpr,  # some table is looked up by several features (a run's lookups may differ in theirs)
    CHUNK: tl.constexpr,  # sorted positions per window: runs holding a whole one are hot
    USE_CACHE: tl.constexpr,  # whether any lookup may have a slot
    READS_COPIES: tl.constexpr,  # read each row that has a copy row from it (the forward's copy)
    OPTIMIZER_LOAD_STATE: tl.constexpr,  # the optimizer's Triton functions (kernels/optimizers/base.py)
    OPTIMIZER_UPDATE: tl.constexpr,
    OPTIMIZER_STORE_STATE: tl.constexpr,
    STOCHASTIC_ROUNDING: tl.constexpr,  # round fp16 / bf16 weights stochastically
    NUM_HYPER: tl.constexpr,  # hyper-parameters the optimizer reads
    ALIGN_BYTES: tl.constexpr,  # every weights row starts at a multiple of this many bytes
    STATE_ALIGN_BYTES: tl.constexpr,  # every state row starts at a multiple of this many bytes
    ROWS: tl.constexpr,  # runs per program
    BLOCK_L: tl.constexpr,  # lookups of each run per step in tiles whose longest run has more than one
    BLOCK_D: tl.constexpr,  # the column tile: the next power of two of the widest dim (of the group, if GROUPED)
    GROUPED: tl.constexpr,  # update the runs of one column group's tables only (its grouped runs)
    TABLE_STEPS: tl.constexpr,  # at least T's bit length (if GROUPED)
):
    # Tiles of runs, a grid's stride apart, up to the batch's count of runs (read here, on the device):
    # a grid sized by lookups would mostly be programs that find no run (90% of them on Criteo).
    if GROUPED:  # the group's grouped runs, first_grouped .. end_grouped - 1
        first_grouped = tl.load(runs_end_ptr + tl.maximum(group_begin - 1, 0))
        first_grouped = tl.where(group_begin > 0, first_grouped, 0)
        end_grouped = tl.load(runs_end_ptr + group_end - 1)
        num_tiles = (end_grouped - first_grouped + ROWS - 1) // ROWS
    else:
        num_tiles = (tl.load(num_runs_ptr) + ROWS - 1) // ROWS
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        if GROUPED:
            grouped = first_grouped + tile * ROWS + tl.arange(0, ROWS)
            in_group = grouped < end_grouped
            runs = grouped_runs(grouped, in_group, runs_end_ptr, run_shift_ptr, group_begin, group_end, TABLE_STEPS)
            runs = tl.where(in_group, runs, num_lookups)  # run numbers from N read as empty runs
        else:
            runs = tile * ROWS + tl.arange(0, ROWS)
        starts, ends, row_mask = _runs_of_tile(runs, run_end_ptr, num_lookups, CHUNK)
        global_rows = tl.load(sorted_rows_ptr + starts, mask=row_mask, other=0).to(tl.int64)
        row_mask = row_mask & (global_rows < rows_end)
        if tl.max(row_mask.to(tl.int32), axis=0) > 0:  # not a tile of hot runs only
            columns = tl.arange(0, BLOCK_D)
            grad_output_ptr = grad_output_of_step(step_args_ptr)
            features, dims, first_columns = run_columns(starts, row_mask, sorted_bags_ptr, descriptor_ptr,
                                                      batch_size, ALIGN)
            mask = row_mask[:, None] & (columns[None, :] < dims[:, None])
            longest = tl.max(tl.where(row_mask, ends - starts, 0), axis=0)
            gradient_args = (order_ptr, sorted_bags_ptr, offsets_ptr, sorted_weights_ptr, grad_output_ptr,
                             grad_output_stride, batch_size, descriptor_ptr, columns)
            if BLOCK_L == 1:
                grad = _sum_runs_one_lane(starts, ends, row_mask, features, first_columns, mask, longest, gradient_args,
                                          ROWS, POOLING, HAS_PER_SAMPLE_WEIGHTS, GRAD_ALIGN_BYTES, SHARED_TABLES,
                                          ALIGN, BLOCK_D)
            elif longest == 1:  # runs of one lookup (most tiles at uniform lookups): no idle lanes
                grad = _sum_runs_one_lane(starts, ends, row_mask, features, first_columns, mask, longest, gradient_args,
                                          ROWS, POOLING, HAS_PER_SAMPLE_WEIGHTS, GRAD_ALIGN_BYTES, SHARED_TABLES,
                                          ALIGN, BLOCK_D)
            else:  # [ROWS, BLOCK_L, BLOCK_D] tiles, summed over their lanes in registers
                lanes = tl.arange(0, BLOCK_L)
                grad = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
                for step_start in range(0, longest, BLOCK_L):
                    positions = starts[:, None] + step_start + lanes[None, :]
                    grad += tl.sum(lookup_gradients(positions, (positions < ends[:, None]) & row_mask[:, None],
                                                    features[:, None], first_columns[:, None], mask[:, None, :],
                                                    *gradient_args, POOLING, HAS_PER_SAMPLE_WEIGHTS,
                                                    GRAD_ALIGN_BYTES, SHARED_TABLES, ALIGN), axis=1)
            slots = tl.zeros_like(features)
            if USE_CACHE:
                slots = tl.load(sorted_slots_ptr + starts, mask=row_mask, other=-1)
            ranks = slots
            if READS_COPIES:
                ranks = tl.load(sorted_ranks_ptr + starts, mask=row_mask, other=-1)
            update_rows(global_rows, features, slots, grad, row_mask, dims, columns, mask, descriptor_ptr,
                        cache_weights_ptr, cache_weights_stride, cache_state_ptr, cache_state_stride, ranks,
                        copies_ptr, copies_stride, num_copies, step_args_ptr, hyper_ptr, NUM_HYPER,
                        OPTIMIZER_LOAD_STATE, OPTIMIZER_UPDATE, OPTIMIZER_STORE_STATE, USE_CACHE, READS_COPIES,
                        STOCHASTIC_ROUNDING, ALIGN_BYTES, STATE_ALIGN_BYTES)


@triton.jit
def _sum_runs_one_lane(
    starts,  # int64 [ROWS]: first sorted position of each run
    ends,  # int64 [ROWS]: one past its last
    row_mask,  # bool [ROWS]: which runs count
    features,  # int32 [ROWS]: the feature of each run's first lookup
    first_columns,  # int32 [ROWS]: its first column in a grad_output row
    in_row,  # bool [ROWS, BLOCK_D]: its columns
    longest,  # scalar: the longest run of the tile
    gradient_args,  # lookup_gradients' pointer and size arguments, as _row_update_kernel passes them
    ROWS: tl.constexpr, POOLING: tl.constexpr, HAS_PER_SAMPLE_WEIGHTS: tl.constexpr,
    GRAD_ALIGN_BYTES: tl.constexpr, SHARED_TABLES: tl.constexpr, ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr,  # as _row_update_kernel's
):
    """fp32 [ROWS, BLOCK_D]: each run's gradient, one lookup of every run a step.

    A step's gradient row is addressed by its key (bag), itself a load: walked plainly, each step
    would wait for two loads one after the other. The next step's keys are loaded before this
    step's rows are waited for, so a step waits for one round trip (neutral to 0.07 ms faster on
    the H200's backwards)."""
    order_ptr, sorted_bags_ptr, offsets_ptr, sorted_weights_ptr, grad_output_ptr, grad_output_stride, batch_size, \
        descriptor_ptr, columns = gradient_args
    grad = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    keys = lookup_keys(starts, (starts < ends) & row_mask, order_ptr, sorted_bags_ptr, POOLING)
    for step_start in range(0, longest):
        positions = starts + step_start
        following = positions + 1
        next_keys = lookup_keys(following, (following < ends) & row_mask, order_ptr, sorted_bags_ptr, POOLING)
        grad += gradients_of_keys(keys, positions, (positions < ends) & row_mask, features, first_columns, in_row,
                                  offsets_ptr, sorted_weights_ptr, grad_output_ptr, grad_output_stride, batch_size,
                                  descriptor_ptr, columns, POOLING, HAS_PER_SAMPLE_WEIGHTS, GRAD_ALIGN_BYTES,
                                  SHARED_TABLES, ALIGN)
        keys = next_keys
    return grad


@triton.jit
def _runs_of_tile(
    runs,  # int32 tensor: run numbers
    run_end_ptr,  # int32 [N]: one past the last position of each run; N past the last run
    num_lookups,  # N (run numbers from N on read as empty runs)
    CHUNK: tl.constexpr,  # window of sorted positions: a run holding a whole one is the hot kernel's
):
    """``(starts, ends, mask)`` of ``runs``: int64 first and one-past-last sorted positions, and
    which runs exist (are not empty) and are not hot (the row-update kernel's)."""
    inside = runs < num_lookups
    starts = tl.load(run_end_ptr + runs - 1, mask=(runs > 0) & inside, other=num_lookups).to(tl.int64)
    starts = tl.where(runs == 0, 0, starts)
    ends = tl.load(run_end_ptr + runs, mask=inside, other=num_lookups).to(tl.int64)
    hot = ((starts + CHUNK - 1) // CHUNK + 1) * CHUNK <= ends  # holds a pure window
    return starts, ends, (ends > starts) & ~hot
