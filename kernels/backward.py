"""Backward of the pooled embedding bags with the optimizer fused in: each unique row updated once.

The gradient of a row is the sum, over every lookup of that row in the batch (in one bag or
across bags), of the output gradient of the lookup's bag (the table's columns) times the
lookup's per-sample weight, divided by the bag length for mean pooling. The optimizer
(``kernels/optimizers/``) then updates the row and its state once, in its slot when the
lookup's slot is ``>= 0``, else in its table's backing store.

How, without atomics and without a host synchronization (``sort_lookups``, then three kernels):

1. Sort the lookups by global row (``kernels/linearize.py`` then a radix sort on 32-bit keys
   when the rows fit) and run-length encode the sorted rows on the device: ``run_count[i]`` (runs
   begun up to sorted position ``i``, a cumulative sum) and ``run_end[u]`` (one past the last
   position of run ``u``); the number of runs stays on the device.
2. Hot rows. The sorted positions fall into windows of ``CHUNK``; a window inside one run is
   *pure*. A run holding a pure window is *hot*: ``_hot_window_sums_kernel`` sums each pure
   window (one program per window) into ``window_sums``, and ``_hot_row_update_kernel`` (one
   program per window; the first pure window of a run works) adds its run's window sums, the
   lookups before its first and after its last pure window, and applies the optimizer.
3. Other rows (fewer than ``2 * CHUNK - 1`` lookups): ``_row_update_kernel``, a persistent grid
   walking tiles of ``ROWS`` consecutive runs, sums each run's lookups ``BLOCK_L`` at a time
   and applies the optimizer to the tile's rows at once (a warp-sized slice of a program per
   row, as FBGEMM's warp-per-row kernels, with every load of the tile issued together).

Each row is owned by one program, so no two programs write the same row, and every sum runs in
an order fixed by the inputs: two identical steps give bit-identical results.

Per-sample-weight gradients (``kernels/per_sample_weights.py``) need the rows before the update: the
caller computes them first.
"""

from __future__ import annotations

import math
import os
import struct
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tiered_tbe.base.graphs import to_device

from .addressing import (
    INTERPRETING,
    POOLING_MEAN_CONSTEXPR,
    POOLING_NONE,
    POOLING_NONE_CONSTEXPR,
    pooling_code,
    row_pointers,
    sum_lanes,
    table_row_zero,
)
from .grouping import SortedLookups, sort_lookups
from .optimizers import FusedOptimizer
from .rows import Lookups, RowStores, check_lookups


class BackwardConfig(NamedTuple):
    """Tile shapes of the backward kernels (``TIERED_TBE_BACKWARD=rows,lanes,warps,chunk``
    overrides the defaults, for tuning runs)."""

    rows: int  # runs per program of _row_update_kernel
    lanes: int  # lookups of each run per step
    num_warps: int
    chunk: int  # CHUNK: window of sorted positions; runs holding a whole window are hot


