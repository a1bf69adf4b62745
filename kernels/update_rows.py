"""What the backward's update kernels share: a lookup's gradient row, a tile of rows updated by
the optimizer in its slot or backing store, and the step's arguments they read.

What changes from step to step reaches the kernels through one device tensor, not launch
arguments, so one CUDA graph of the backward serves every step of a batch shape
(``base/graphs.py``): int64 ``[STEP_ARGS]``, grad_output's address, the philox key and the step,
then the optimizer's hyper-parameters as fp32, two to an int64 (``hyper_view``).
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from .addressing import (
    DIM,
    OUTPUT_OFFSET,
    POOLING_MEAN_CONSTEXPR,
    POOLING_NONE_CONSTEXPR,
    ROW_OFFSET,
    STATE_ADDRESS,
    STATE_STRIDE,
    WEIGHTS_ADDRESS,
    WEIGHTS_STRIDE,
    descriptor_field,
    descriptor_field_int32,
    recomputed_features,
    row_pointers,
    table_row_zero,
)
from .in_place_copies import read_pointers

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


def advance_step_arguments(values: bytes) -> bytes:
    """``step_arguments``' bytes one step on (the step field + 1, wrapped as there): what
    ``advance_step_kernel`` leaves in a graph's copy of them, so the next step's need no copy."""
    step = (struct.unpack_from("<q", values, 16)[0] + 1) & 0x7FFFFFFF
    return values[:16] + struct.pack("<q", step) + values[24:]


@triton.jit
def advance_step_kernel(
    step_args_ptr,  # int64 [STEP_ARGS]: this step's arguments, its step field advanced in place
):
    """The step field + 1 (wrapped to 31 bits as ``step_arguments`` wraps it), after the step's
    update kernels: a graph's replays then hold the next step's arguments already."""
    tl.store(step_args_ptr + 2, (tl.load(step_args_ptr + 2) + 1) & 0x7FFFFFFF)


def hyper_view(step_args: torch.Tensor, num_hyper: int) -> torch.Tensor:
    """fp32 [num_hyper]: the hyper-parameters inside ``step_args`` (a view)."""
    return step_args.view(torch.float32)[2 * STEP_INTS:2 * STEP_INTS + num_hyper]


@triton.jit
def grad_output_of_step(
    step_args_ptr,  # int64 [STEP_ARGS]: this step's arguments (see step_arguments)
):
    """The fp32 pointer to this step's grad_output, read from the step's arguments."""
    return tl.load(step_args_ptr).to(tl.pointer_type(tl.float32))


@triton.jit
def optimizer_step_of(
    step_args_ptr,  # int64 [STEP_ARGS]: this step's arguments (see step_arguments)
):
    """The int32 1-based optimizer step in the step's arguments (0 unless the optimizer or
    stochastic rounding reads it; advanced in place by ``advance_step_kernel``)."""
    return tl.load(step_args_ptr + 2).to(tl.int32)


@triton.jit
def load_hyper(
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
def run_columns(
    first_positions,  # int64, scalar or [ROWS]: the first sorted position of each run
    valid,  # bool, same shape: which runs exist
    sorted_bags_ptr,  # int32 [N]: bag f*B+b of the lookup at each sorted position
    descriptor_ptr,  # int64 [F, DESCRIPTOR_COLUMNS]: each feature's dim and first output column (and more)
    batch_size,  # B
    ALIGN: tl.constexpr,  # every dim and output column offset is a multiple of this many elements
):
    """``(features, dims, first_columns)``, int32 of ``first_positions``' shape: the feature of each
    run's first lookup, its table's embedding_dim and its first column in a grad_output row (0
    where not valid; every lookup of a run has the run's table, so its dim). The hints
    are given here, where the values are loaded (Triton 3.6 drops them given by a caller)."""
    features = tl.load(sorted_bags_ptr + first_positions, mask=valid, other=0) // batch_size
    dims = descriptor_field_int32(descriptor_ptr, features, valid, DIM, ALIGN)
    first_columns = descriptor_field_int32(descriptor_ptr, features, valid, OUTPUT_OFFSET, ALIGN)
    return features, dims, first_columns


@triton.jit
def lookup_keys(
    positions,  # int64 tensor: sorted positions
    valid,  # bool, same shape: which positions count
    order_ptr,  # int32 [N]: lookup at each sorted position (read for pooling none only)
    sorted_bags_ptr,  # int32 [N]: bag f*B+b of the lookup at each sorted position
    POOLING: tl.constexpr,  # pooling code (kernels/addressing.py)
):
    """int32, the shape of ``positions``: what locates each position's gradient row, its bag
    (pooled) or its lookup (pooling none); 0 where not valid. A load of its own so that a caller
    walking a run can issue the next position's key before it waits for this one's gradient
    (``_sum_runs_one_lane``)."""
    if POOLING == POOLING_NONE_CONSTEXPR:
        return tl.load(order_ptr + positions, mask=valid, other=0)
    return tl.load(sorted_bags_ptr + positions, mask=valid, other=0)


@triton.jit
def lookup_gradients(
    positions,  # int64 [P] or [ROWS, LANES]: sorted positions, each run's positions in one row of the tile
    valid,  # bool, same shape: which positions count
    features,  # int32, broadcastable to positions: the feature of each run's first lookup (scalar, [P], [ROWS, 1])
    first_columns,  # int32, as features: that feature's first column in a grad_output row
    in_row,  # bool, broadcastable to [*positions.shape, BLOCK_D]: the columns of the run's table
    order_ptr,  # int32 [N]: lookup at each sorted position (read for pooling none only)
    sorted_bags_ptr,  # int32 [N]: bag f*B+b of the lookup at each sorted position
    offsets_ptr,  # int32/int64 [F*B+1]: bag boundaries (mean pooling's bag lengths)
    sorted_weights_ptr,  # fp32 [N]: per-sample weight at each sorted position (if HAS_PER_SAMPLE_WEIGHTS)
    grad_output_ptr,  # fp32 [B, total_dim] or [N, max_dim] (pooling none)
    grad_output_stride,  # elements between consecutive rows of grad_output
    batch_size,  # B
    descriptor_ptr,  # int64 [F, DESCRIPTOR_COLUMNS]: each feature's first output column (read if SHARED_TABLES)
    columns,  # int32 [BLOCK_D]
    POOLING: tl.constexpr,  # pooling code (kernels/addressing.py)
    HAS_PER_SAMPLE_WEIGHTS: tl.constexpr,  # whether lookups carry per-sample weights
    GRAD_ALIGN_BYTES: tl.constexpr,  # every grad_output row slice starts at a multiple of this
    SHARED_TABLES: tl.constexpr,  # a table is looked up by several features: a run's lookups may differ in theirs
    ALIGN: tl.constexpr,  # every output column offset is a multiple of this many elements
):
    """fp32 [*positions.shape, BLOCK_D]: d loss / d row of the lookup at each sorted position
    (zeros where not valid or outside ``in_row``).

    The lookups of a run share its row, so its table: the caller reads the feature, its dim and its
    first column once per run (``run_columns``), and a lookup costs one dependent load (its bag)
    before its gradient row, not three (bag, then the dim and first column). Only when features
    share a table (``SHARED_TABLES``) may a run's lookups come from different features, whose
    output columns differ: each lookup then reads its own feature's column (one load more, from
    the descriptor's few cache lines).

    A 2-D tile of positions (a row of lanes per run) lets a run's lanes be summed in registers
    (``tl.sum(axis=1)``), as the forward's tiles (kernels/addressing.py ``lookup_rows``)."""
    keys = lookup_keys(positions, valid, order_ptr, sorted_bags_ptr, POOLING)
    return gradients_of_keys(keys, positions, valid, features, first_columns, in_row, offsets_ptr, sorted_weights_ptr,
                             grad_output_ptr, grad_output_stride, batch_size, descriptor_ptr, columns, POOLING,
                             HAS_PER_SAMPLE_WEIGHTS, GRAD_ALIGN_BYTES, SHARED_TABLES, ALIGN)


@triton.jit
def gradients_of_keys(
    keys,  # int32, the shape of positions: lookup_keys of the positions
    positions,  # int64 [P] or [ROWS, LANES]: sorted positions
    valid,  # bool, same shape: which positions count
    features, first_columns, in_row,  # as lookup_gradients'
    offsets_ptr, sorted_weights_ptr, grad_output_ptr, grad_output_stride, batch_size, descriptor_ptr,
    columns,  # as lookup_gradients'
    POOLING: tl.constexpr, HAS_PER_SAMPLE_WEIGHTS: tl.constexpr, GRAD_ALIGN_BYTES: tl.constexpr,
    SHARED_TABLES: tl.constexpr, ALIGN: tl.constexpr,  # as lookup_gradients'
):
    """``lookup_gradients`` of positions whose keys (``lookup_keys``) are loaded already.

    The pointers' alignment hint is given here, where they are made: applied in the callers, Triton
    3.6 dropped it and the backward's 16-byte loads halved (0.47 -> 0.56 ms of update kernels at
    Zipf 1.05 on the H200, results/measurements.jsonl 2026-12-02)."""
    if POOLING == POOLING_NONE_CONSTEXPR:
        pointers = grad_output_ptr + keys.to(tl.int64) * grad_output_stride  # int32 lookups: 64-bit addresses
    else:
        if SHARED_TABLES:  # each lookup's own feature and its output column
            features = keys // batch_size
            first_columns = descriptor_field_int32(descriptor_ptr, features, valid, OUTPUT_OFFSET, ALIGN)
        samples = keys - features * batch_size
        pointers = grad_output_ptr + samples.to(tl.int64) * grad_output_stride + first_columns
    if len(positions.shape) == 2:  # tl.multiple_of takes one value per dimension
        pointers = tl.multiple_of(pointers, [GRAD_ALIGN_BYTES, GRAD_ALIGN_BYTES])
    else:
        pointers = tl.multiple_of(pointers, GRAD_ALIGN_BYTES)
    tile = tl.load(tl.expand_dims(pointers, -1) + columns, mask=tl.expand_dims(valid, -1) & in_row, other=0.0)
    if HAS_PER_SAMPLE_WEIGHTS:
        tile = tile * tl.expand_dims(tl.load(sorted_weights_ptr + positions, mask=valid, other=0.0), -1)
    if POOLING == POOLING_MEAN_CONSTEXPR:
        lengths = (tl.load(offsets_ptr + keys + 1, mask=valid, other=1)
                   - tl.load(offsets_ptr + keys, mask=valid, other=0))
        tile = tile / tl.expand_dims(tl.maximum(lengths, 1).to(tl.float32), -1)
    return tile


@triton.jit
def random_words(
    global_rows,  # int64 [R]: the rows being updated
    step_args_ptr,  # int64 [STEP_ARGS]: this step's arguments (step_arguments: the philox key and step)
    BLOCK_D: tl.constexpr,  # columns of a row tile
):
    """uint32 [R, BLOCK_D]: uniform random words, a distinct draw per (row, column, step, seed).

    Philox makes four words a call: each call serves four adjacent columns (its counter: column
    quad, row low word, row high word, step), as FBGEMM's stochastic rounding draws four values a
    call. A call per element made fp16 stochastic rounding cost more than the whole row update
    without it (the row-update kernel 0.52 against 0.31 ms at big Zipf, H200, results/measurements.jsonl 2026-12-03)."""
    seed = tl.load(step_args_ptr + 1).to(tl.int32)
    step = optimizer_step_of(step_args_ptr)
    low = (global_rows & 0xFFFFFFFF).to(tl.int32)[:, None]
    high = (global_rows >> 32).to(tl.int32)[:, None]
    if BLOCK_D >= 4:
        quads = tl.arange(0, BLOCK_D // 4)[None, :]
        zeros = tl.zeros([global_rows.shape[0], BLOCK_D // 4], dtype=tl.int32)
        first, second, third, fourth = tl.philox(seed, quads + zeros, low + zeros, high + zeros, zeros + step)
        # Column 4q + k takes word k of quad q: [R, Q, 2, 2] indexed [q, k // 2, k % 2], then flattened.
        words = tl.join(tl.join(first, third), tl.join(second, fourth))
        return tl.reshape(words, [global_rows.shape[0], BLOCK_D])
    else:
        zeros = tl.zeros([global_rows.shape[0], BLOCK_D], dtype=tl.int32)
        first, _, _, _ = tl.philox(seed, tl.arange(0, BLOCK_D)[None, :] + zeros, low + zeros, high + zeros,
                                   zeros + step)
        return first


@triton.jit
def stochastic_round(
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
def update_rows(
    global_rows,  # int64 [R]: the rows to update
    features,  # int32 [R]: a feature of each row's table (its descriptor row)
    slots,  # int32 [R]: the slot of each row, or -1 (ignored unless USE_CACHE)
    grad,  # fp32 [R, BLOCK_D]: each row's summed gradient (zeros outside mask)
    row_mask,  # bool [R]: which rows to update
    dims,  # int32 [R]: embedding_dim of each row's table
    columns,  # int32 [BLOCK_D]
    mask,  # bool [R, BLOCK_D]: row_mask and the table's columns
    descriptor_ptr,  # int64 [F, DESCRIPTOR_COLUMNS]: each feature's table: row 0 addresses, strides, row offset
    cache_weights_ptr,  # [num_slots, row_width] slot rows; its element type is every row's
    cache_weights_stride,  # elements between consecutive slots of cache_weights
    cache_state_ptr,  # fp32 [num_slots, state_width]: optimizer state of cached rows
    cache_state_stride,  # elements between consecutive slots of cache_state
    copy_ranks,  # int32 [R]: the copy row holding each row as the forward read it, or -1 (if READS_COPIES)
    copies_ptr,  # [num_copies, row_width]: the copy rows (kernels/in_place_copies.py; read if READS_COPIES)
    copies_stride,  # elements between consecutive copy rows
    num_copies,  # copy rows
    step_args_ptr,  # int64 [STEP_ARGS]: this step's arguments (step_arguments: the optimizer step, the philox key)
    hyper_ptr,  # fp32 [NUM_HYPER]: the optimizer's hyper-parameters (FusedOptimizer.kernel_hyper)
    NUM_HYPER: tl.constexpr,  # how many
    OPTIMIZER_LOAD_STATE: tl.constexpr,  # the optimizer's Triton functions (kernels/optimizers/base.py)
    OPTIMIZER_UPDATE: tl.constexpr,
    OPTIMIZER_STORE_STATE: tl.constexpr,
    USE_CACHE: tl.constexpr,  # whether any lookup may have a slot
    READS_COPIES: tl.constexpr,  # read a row that has a copy row from it (then write it to its store as ever)
    STOCHASTIC_ROUNDING: tl.constexpr,  # round fp16 / bf16 weights stochastically (else to nearest)
    ALIGN_BYTES: tl.constexpr,  # every weights row starts at a multiple of this many bytes
    STATE_ALIGN_BYTES: tl.constexpr,  # every state row starts at a multiple of this many bytes
):
    """Apply the optimizer to ``R`` rows in their slot or backing store, and store them (reading a
    row read in place from its copy, with ``READS_COPIES``: one crossing of the bus less)."""
    element = cache_weights_ptr.dtype.element_ty
    features = recomputed_features(features)  # not the address of the rows read before the gradient loop
    table_rows = global_rows - descriptor_field(descriptor_ptr, features, row_mask, ROW_OFFSET)
    weight_rows = row_pointers(table_row_zero(descriptor_ptr, features, None, WEIGHTS_ADDRESS, element), table_rows,
                               descriptor_field(descriptor_ptr, features, row_mask, WEIGHTS_STRIDE), slots,
                               cache_weights_ptr, cache_weights_stride, USE_CACHE, ALIGN_BYTES)
    state_rows = row_pointers(table_row_zero(descriptor_ptr, features, None, STATE_ADDRESS, tl.float32), table_rows,
                              descriptor_field(descriptor_ptr, features, row_mask, STATE_STRIDE), slots,
                              cache_state_ptr, cache_state_stride, USE_CACHE, STATE_ALIGN_BYTES)

    # Every load of the rows and their state comes before the barrier below, every store after it.
    # Threads of a program may hold copies of the same values (a row-wise accumulator in every
    # thread of its row): a thread that stored before another one loaded would make that one
    # apply the update twice.
    read_rows = weight_rows
    if READS_COPIES:
        read_rows = read_pointers(weight_rows, copy_ranks, copies_ptr, copies_stride, num_copies, ALIGN_BYTES)
    weights = tl.load(read_rows[:, None] + columns[None, :], mask=mask, other=0.0).to(tl.float32)
    state = OPTIMIZER_LOAD_STATE(state_rows, columns, row_mask, mask, dims)
    weights, state = OPTIMIZER_UPDATE(weights, grad, state, mask, dims, load_hyper(hyper_ptr, NUM_HYPER),
                                      optimizer_step_of(step_args_ptr))
    if STOCHASTIC_ROUNDING:
        weights = stochastic_round(weights, random_words(global_rows, step_args_ptr, columns.shape[0]), element)
    tl.debug_barrier()
    OPTIMIZER_STORE_STATE(state_rows, state, columns, row_mask, mask, dims)
    tl.store(weight_rows[:, None] + columns[None, :], weights.to(element), mask=mask)
