"""The hot rows of the backward: runs holding a whole window of ``CHUNK`` sorted positions.

``hot_window_sums_kernel`` sums each pure window (``WINDOWS`` windows a program),
``hot_group_sums_kernel`` each pure group of ``GROUP`` windows, and ``hot_row_update_kernel``
(``WINDOWS`` windows a program; a run's first pure window owns the run) adds its run's group and window
sums and the lookups before its first and after its last pure window, then applies the optimizer
(``kernels/update_rows.py``). Launched by ``kernels/backward.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .update_rows import grad_output_of_step, lookup_gradients, run_columns, update_rows


@triton.jit(do_not_specialize=["num_lookups", "batch_size"])
def hot_window_sums_kernel(
    window_sums_ptr,  # fp32 [cdiv(N, CHUNK), BLOCK_D] out: gradient sum of each pure window
    run_count_ptr,  # int32 [N]: runs begun up to each sorted position
    order_ptr,  # int32 [N]: lookup at each sorted position (read for pooling none only)
    sorted_bags_ptr,  # int32 [N]: bag of the lookup at each sorted position
    sorted_weights_ptr,  # fp32 [N]: per-sample weight at each sorted position (if HAS_PER_SAMPLE_WEIGHTS)
    offsets_ptr,  # int32/int64 [F*B+1]: bag boundaries
    step_args_ptr,  # int64 [STEP_ARGS]: this step's arguments (step_arguments: grad_output's address)
    grad_output_stride,  # elements between consecutive rows of grad_output
    descriptor_ptr,  # int64 [F, DESCRIPTOR_COLUMNS]: each feature's table and output column (base/descriptors.py)
    sorted_rows_ptr,  # int32/int64 [N]: global rows, ascending
    rows_end,  # one past the last global row: a padded batch's padding row (its windows are not summed)
    num_lookups,  # N
    batch_size,  # B
    POOLING: tl.constexpr,  # pooling code
    HAS_PER_SAMPLE_WEIGHTS: tl.constexpr,  # whether lookups carry per-sample weights
    ALIGN: tl.constexpr,  # every dim and output column offset is a multiple of this many elements
    GRAD_ALIGN_BYTES: tl.constexpr,  # alignment of grad_output row slices
    SHARED_TABLES: tl.constexpr,  # some table is looked up by several features (a run's lookups may differ in theirs)
    CHUNK: tl.constexpr,  # sorted positions per window: runs holding a whole one are hot
    WINDOWS: tl.constexpr,  # windows per program
    BLOCK_D: tl.constexpr,  # next power of two of the largest embedding_dim
):
    # WINDOWS windows a program, their purity read at once: most windows are not pure (nearly all
    # at uniform lookups), and a program per window spent its time starting programs.
    lanes = tl.arange(0, WINDOWS)
    windows = tl.program_id(0).to(tl.int64) * WINDOWS + lanes
    inside = (windows + 1) * CHUNK <= num_lookups
    pure = inside & (tl.load(run_count_ptr + windows * CHUNK, mask=inside, other=0)
                     == tl.load(run_count_ptr + windows * CHUNK + CHUNK - 1, mask=inside, other=-1))
    pure = pure & (tl.load(sorted_rows_ptr + windows * CHUNK, mask=pure, other=0) < rows_end)
    if tl.max(pure.to(tl.int32), axis=0) > 0:
        columns = tl.arange(0, BLOCK_D)
        grad_output_ptr = grad_output_of_step(step_args_ptr)
        for lane in range(0, WINDOWS):
            if tl.sum(tl.where(pure & (lanes == lane), 1, 0), axis=0) > 0:
                window = tl.program_id(0).to(tl.int64) * WINDOWS + lane
                positions = window * CHUNK + tl.arange(0, CHUNK)
                # A pure window lies in one run: one table, read once.
                feature, dims, first_column = run_columns(window * CHUNK, window >= 0, sorted_bags_ptr, descriptor_ptr,
                                                          batch_size, ALIGN)
                tile = lookup_gradients(
                    positions, positions >= 0, feature, first_column, (columns < dims)[None, :], order_ptr,
                    sorted_bags_ptr, offsets_ptr, sorted_weights_ptr, grad_output_ptr, grad_output_stride, batch_size,
                    descriptor_ptr, columns, POOLING, HAS_PER_SAMPLE_WEIGHTS, GRAD_ALIGN_BYTES, SHARED_TABLES, ALIGN)
                tl.store(window_sums_ptr + window * BLOCK_D + columns, tl.sum(tile, axis=0))


@triton.jit(do_not_specialize=["num_lookups"])
def hot_group_sums_kernel(
    group_sums_ptr,  # fp32 [cdiv(cdiv(N, CHUNK), GROUP), BLOCK_D] out: sum of each pure group of windows
    window_sums_ptr,  # fp32 [cdiv(N, CHUNK), BLOCK_D]: gradient sum of each pure window
    run_count_ptr,  # int32 [N]: runs begun up to each sorted position
    num_lookups,  # N
    CHUNK: tl.constexpr,  # sorted positions per window
    GROUP: tl.constexpr,  # windows per group
    BLOCK_D: tl.constexpr,  # next power of two of the largest embedding_dim
):
    """Second level for the hottest rows: a group of GROUP windows inside one run is summed once,
    so the run's owner adds at most ~2 GROUP window sums beside its groups' sums."""
    group = tl.program_id(0).to(tl.int64)
    first = group * GROUP * CHUNK
    last = first + GROUP * CHUNK - 1
    if last < num_lookups:
        if tl.load(run_count_ptr + first) == tl.load(run_count_ptr + last):  # every window pure, one run
            columns = tl.arange(0, BLOCK_D)
            windows = group * GROUP + tl.arange(0, GROUP)
            sums = tl.load(window_sums_ptr + windows[:, None] * BLOCK_D + columns[None, :])
            tl.store(group_sums_ptr + group * BLOCK_D + columns, tl.sum(sums, axis=0))


@triton.jit
def _sum_rows(
    rows_ptr,  # fp32 [M, BLOCK_D]: rows to add
    first,  # int64: first row
    last,  # int64: last row (inclusive; none when last < first)
    in_row,  # bool [1, BLOCK_D]: the columns that count
    BLOCK_P: tl.constexpr,  # rows added per step
    BLOCK_D: tl.constexpr,  # columns
):
    """fp32 [BLOCK_D]: the sum of rows first..last of a [M, BLOCK_D] buffer."""
    columns = tl.arange(0, BLOCK_D)
    sums = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
    for row_start in range(first, last + 1, BLOCK_P):
        rows = row_start + tl.arange(0, BLOCK_P)
        sums += tl.load(rows_ptr + rows[:, None] * BLOCK_D + columns[None, :], mask=(rows <= last)[:, None] & in_row,
                        other=0.0)
    return tl.sum(sums, axis=0)


@triton.jit(do_not_specialize=["num_lookups", "batch_size"])
def hot_row_update_kernel(
    window_sums_ptr,  # fp32 [cdiv(N, CHUNK), BLOCK_D]: gradient sum of each pure window
    group_sums_ptr,  # fp32 [cdiv(cdiv(N, CHUNK), GROUP), BLOCK_D]: sum of each pure group of windows
    run_count_ptr,  # int32 [N]: runs begun up to each sorted position
    run_end_ptr,  # int32 [N]: one past the last position of each run
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
    GROUP: tl.constexpr,  # windows per group
    WINDOWS: tl.constexpr,  # windows per program
    BLOCK_P: tl.constexpr,  # window sums added per step
    BLOCK_L: tl.constexpr,  # lookups before the first / after the last pure window summed per step
    BLOCK_D: tl.constexpr,  # next power of two of the largest embedding_dim
):
    # A program looks at WINDOWS windows at once and works only for those that own a run (about
    # one in 20 on Criteo): a program per window was mostly programs that found nothing to do.
    lanes = tl.arange(0, WINDOWS)
    windows = tl.program_id(0).to(tl.int64) * WINDOWS + lanes
    inside = (windows + 1) * CHUNK <= num_lookups
    run_counts = tl.load(run_count_ptr + windows * CHUNK, mask=inside, other=0)
    pure = inside & (run_counts == tl.load(run_count_ptr + windows * CHUNK + CHUNK - 1, mask=inside, other=-1))
    run_starts = tl.load(run_end_ptr + run_counts - 2, mask=pure & (run_counts > 1), other=0).to(tl.int64)
    run_ends = tl.load(run_end_ptr + run_counts - 1, mask=pure, other=0).to(tl.int64)
    owns = pure & (windows == (run_starts + CHUNK - 1) // CHUNK)  # the run's first pure window owns it
    owns = owns & (tl.load(sorted_rows_ptr + windows * CHUNK, mask=owns, other=0) < rows_end)
    for lane in range(0, WINDOWS):
        this = lanes == lane
        if tl.sum(tl.where(owns & this, 1, 0), axis=0) > 0:
            # The owner's run, taken from the loads above (a sum over one lane).
            start = tl.sum(tl.where(this, run_starts, 0), axis=0)
            end = tl.sum(tl.where(this, run_ends, 0), axis=0)
            first_window = tl.program_id(0).to(tl.int64) * WINDOWS + lane
            _update_hot_run(
                start, end, first_window, window_sums_ptr, group_sums_ptr, order_ptr, sorted_bags_ptr,
                sorted_weights_ptr, offsets_ptr, step_args_ptr, grad_output_stride, descriptor_ptr, sorted_rows_ptr,
                sorted_slots_ptr, cache_weights_ptr, cache_weights_stride, cache_state_ptr, cache_state_stride,
                hyper_ptr, sorted_ranks_ptr, copies_ptr, copies_stride, num_copies, batch_size,
                POOLING, HAS_PER_SAMPLE_WEIGHTS, ALIGN, GRAD_ALIGN_BYTES, SHARED_TABLES, CHUNK, USE_CACHE,
                READS_COPIES, OPTIMIZER_LOAD_STATE,
                OPTIMIZER_UPDATE, OPTIMIZER_STORE_STATE, STOCHASTIC_ROUNDING, NUM_HYPER, ALIGN_BYTES,
                STATE_ALIGN_BYTES, GROUP, BLOCK_P, BLOCK_L, BLOCK_D)


@triton.jit
def _update_hot_run(
    start,  # int64: the run's first sorted position
    end,  # int64: one past its last
    first_window,  # int64: its first pure window
    window_sums_ptr, group_sums_ptr, order_ptr, sorted_bags_ptr, sorted_weights_ptr, offsets_ptr, step_args_ptr,
    grad_output_stride, descriptor_ptr, sorted_rows_ptr, sorted_slots_ptr, cache_weights_ptr, cache_weights_stride,
    cache_state_ptr, cache_state_stride, hyper_ptr, sorted_ranks_ptr, copies_ptr, copies_stride, num_copies,
    batch_size,  # the rest: as hot_row_update_kernel's
    POOLING: tl.constexpr, HAS_PER_SAMPLE_WEIGHTS: tl.constexpr, ALIGN: tl.constexpr, GRAD_ALIGN_BYTES: tl.constexpr,
    SHARED_TABLES: tl.constexpr, CHUNK: tl.constexpr, USE_CACHE: tl.constexpr, READS_COPIES: tl.constexpr,
    OPTIMIZER_LOAD_STATE: tl.constexpr,
    OPTIMIZER_UPDATE: tl.constexpr, OPTIMIZER_STORE_STATE: tl.constexpr, STOCHASTIC_ROUNDING: tl.constexpr,
    NUM_HYPER: tl.constexpr, ALIGN_BYTES: tl.constexpr, STATE_ALIGN_BYTES: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Sum one hot run's gradient and apply the optimizer to its row: the run's pure groups of
    windows, its windows outside them, then its lookups before the first and after the last pure
    window."""
    last_window = end // CHUNK - 1
    feature, dim, first_column = run_columns(start, start >= 0, sorted_bags_ptr, descriptor_ptr, batch_size, ALIGN)
    columns = tl.arange(0, BLOCK_D)
    one = tl.zeros([1], dtype=tl.int32)
    dims = one + dim
    in_row = columns[None, :] < dims[:, None]
    first_group = (first_window + GROUP - 1) // GROUP
    last_group = (last_window + 1) // GROUP - 1
    if first_group <= last_group:
        grad = _sum_rows(group_sums_ptr, first_group, last_group, in_row, BLOCK_P, BLOCK_D)
        grad += _sum_rows(window_sums_ptr, first_window, first_group * GROUP - 1, in_row, BLOCK_P, BLOCK_D)
        grad += _sum_rows(window_sums_ptr, (last_group + 1) * GROUP, last_window, in_row, BLOCK_P, BLOCK_D)
    else:
        grad = _sum_rows(window_sums_ptr, first_window, last_window, in_row, BLOCK_P, BLOCK_D)
    lanes = tl.arange(0, BLOCK_L)
    grad_output_ptr = grad_output_of_step(step_args_ptr)
    head_end = first_window * CHUNK
    tail_start = (last_window + 1) * CHUNK
    for offset in range(0, CHUNK, BLOCK_L):  # each part is shorter than CHUNK
        head = start + offset + lanes
        tail = tail_start + offset + lanes
        grad += tl.sum(lookup_gradients(
            head, head < head_end, feature, first_column, in_row, order_ptr, sorted_bags_ptr, offsets_ptr,
            sorted_weights_ptr, grad_output_ptr, grad_output_stride, batch_size, descriptor_ptr, columns,
            POOLING, HAS_PER_SAMPLE_WEIGHTS, GRAD_ALIGN_BYTES, SHARED_TABLES, ALIGN), axis=0)
        grad += tl.sum(lookup_gradients(
            tail, tail < end, feature, first_column, in_row, order_ptr, sorted_bags_ptr, offsets_ptr,
            sorted_weights_ptr, grad_output_ptr, grad_output_stride, batch_size, descriptor_ptr, columns,
            POOLING, HAS_PER_SAMPLE_WEIGHTS, GRAD_ALIGN_BYTES, SHARED_TABLES, ALIGN), axis=0)
    slots = one
    if USE_CACHE:
        slots = one + tl.load(sorted_slots_ptr + start)
    global_rows = one.to(tl.int64) + tl.load(sorted_rows_ptr + start).to(tl.int64)
    ranks = slots
    if READS_COPIES:
        ranks = one + tl.load(sorted_ranks_ptr + start)
    update_rows(global_rows, one + feature, slots, grad[None, :], one == 0, dims, columns, in_row,
                descriptor_ptr, cache_weights_ptr, cache_weights_stride, cache_state_ptr, cache_state_stride,
                ranks, copies_ptr, copies_stride, num_copies, step_args_ptr, hyper_ptr, NUM_HYPER,
                OPTIMIZER_LOAD_STATE, OPTIMIZER_UPDATE, OPTIMIZER_STORE_STATE, USE_CACHE, READS_COPIES,
                STOCHASTIC_ROUNDING, ALIGN_BYTES, STATE_ALIGN_BYTES)