def default_config(block_d: int) -> BackwardConfig:
    """Measured on an H200 at dim 128 (benchmarks/RESULTS.md); the interpreter takes small tiles so
    the tests walk several steps and programs."""
    override = os.environ.get("TIERED_TBE_BACKWARD")
    if override:
        return BackwardConfig(*(int(value) for value in override.split(",")))
    if INTERPRETING:
        return BackwardConfig(rows=2, lanes=2, num_warps=4, chunk=4)
    return BackwardConfig(rows=max(1, min(16, 2048 // block_d)), lanes=1, num_warps=4 if block_d <= 256 else 8,
                          chunk=32)


# Windows per group of the second level of hot-row sums (a power of two).
HOT_GROUP = 4 if INTERPRETING else 32
# Lookups before a hot run's first pure window (and after its last) summed per step: a whole
# window at once, so the run's owner issues those loads together rather than in a chain of steps.
HOT_LANES = 2 if INTERPRETING else 32

__all__ = ["BackwardConfig", "HOT_GROUP", "SortedLookups", "backward_update", "default_config", "sort_lookups",
           "step_arguments"]


@triton.jit
def _grad_output_of_step(
    step_args_ptr,  # int64 [STEP_ARGS]: this step's arguments (see step_arguments)
):
    """The fp32 pointer to this step's grad_output, read from the step's arguments."""
    return tl.load(step_args_ptr).to(tl.pointer_type(tl.float32))


@triton.jit
def _load_hyper(
    hyper_ptr,  # fp32 [NUM_HYPER]: the optimizer's hyper-parameters
    NUM_HYPER: tl.constexpr,  # 1 to MAX_HYPER
):
    """The tuple of scalars an optimizer's update reads (``FusedOptimizer.kernel_hyper``)."""
    if NUM_HYPER == 1:
        return (tl.load(hyper_ptr),)
    elif NUM_HYPER == 2:
        return tl.load(hyper_ptr), tl.load(hyper_ptr + 1)
    elif NUM_HYPER == 3:
        return tl.load(hyper_ptr), tl.load(hyper_ptr + 1), tl.load(hyper_ptr + 2)
    elif NUM_HYPER == 4:
        return tl.load(hyper_ptr), tl.load(hyper_ptr + 1), tl.load(hyper_ptr + 2), tl.load(hyper_ptr + 3)
    elif NUM_HYPER == 5:
        return (tl.load(hyper_ptr), tl.load(hyper_ptr + 1), tl.load(hyper_ptr + 2), tl.load(hyper_ptr + 3),
                tl.load(hyper_ptr + 4))
    elif NUM_HYPER == 6:
        return (tl.load(hyper_ptr), tl.load(hyper_ptr + 1), tl.load(hyper_ptr + 2), tl.load(hyper_ptr + 3),
                tl.load(hyper_ptr + 4), tl.load(hyper_ptr + 5))
    elif NUM_HYPER == 7:
        return (tl.load(hyper_ptr), tl.load(hyper_ptr + 1), tl.load(hyper_ptr + 2), tl.load(hyper_ptr + 3),
                tl.load(hyper_ptr + 4), tl.load(hyper_ptr + 5), tl.load(hyper_ptr + 6))
    else:
        return (tl.load(hyper_ptr), tl.load(hyper_ptr + 1), tl.load(hyper_ptr + 2), tl.load(hyper_ptr + 3),
                tl.load(hyper_ptr + 4), tl.load(hyper_ptr + 5), tl.load(hyper_ptr + 6), tl.load(hyper_ptr + 7))


@triton.jit
def _lookup_gradients(
    positions,  # int64 [F]: sorted positions
    valid,  # bool [F]: which positions count
    order_ptr,  # int64 [N]: lookup at each sorted position (read for pooling none only)
    sorted_bags_ptr,  # int32 [N]: bag t*B+b of the lookup at each sorted position
    offsets_ptr,  # int32/int64 [T*B+1]: bag boundaries (mean pooling's bag lengths)
    sorted_weights_ptr,  # fp32 [N]: per-sample weight at each sorted position (if HAS_PER_SAMPLE_WEIGHTS)
    grad_output_ptr,  # fp32 [B, total_dim] or [N, max_dim] (pooling none)
    grad_output_stride,  # elements between consecutive rows of grad_output
    table_dim_ptr,  # int32 [T]: embedding_dim of each table
    table_output_offset_ptr,  # int32 [T]: first column of each table in a grad_output row
    batch_size,  # B
    columns,  # int32 [BLOCK_D]
    POOLING: tl.constexpr,  # pooling code (kernels/addressing.py)
    HAS_PER_SAMPLE_WEIGHTS: tl.constexpr,  # whether lookups carry per-sample weights
    ALIGN: tl.constexpr,  # every dim and output column offset is a multiple of this many elements
    GRAD_ALIGN_BYTES: tl.constexpr,  # every grad_output row slice starts at a multiple of this
):
    """fp32 [F, BLOCK_D]: d loss / d row of the lookup at each sorted position (zeros where not
    valid or past its table's dim)."""
    bags = tl.load(sorted_bags_ptr + positions, mask=valid, other=0)
    tables = bags // batch_size
    dims = tl.multiple_of(tl.load(table_dim_ptr + tables, mask=valid, other=0), ALIGN)
    if POOLING == POOLING_NONE_CONSTEXPR:
        pointers = grad_output_ptr + tl.load(order_ptr + positions, mask=valid, other=0) * grad_output_stride
    else:
        first_columns = tl.multiple_of(tl.load(table_output_offset_ptr + tables, mask=valid, other=0), ALIGN)
        pointers = grad_output_ptr + (bags % batch_size).to(tl.int64) * grad_output_stride + first_columns
    pointers = tl.multiple_of(pointers, GRAD_ALIGN_BYTES)
    tile = tl.load(pointers[:, None] + columns[None, :], mask=valid[:, None] & (columns[None, :] < dims[:, None]),
                   other=0.0)
    if HAS_PER_SAMPLE_WEIGHTS:
        tile = tile * tl.load(sorted_weights_ptr + positions, mask=valid, other=0.0)[:, None]
    if POOLING == POOLING_MEAN_CONSTEXPR:
        lengths = (tl.load(offsets_ptr + bags + 1, mask=valid, other=1)
                   - tl.load(offsets_ptr + bags, mask=valid, other=0))
        tile = tile / tl.maximum(lengths, 1).to(tl.float32)[:, None]
    return tile


@triton.jit
def _stochastic_round(
    values,  # fp32 tile: the exact new weights
    random_bits,  # uint32, same shape: uniform random bits, one word per value
    TARGET: tl.constexpr,  # tl.float16 or tl.bfloat16
):
    """fp32 values exactly representable in TARGET: the neighbour above or below, with probabilities
    that make the expected result equal to ``values``.

    Adding uniform random bits below the last kept mantissa bit, then truncating, rounds the
    magnitude up with probability equal to the dropped fraction. bf16 keeps the top 16 bits of an
    fp32 word; fp16 keeps 10 mantissa bits (13 dropped) in its normal range, and below 2^-14 has
    a fixed spacing of 2^-24, where we round ``|x| * 2^24`` up or down with a random threshold.
    """
    bits = values.to(tl.uint32, bitcast=True)
    if TARGET == tl.bfloat16:
        rounded = ((bits + (random_bits >> 16)) >> 16 << 16).to(tl.float32, bitcast=True)
    else:
        normal = ((bits + (random_bits >> 19)) >> 13 << 13).to(tl.float32, bitcast=True)
        threshold = (random_bits >> 8).to(tl.float32) * (1.0 / 16777216.0)  # uniform in [0, 1)
        magnitude = tl.floor(tl.abs(values) * 16777216.0 + threshold) * (1.0 / 16777216.0)
        subnormal = tl.where(values < 0, -magnitude, magnitude)
        rounded = tl.where(tl.abs(values) < 6.103515625e-05, subnormal, normal)  # 2^-14
    return tl.where(values != values, values, rounded)  # NaN stays NaN (its bits could carry into the sign)


@triton.jit
def _update_rows(
    global_rows,  # int64 [R]: the rows to update
    tables,  # int32 [R]: their tables
    slots,  # int32 [R]: the slot of each row, or -1 (ignored unless USE_CACHE)
    grad,  # fp32 [R, BLOCK_D]: each row's summed gradient (zeros outside mask)
    row_mask,  # bool [R]: which rows to update
    dims,  # int32 [R]: embedding_dim of each row's table
    columns,  # int32 [BLOCK_D]
    mask,  # bool [R, BLOCK_D]: row_mask and the table's columns
    table_weights_address_ptr,  # int64 [T]: address of row 0 of each table's weights
    table_weights_stride_ptr,  # int64 [T]: elements between rows of each table's weights
    table_state_address_ptr,  # int64 [T]: address of row 0 of each table's fp32 state (0: none)
    table_state_stride_ptr,  # int64 [T]: elements between rows of each table's state
    table_row_offset_ptr,  # int64 [T]: global row id of row 0 of each table
    cache_weights_ptr,  # [num_slots, row_width] slot rows; its element type is every row's
    cache_weights_stride,  # elements between consecutive slots of cache_weights
    cache_state_ptr,  # fp32 [num_slots, state_width]: optimizer state of cached rows
    cache_state_stride,  # elements between consecutive slots of cache_state
    step_args_ptr,  # int64 [STEP_ARGS]: this step's arguments (step_arguments: the philox key and step)
    hyper_ptr,  # fp32 [NUM_HYPER]: the optimizer's hyper-parameters (FusedOptimizer.kernel_hyper)
    NUM_HYPER: tl.constexpr,  # how many
    OPTIMIZER_LOAD_STATE: tl.constexpr,  # the optimizer's Triton functions (kernels/optimizers/base.py)
    OPTIMIZER_UPDATE: tl.constexpr,
    OPTIMIZER_STORE_STATE: tl.constexpr,
    USE_CACHE: tl.constexpr,  # whether any lookup may have a slot
    STOCHASTIC_ROUNDING: tl.constexpr,  # round fp16 / bf16 weights stochastically (else to nearest)
    ALIGN_BYTES: tl.constexpr,  # every weights row starts at a multiple of this many bytes
    STATE_ALIGN_BYTES: tl.constexpr,  # every state row starts at a multiple of this many bytes
):
    """Apply the optimizer to ``R`` rows in their slot or backing store, and store them."""
    element = cache_weights_ptr.dtype.element_ty
    table_rows = global_rows - tl.load(table_row_offset_ptr + tables, mask=row_mask, other=0)
    weight_rows = row_pointers(table_row_zero(table_weights_address_ptr, tables, element), table_rows,
                               tl.load(table_weights_stride_ptr + tables, mask=row_mask, other=0), slots,
                               cache_weights_ptr, cache_weights_stride, USE_CACHE, ALIGN_BYTES)
    state_rows = row_pointers(table_row_zero(table_state_address_ptr, tables, tl.float32), table_rows,
                              tl.load(table_state_stride_ptr + tables, mask=row_mask, other=0), slots,
                              cache_state_ptr, cache_state_stride, USE_CACHE, STATE_ALIGN_BYTES)

    # Every load of the rows and their state comes before the barrier below, every store after it.
    # Threads of a program may hold copies of the same values (a row-wise accumulator in every
    # thread of its row): a thread that stored before another one loaded would make that one
    # apply the update twice.
    weights = tl.load(weight_rows[:, None] + columns[None, :], mask=mask, other=0.0).to(tl.float32)
    state = OPTIMIZER_LOAD_STATE(state_rows, columns, row_mask, mask, dims)
    weights, state = OPTIMIZER_UPDATE(weights, grad, state, mask, dims, _load_hyper(hyper_ptr, NUM_HYPER))
    if STOCHASTIC_ROUNDING:
        seed = tl.load(step_args_ptr + 1).to(tl.int32)
        step = tl.load(step_args_ptr + 2).to(tl.int32)
        # Philox counter (column, row low word, row high word, step): a distinct draw per element and step.
        zeros = tl.zeros_like(mask.to(tl.int32))
        random_bits, _, _, _ = tl.philox(seed, columns[None, :] + zeros,
                                         (global_rows & 0xFFFFFFFF).to(tl.int32)[:, None] + zeros,
                                         (global_rows >> 32).to(tl.int32)[:, None] + zeros, zeros + step)
        weights = _stochastic_round(weights, random_bits, element)
    tl.debug_barrier()
    OPTIMIZER_STORE_STATE(state_rows, state, columns, row_mask, mask, dims)
    tl.store(weight_rows[:, None] + columns[None, :], weights.to(element), mask=mask)


@triton.jit(do_not_specialize=["num_lookups", "batch_size"])
def _hot_window_sums_kernel(
    window_sums_ptr,  # fp32 [cdiv(N, CHUNK), BLOCK_D] out: gradient sum of each pure window
    run_count_ptr,  # int32 [N]: runs begun up to each sorted position
    order_ptr,  # int64 [N]: lookup at each sorted position (read for pooling none only)
    sorted_bags_ptr,  # int32 [N]: bag of the lookup at each sorted position
    sorted_weights_ptr,  # fp32 [N]: per-sample weight at each sorted position (if HAS_PER_SAMPLE_WEIGHTS)
    offsets_ptr,  # int32/int64 [T*B+1]: bag boundaries
    step_args_ptr,  # int64 [STEP_ARGS]: this step's arguments (step_arguments: grad_output's address)
    grad_output_stride,  # elements between consecutive rows of grad_output
    table_dim_ptr,  # int32 [T]: embedding_dim of each table
    table_output_offset_ptr,  # int32 [T]: first column of each table in a grad_output row
    num_lookups,  # N
    batch_size,  # B
    POOLING: tl.constexpr,  # pooling code
    HAS_PER_SAMPLE_WEIGHTS: tl.constexpr,  # whether lookups carry per-sample weights
    ALIGN: tl.constexpr,  # every dim and output column offset is a multiple of this many elements
    GRAD_ALIGN_BYTES: tl.constexpr,  # alignment of grad_output row slices
    CHUNK: tl.constexpr,  # sorted positions per window: runs holding a whole one are hot
    BLOCK_D: tl.constexpr,  # next power of two of the largest embedding_dim
):
    window = tl.program_id(0).to(tl.int64)
    first = window * CHUNK
    if first + CHUNK <= num_lookups:
        if tl.load(run_count_ptr + first) == tl.load(run_count_ptr + first + CHUNK - 1):  # a pure window
            columns = tl.arange(0, BLOCK_D)
            positions = first + tl.arange(0, CHUNK)
            grad_output_ptr = _grad_output_of_step(step_args_ptr)
            tile = _lookup_gradients(
                positions, positions >= 0, order_ptr, sorted_bags_ptr, offsets_ptr, sorted_weights_ptr,
                grad_output_ptr, grad_output_stride, table_dim_ptr, table_output_offset_ptr, batch_size, columns,
                POOLING, HAS_PER_SAMPLE_WEIGHTS, ALIGN, GRAD_ALIGN_BYTES)
            tl.store(window_sums_ptr + window * BLOCK_D + columns, tl.sum(tile, axis=0))


@triton.jit(do_not_specialize=["num_lookups"])
def _hot_group_sums_kernel(
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
def _hot_row_update_kernel(
    window_sums_ptr,  # fp32 [cdiv(N, CHUNK), BLOCK_D]: gradient sum of each pure window
    group_sums_ptr,  # fp32 [cdiv(cdiv(N, CHUNK), GROUP), BLOCK_D]: sum of each pure group of windows
    run_count_ptr,  # int32 [N]: runs begun up to each sorted position
    run_end_ptr,  # int32 [N]: one past the last position of each run
    order_ptr,  # int64 [N]: lookup at each sorted position (read for pooling none only)
    sorted_bags_ptr,  # int32 [N]: bag of the lookup at each sorted position
    sorted_weights_ptr,  # fp32 [N]: per-sample weight at each sorted position (if HAS_PER_SAMPLE_WEIGHTS)
    offsets_ptr,  # int32/int64 [T*B+1]: bag boundaries
    step_args_ptr,  # int64 [STEP_ARGS]: this step's arguments (step_arguments: grad_output, seed, step)
    grad_output_stride,  # elements between consecutive rows of grad_output
    table_dim_ptr,  # int32 [T]: embedding_dim of each table
    table_output_offset_ptr,  # int32 [T]: first column of each table in a grad_output row
    sorted_rows_ptr,  # int32/int64 [N]: global rows, ascending
    sorted_slots_ptr,  # int32 [N]: slot of the row at each sorted position, or -1 (read only if USE_CACHE)
    table_weights_address_ptr,  # int64 [T]: address of row 0 of each table's weights
    table_weights_stride_ptr,  # int64 [T]: elements between rows of each table's weights
    table_state_address_ptr,  # int64 [T]: address of row 0 of each table's state
    table_state_stride_ptr,  # int64 [T]: elements between rows of each table's state
    table_row_offset_ptr,  # int64 [T]: global row id of row 0 of each table
    cache_weights_ptr,  # [num_slots, row_width] slot rows
    cache_weights_stride,  # elements between consecutive slots
    cache_state_ptr,  # fp32 [num_slots, state_width] slot state
    cache_state_stride,  # elements between consecutive slots of cache_state
    hyper_ptr,  # fp32 [NUM_HYPER]: the optimizer's hyper-parameters
    num_lookups,  # N
    batch_size,  # B
    POOLING: tl.constexpr,  # pooling code
    HAS_PER_SAMPLE_WEIGHTS: tl.constexpr,  # whether lookups carry per-sample weights
    ALIGN: tl.constexpr,  # every dim and output column offset is a multiple of this many elements
    GRAD_ALIGN_BYTES: tl.constexpr,  # alignment of grad_output row slices
    CHUNK: tl.constexpr,  # sorted positions per window: runs holding a whole one are hot
    USE_CACHE: tl.constexpr,  # whether any lookup may have a slot
    OPTIMIZER_LOAD_STATE: tl.constexpr,  # the optimizer's Triton functions (kernels/optimizers/base.py)
    OPTIMIZER_UPDATE: tl.constexpr,
    OPTIMIZER_STORE_STATE: tl.constexpr,
    STOCHASTIC_ROUNDING: tl.constexpr,  # round fp16 / bf16 weights stochastically
    NUM_HYPER: tl.constexpr,  # hyper-parameters the optimizer reads
    ALIGN_BYTES: tl.constexpr,  # every weights row starts at a multiple of this many bytes
    STATE_ALIGN_BYTES: tl.constexpr,  # every state row starts at a multiple of this many bytes
    GROUP: tl.constexpr,  # windows per group
    BLOCK_P: tl.constexpr,  # window sums added per step
    BLOCK_L: tl.constexpr,  # lookups before the first / after the last pure window summed per step
    BLOCK_D: tl.constexpr,  # next power of two of the largest embedding_dim
):
    window = tl.program_id(0).to(tl.int64)
    first = window * CHUNK
    if first + CHUNK <= num_lookups:
        run_count = tl.load(run_count_ptr + first)
        if run_count == tl.load(run_count_ptr + first + CHUNK - 1):  # a pure window
            run = run_count - 1
            start = tl.load(run_end_ptr + run - 1, mask=run > 0, other=0).to(tl.int64)
            end = tl.load(run_end_ptr + run).to(tl.int64)
            first_window = (start + CHUNK - 1) // CHUNK
            if window == first_window:  # the run's first pure window owns the run
                last_window = end // CHUNK - 1
                table = tl.load(sorted_bags_ptr + start) // batch_size
                columns = tl.arange(0, BLOCK_D)
                one = tl.zeros([1], dtype=tl.int32)
                dims = one + tl.multiple_of(tl.load(table_dim_ptr + table), ALIGN)
                in_row = columns[None, :] < dims[:, None]

                # The run's pure groups of windows, its windows outside them, then its lookups before
                # the first and after the last pure window.
                first_group = (first_window + GROUP - 1) // GROUP
                last_group = (last_window + 1) // GROUP - 1
                if first_group <= last_group:
                    grad = _sum_rows(group_sums_ptr, first_group, last_group, in_row, BLOCK_P, BLOCK_D)
                    grad += _sum_rows(window_sums_ptr, first_window, first_group * GROUP - 1, in_row, BLOCK_P,
                                      BLOCK_D)
                    grad += _sum_rows(window_sums_ptr, (last_group + 1) * GROUP, last_window, in_row, BLOCK_P,
                                      BLOCK_D)
                else:
                    grad = _sum_rows(window_sums_ptr, first_window, last_window, in_row, BLOCK_P, BLOCK_D)
                lanes = tl.arange(0, BLOCK_L)
                grad_output_ptr = _grad_output_of_step(step_args_ptr)
                head_end = first_window * CHUNK
                tail_start = (last_window + 1) * CHUNK
                for offset in range(0, CHUNK, BLOCK_L):  # each part is shorter than CHUNK
                    head = start + offset + lanes
                    tail = tail_start + offset + lanes
                    grad += tl.sum(_lookup_gradients(
                        head, head < head_end, order_ptr, sorted_bags_ptr, offsets_ptr, sorted_weights_ptr,
                        grad_output_ptr, grad_output_stride, table_dim_ptr, table_output_offset_ptr, batch_size,
                        columns, POOLING, HAS_PER_SAMPLE_WEIGHTS, ALIGN, GRAD_ALIGN_BYTES), axis=0)
                    grad += tl.sum(_lookup_gradients(
                        tail, tail < end, order_ptr, sorted_bags_ptr, offsets_ptr, sorted_weights_ptr,
                        grad_output_ptr, grad_output_stride, table_dim_ptr, table_output_offset_ptr, batch_size,
                        columns, POOLING, HAS_PER_SAMPLE_WEIGHTS, ALIGN, GRAD_ALIGN_BYTES), axis=0)
                slots = one
                if USE_CACHE:
                    slots = one + tl.load(sorted_slots_ptr + start)
                global_rows = one.to(tl.int64) + tl.load(sorted_rows_ptr + start).to(tl.int64)
                _update_rows(global_rows, one + table, slots, grad[None, :], one == 0, dims, columns, in_row,
                             table_weights_address_ptr, table_weights_stride_ptr,
                     table_state_address_ptr, table_state_stride_ptr, table_row_offset_ptr, cache_weights_ptr,
                     cache_weights_stride, cache_state_ptr, cache_state_stride, step_args_ptr, hyper_ptr, NUM_HYPER,
                     OPTIMIZER_LOAD_STATE, OPTIMIZER_UPDATE, OPTIMIZER_STORE_STATE, USE_CACHE, STOCHASTIC_ROUNDING,
                     ALIGN_BYTES, STATE_ALIGN_BYTES)


@triton.jit(do_not_specialize=["num_lookups", "batch_size"])
def _row_update_kernel(
    run_end_ptr,  # int32 [N]: one past the last position of each run; N past the last run
    order_ptr,  # int64 [N]: lookup at each sorted position (read for pooling none only)
    sorted_bags_ptr,  # int32 [N]: bag of the lookup at each sorted position
    sorted_weights_ptr,  # fp32 [N]: per-sample weight at each sorted position (if HAS_PER_SAMPLE_WEIGHTS)
    offsets_ptr,  # int32/int64 [T*B+1]: bag boundaries
    step_args_ptr,  # int64 [STEP_ARGS]: this step's arguments (step_arguments: grad_output, seed, step)
    grad_output_stride,  # elements between consecutive rows of grad_output
    table_dim_ptr,  # int32 [T]: embedding_dim of each table
    table_output_offset_ptr,  # int32 [T]: first column of each table in a grad_output row
    sorted_rows_ptr,  # int32/int64 [N]: global rows, ascending
    sorted_slots_ptr,  # int32 [N]: slot of the row at each sorted position, or -1 (read only if USE_CACHE)
    table_weights_address_ptr,  # int64 [T]: address of row 0 of each table's weights
    table_weights_stride_ptr,  # int64 [T]: elements between rows of each table's weights
    table_state_address_ptr,  # int64 [T]: address of row 0 of each table's state
    table_state_stride_ptr,  # int64 [T]: elements between rows of each table's state
    table_row_offset_ptr,  # int64 [T]: global row id of row 0 of each table
    cache_weights_ptr,  # [num_slots, row_width] slot rows
    cache_weights_stride,  # elements between consecutive slots
    cache_state_ptr,  # fp32 [num_slots, state_width] slot state
    cache_state_stride,  # elements between consecutive slots of cache_state
    hyper_ptr,  # fp32 [NUM_HYPER]: the optimizer's hyper-parameters
    num_lookups,  # N
    batch_size,  # B
    POOLING: tl.constexpr,  # pooling code
    HAS_PER_SAMPLE_WEIGHTS: tl.constexpr,  # whether lookups carry per-sample weights
    ALIGN: tl.constexpr,  # every dim and output column offset is a multiple of this many elements
    GRAD_ALIGN_BYTES: tl.constexpr,  # alignment of grad_output row slices
    CHUNK: tl.constexpr,  # sorted positions per window: runs holding a whole one are hot
    USE_CACHE: tl.constexpr,  # whether any lookup may have a slot
    OPTIMIZER_LOAD_STATE: tl.constexpr,  # the optimizer's Triton functions (kernels/optimizers/base.py)
    OPTIMIZER_UPDATE: tl.constexpr,
    OPTIMIZER_STORE_STATE: tl.constexpr,
    STOCHASTIC_ROUNDING: tl.constexpr,  # round fp16 / bf16 weights stochastically
    NUM_HYPER: tl.constexpr,  # hyper-parameters the optimizer reads
    ALIGN_BYTES: tl.constexpr,  # every weights row starts at a multiple of this many bytes
    STATE_ALIGN_BYTES: tl.constexpr,  # every state row starts at a multiple of this many bytes
    ROWS: tl.constexpr,  # runs per program
    BLOCK_L: tl.constexpr,  # lookups of each run per step
    BLOCK_D: tl.constexpr,  # next power of two of the largest embedding_dim
):
    tile = tl.program_id(0)
    runs = tile * ROWS + tl.arange(0, ROWS)
    starts, ends, row_mask = _runs_of_tile(runs, run_end_ptr, num_lookups, CHUNK)
    # Programs past the batch's runs exit here (their runs read as empty): one load, no count read first.
    if tl.min(starts, axis=0) < num_lookups:
        columns = tl.arange(0, BLOCK_D)
        # Gradient tiles have ROWS * BLOCK_L rows, (run, lane) pairs: BLOCK_L lookups of each run per step.
        lanes = tl.arange(0, ROWS * BLOCK_L) % BLOCK_L
        if BLOCK_L == 1:
            lane_starts, lane_ends, lane_mask = starts, ends, row_mask
        else:
            lane_runs = tile * ROWS + tl.arange(0, ROWS * BLOCK_L) // BLOCK_L
            lane_starts, lane_ends, lane_mask = _runs_of_tile(lane_runs, run_end_ptr, num_lookups, CHUNK)

        grad_output_ptr = _grad_output_of_step(step_args_ptr)
        grad = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        for step_start in range(0, tl.max(tl.where(row_mask, ends - starts, 0), axis=0), BLOCK_L):
            positions = lane_starts + step_start + lanes
            valid = (positions < lane_ends) & lane_mask
            tile_grads = _lookup_gradients(
                positions, valid, order_ptr, sorted_bags_ptr, offsets_ptr, sorted_weights_ptr, grad_output_ptr,
                grad_output_stride, table_dim_ptr, table_output_offset_ptr, batch_size, columns, POOLING,
                HAS_PER_SAMPLE_WEIGHTS, ALIGN, GRAD_ALIGN_BYTES)
            grad += sum_lanes(tile_grads, ROWS, BLOCK_L, BLOCK_D)
        tables = tl.load(sorted_bags_ptr + starts, mask=row_mask, other=0) // batch_size
        dims = tl.multiple_of(tl.load(table_dim_ptr + tables, mask=row_mask, other=0), ALIGN)
        mask = row_mask[:, None] & (columns[None, :] < dims[:, None])
        global_rows = tl.load(sorted_rows_ptr + starts, mask=row_mask, other=0).to(tl.int64)
        slots = tl.zeros_like(tables)
        if USE_CACHE:
            slots = tl.load(sorted_slots_ptr + starts, mask=row_mask, other=-1)
        _update_rows(global_rows, tables, slots, grad, row_mask, dims, columns, mask,
                     table_weights_address_ptr, table_weights_stride_ptr,
                     table_state_address_ptr, table_state_stride_ptr, table_row_offset_ptr, cache_weights_ptr,
                     cache_weights_stride, cache_state_ptr, cache_state_stride, step_args_ptr, hyper_ptr, NUM_HYPER,
                     OPTIMIZER_LOAD_STATE, OPTIMIZER_UPDATE, OPTIMIZER_STORE_STATE, USE_CACHE, STOCHASTIC_ROUNDING,
                     ALIGN_BYTES, STATE_ALIGN_BYTES)


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


def check_grad_output(grad_output: torch.Tensor, stores: RowStores, lookups: Lookups, mode: int) -> torch.Tensor:
    """grad_output as the kernels read it: fp32, 2-D, contiguous rows (copied only if it is not)."""
    if mode == POOLING_NONE:
        expected = (lookups.num_lookups, stores.max_dim)
    else:
        expected = (lookups.batch_size, stores.total_dim)
    if tuple(grad_output.shape) != expected:
        raise ValueError(f"grad_output must have shape {expected}, got {tuple(grad_output.shape)}")
    if grad_output.dtype != torch.float32:
        raise TypeError(f"grad_output must be fp32, got {grad_output.dtype}")
    if grad_output.numel() > 0 and grad_output.stride(1) != 1:
        grad_output = grad_output.contiguous()
    return grad_output


def grad_alignment_bytes(grad_output: torch.Tensor, stores: RowStores) -> int:
    """Bytes that every grad_output row slice of a table starts at a multiple of (at most 16)."""
    elements = grad_output.data_ptr() // 4 if grad_output.data_ptr() % 4 == 0 else 1
    return 4 * math.gcd(elements, grad_output.stride(0) if grad_output.dim() == 2 else 1, *stores.dims, 4)


# What changes from step to step reaches the kernels through one device tensor, not launch
# arguments, so one CUDA graph of the backward serves every step of a batch shape
# (base/graphs.py). int64 [STEP_ARGS]: grad_output's address, the philox key and the step,
# then the optimizer's hyper-parameters as fp32, two to an int64 (``hyper_view``).
STEP_INTS = 3
MAX_HYPER = 8
STEP_ARGS = STEP_INTS + MAX_HYPER // 2


def step_arguments(grad_output: torch.Tensor, hyper: tuple[float, ...], seed: int, step: int) -> torch.Tensor:
    """int64 [STEP_ARGS] on the host: what the kernels read of this step (layout above)."""
    if not 1 <= len(hyper) <= MAX_HYPER:
        raise ValueError(f"an optimizer passes 1 to {MAX_HYPER} hyper-parameters to the kernels, got {len(hyper)}")
    packed = struct.pack(f"<{STEP_INTS}q{MAX_HYPER}f", grad_output.data_ptr(), int(seed) & 0x7FFFFFFF,
                         int(step) & 0x7FFFFFFF, *hyper, *(0.0,) * (MAX_HYPER - len(hyper)))
    return torch.frombuffer(bytearray(packed), dtype=torch.int64)


def hyper_view(step_args: torch.Tensor, num_hyper: int) -> torch.Tensor:
    """fp32 [num_hyper]: the hyper-parameters inside ``step_args`` (a view)."""
    return step_args.view(torch.float32)[2 * STEP_INTS:2 * STEP_INTS + num_hyper]


class _UpdatePlan(NamedTuple):
    """Everything a backward's launches bake in besides its tensors (hashable: part of a graph's key)."""

    mode: int
    batch_size: int
    grad_output_stride: int
    grad_align_bytes: int
    block_d: int
    config: BackwardConfig
    use_cache: bool
    optimizer_triton: tuple
    num_hyper: int
    stochastic_rounding: bool


def backward_update(
    grad_output: torch.Tensor,
    stores: RowStores,
    lookups: Lookups,
    slot_of_index: torch.Tensor | None,
    pooling: str,
    optimizer: FusedOptimizer,
    step: int = 1,
    stochastic_rounding: bool = False,
    seed: int = 0,
    sorted_lookups: SortedLookups | None = None,
    config: BackwardConfig | None = None,
    graphs=None,
) -> None:
    """Sum the gradient of each unique row of the batch and apply the optimizer to it, in place.

    Args:
        grad_output: fp32 ``[B, total_dim]`` (sum, mean) or ``[N, max_dim]`` (none): gradient of the
            output of ``pooled_forward``.
        stores: rows and optimizer state (updated in place: the slot when a lookup's slot is >= 0,
            else the table's backing store; layouts in ``kernels/rows.py``).
        lookups: the batch that produced the output.
        slot_of_index: int32 [N]: slot of each lookup's row, or -1 (all lookups of a row agree);
            ``None``: no lookup has a slot.
        pooling: ``"sum"``, ``"mean"`` or ``"none"``, as in the forward.
        optimizer: a :class:`~tiered_tbe.kernels.optimizers.FusedOptimizer` (its math in its module).
        step: the 1-based optimizer step (Adam-type bias corrections; part of stochastic rounding's draw).
        stochastic_rounding: round fp16 / bf16 weights stochastically instead of to nearest.
        seed: stochastic rounding's random key (the draws also depend on ``step``, row and column).
        sorted_lookups: ``sort_lookups(stores, lookups)`` when the caller made it already.
        config: tile shapes (default :func:`default_config`).
        graphs: a :class:`~tiered_tbe.base.graphs.StepGraphs` of this ``stores``: the launches
            run as a CUDA graph of the batch's shape (bit-identical to running them one by one).
    """
    if not isinstance(optimizer, FusedOptimizer):
        raise TypeError(f"optimizer must be a FusedOptimizer (tiered_tbe.optimizers), got {type(optimizer).__name__}")
    if step < 1:
        raise ValueError(f"step is 1-based, got {step}")
    mode = pooling_code(pooling)
    check_lookups(stores, lookups, slot_of_index)
    grad_output = check_grad_output(grad_output, stores, lookups, mode)
    if lookups.num_lookups == 0 or lookups.batch_size == 0:
        return
    block_d = triton.next_power_of_2(stores.max_dim)
    config = config or default_config(block_d)
    if not 2 <= config.chunk <= 1024 or config.chunk & (config.chunk - 1):
        raise ValueError(f"config.chunk must be a power of two in [2, 1024], got {config.chunk}")
    hyper = tuple(float(value) for value in optimizer.kernel_hyper(step))
    plan = _UpdatePlan(
        mode=mode, batch_size=lookups.batch_size, grad_output_stride=grad_output.stride(0),
        grad_align_bytes=grad_alignment_bytes(grad_output, stores), block_d=block_d, config=config,
        use_cache=slot_of_index is not None and stores.uses_cache, optimizer_triton=optimizer.TRITON,
        num_hyper=len(hyper),
        stochastic_rounding=bool(stochastic_rounding) and stores.weights_dtype != torch.float32)
    inputs = (lookups.indices, lookups.offsets, lookups.per_sample_weights, lookups.global_rows,
              lookups.bag_of_index, slot_of_index if plan.use_cache else None,
              step_arguments(grad_output, hyper, seed, step))

    def enqueue(tensors):
        _enqueue_update(plan, stores, *tensors, sorted_lookups=sorted_lookups)

    if graphs is None or sorted_lookups is not None:
        enqueue(to_device(inputs, grad_output.device))
    else:
        graphs.run((plan, id(stores)), inputs, enqueue, grad_output.device)


def _enqueue_update(plan: _UpdatePlan, stores: RowStores, indices, offsets, per_sample_weights, global_rows,
                    bag_of_index, slot_of_index, step_args, sorted_lookups: SortedLookups | None = None) -> None:
    """Enqueue the backward's launches. Reads the batch only through its arguments (``step_args``:
    grad_output's address, the step, the hyper-parameters), so a CUDA graph of it serves every
    batch of its shape."""
    lookups = Lookups(indices, offsets, plan.batch_size, per_sample_weights, global_rows, bag_of_index)
    num_lookups = lookups.num_lookups
    device = indices.device
    config, block_d = plan.config, plan.block_d
    chunk = config.chunk
    s = sorted_lookups or sort_lookups(stores, lookups)
    has_per_sample_weights = per_sample_weights is not None
    hyper = hyper_view(step_args, plan.num_hyper)
    load_state, update, store_state = plan.optimizer_triton
    common = dict(POOLING=plan.mode, HAS_PER_SAMPLE_WEIGHTS=has_per_sample_weights, ALIGN=stores.alignment,
                  GRAD_ALIGN_BYTES=plan.grad_align_bytes, CHUNK=chunk, BLOCK_D=block_d)
    updating = dict(USE_CACHE=plan.use_cache, OPTIMIZER_LOAD_STATE=load_state, OPTIMIZER_UPDATE=update,
                    OPTIMIZER_STORE_STATE=store_state, STOCHASTIC_ROUNDING=plan.stochastic_rounding,
                    NUM_HYPER=plan.num_hyper, ALIGN_BYTES=stores.alignment * stores.weights_dtype.itemsize,
                    STATE_ALIGN_BYTES=4 * stores.state_alignment)
    order = s.order
    # Per-sample weights and slots by sorted position, gathered once (no dependent load in the kernels).
    sorted_weights = per_sample_weights[order] if has_per_sample_weights else hyper
    sorted_slots = slot_of_index[order] if plan.use_cache else s.run_end
    gradient_args = (order, s.sorted_bags, sorted_weights, offsets, step_args, plan.grad_output_stride,
                     stores.table_dim, stores.table_output_offset)
    update_args = (s.sorted_rows, sorted_slots, stores.table_weights_address, stores.table_weights_stride,
                   stores.table_state_address, stores.table_state_stride, stores.table_row_offset,
                   stores.cache_weights, stores.cache_weights.stride(0), stores.cache_state,
                   stores.cache_state.stride(0), hyper)

    num_windows = triton.cdiv(num_lookups, chunk)
    window_sums = torch.empty(num_windows, block_d, dtype=torch.float32, device=device)
    _hot_window_sums_kernel[(num_windows,)](
        window_sums, s.run_count, *gradient_args, num_lookups, plan.batch_size, **common, num_warps=4)
    group = HOT_GROUP
    num_groups = triton.cdiv(num_windows, group)
    group_sums = torch.empty(num_groups, block_d, dtype=torch.float32, device=device)
    _hot_group_sums_kernel[(num_groups,)](group_sums, window_sums, s.run_count, num_lookups, CHUNK=chunk, GROUP=group,
                                          BLOCK_D=block_d, num_warps=4)
    _hot_row_update_kernel[(num_windows,)](
        window_sums, group_sums, s.run_count, s.run_end, *gradient_args, *update_args, num_lookups,
        plan.batch_size, **common, **updating, GROUP=group, BLOCK_P=8 if INTERPRETING else 32, BLOCK_L=HOT_LANES,
        num_warps=4)
    _row_update_kernel[(triton.cdiv(num_lookups, config.rows),)](
        s.run_end, *gradient_args, *update_args, num_lookups, plan.batch_size,
        **common, **updating, ROWS=config.rows, BLOCK_L=config.lanes, num_warps=config.num_warps)
