"""Backward of the pooled embedding bags with the optimizer fused in: each unique row updated once.

The gradient of a row is the sum, over every lookup of that row in the batch (in one bag or
across bags, in any table order), of the output gradient of the lookup's bag (the table's
columns) times the lookup's per-sample weight, divided by the bag length for mean pooling.
The optimizer (``tiered_tbe/optimizers.py``) then updates the row and its state once, in its
slot when ``slot_of_index >= 0``, else in its backing store.

How, without atomics and without a host synchronization:

1. ``torch.sort(global_rows, stable=True)`` groups the lookups of a row into one run of sorted
   positions (a *segment*); ``segment_start`` (``searchsorted`` of each row in the sorted rows)
   gives every sorted position the first position of its segment.
2. Long segments (hot rows) would serialize in one program, so they are cut into chunks of
   ``chunk_size`` consecutive positions counted from the segment start. ``_chunk_gradient_kernel``
   runs one program per window of ``chunk_size`` sorted positions; a full chunk ends in at most one
   position of a window, and that program writes the chunk's gradient sum to ``partial_gradients``
   at the window's index. A segment's full chunks thus sit in consecutive windows.
3. ``_row_update_kernel`` runs one program per sorted position; only the last position of each
   segment works: it sums the lookups after the segment's last full chunk, adds the chunks' partial
   sums, and applies the optimizer. Each row is owned by one program, so no two programs write the
   same weights, and the summation order depends only on the inputs: two identical steps give
   bit-identical results.

Measured on an H200 (20M x 128 fp32 rows, 2M lookups, uniform and Zipf 1.05): about 2.5 ms per
backward, sort included. Two variants with one program per window of R sorted positions were
slower: summing segments with a small matrix product (R = 16) 1.4-2.8x; with a segmented
scan over [R, dim] tiles, R = 8: 6% faster for SGD on uniform lookups, 1.1x slower for SGD on
Zipf and 1.8-1.9x slower for row-wise Adagrad (benchmarks/RESULTS.md, session 2).

Per-sample-weight gradients (``per_sample_weights_grad``) need the rows before the update: the
caller computes them first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tiered_tbe.base.sorting import INT64_MAX, sort_ids

from .forward import (
    _POOLING_MEAN,
    _POOLING_NONE,
    INTERPRETING,
    POOLING_NONE,
    _row_pointers,
    _weights_of_tier,
    check_lookups,
    launch_stores,
    pooling_code,
    tile_rows_for,
)
from .rows import Lookups, RowStores

# tiered_tbe.optimizers.OptimizerKind codes, as constexprs the kernels may read.
OPTIMIZER_NONE, OPTIMIZER_SGD, OPTIMIZER_ROWWISE_ADAGRAD, OPTIMIZER_ADAM = 0, 1, 2, 3
_OPTIMIZER_SGD = tl.constexpr(OPTIMIZER_SGD)
_OPTIMIZER_ROWWISE_ADAGRAD = tl.constexpr(OPTIMIZER_ROWWISE_ADAGRAD)
_OPTIMIZER_ADAM = tl.constexpr(OPTIMIZER_ADAM)

DEFAULT_CHUNK_SIZE = 256


@triton.jit
def _gradient_tile(
    sorted_positions,  # int64 [BLOCK_L]: positions in the sorted order of lookups
    in_tile,  # bool [BLOCK_L]: which positions are real lookups of the segment
    sort_order_ptr,  # int64 [N]: lookup at each sorted position
    bag_of_index_ptr,  # int64 [N]: bag t*B+b of each lookup
    offsets_ptr,  # int64 [T*B+1]: bag boundaries (for mean pooling's bag lengths)
    per_sample_weights_ptr,  # fp32 [N] (read only if HAS_PER_SAMPLE_WEIGHTS)
    grad_output_ptr,  # fp32 [B, total_dim] or [N, max_dim] (pooling none)
    grad_output_stride,  # elements between consecutive rows of grad_output
    output_column,  # first column of the table in a grad_output row (0 for pooling none)
    columns,  # int32 [BLOCK_D]: 0 .. BLOCK_D-1
    in_row,  # bool [BLOCK_D]: columns < dim
    batch_size,  # B
    POOLING: tl.constexpr,  # pooling code (see forward.py)
    HAS_PER_SAMPLE_WEIGHTS: tl.constexpr,  # whether lookups carry per-sample weights
):
    """fp32 [BLOCK_L, BLOCK_D]: d loss / d row of each lookup of the tile (zeros outside it)."""
    lookups = tl.load(sort_order_ptr + sorted_positions, mask=in_tile, other=0)
    if POOLING == _POOLING_NONE:
        grad_rows = lookups
    else:
        bags = tl.load(bag_of_index_ptr + lookups, mask=in_tile, other=0)
        grad_rows = bags % batch_size
    row_ptrs = grad_output_ptr + grad_rows * grad_output_stride + output_column
    tile = tl.load(row_ptrs[:, None] + columns[None, :], mask=in_tile[:, None] & in_row[None, :], other=0.0)
    if HAS_PER_SAMPLE_WEIGHTS:
        tile = tile * tl.load(per_sample_weights_ptr + lookups, mask=in_tile, other=0.0)[:, None]
    if POOLING == _POOLING_MEAN:
        lengths = (tl.load(offsets_ptr + bags + 1, mask=in_tile, other=1)
                   - tl.load(offsets_ptr + bags, mask=in_tile, other=0))
        tile = tile / tl.maximum(lengths, 1).to(tl.float32)[:, None]
    return tile


@triton.jit
def _chunk_gradient_kernel(
    partial_gradients_ptr,  # fp32 [cdiv(N, CHUNK), BLOCK_D]: out, gradient sum of each full chunk
    sort_order_ptr,  # int64 [N]: lookup at each sorted position
    segment_start_ptr,  # int64 [N]: first sorted position of the segment holding each position
    num_lookups,  # N
    bag_of_index_ptr,  # int64 [N]: bag t*B+b of each lookup
    offsets_ptr,  # int64 [T*B+1]: bag boundaries
    per_sample_weights_ptr,  # fp32 [N] (read only if HAS_PER_SAMPLE_WEIGHTS)
    grad_output_ptr,  # fp32 [B, total_dim] or [N, max_dim] (pooling none)
    grad_output_stride,  # elements between consecutive rows of grad_output
    table_dim_ptr,  # int32 [T]: embedding_dim of each table
    table_output_offset_ptr,  # int32 [T]: first column of each table in a grad_output row
    batch_size,  # B
    POOLING: tl.constexpr,  # pooling code (see forward.py)
    HAS_PER_SAMPLE_WEIGHTS: tl.constexpr,  # whether lookups carry per-sample weights
    CHUNK: tl.constexpr,  # lookups per chunk (a power of two); also the window of positions per program
    BLOCK_L: tl.constexpr,  # lookups loaded per tile
    BLOCK_D: tl.constexpr,  # columns per tile: next power of two of the largest embedding_dim
):
    window = tl.program_id(0).to(tl.int64)
    window_positions = window * CHUNK + tl.arange(0, CHUNK)
    in_range = window_positions < num_lookups
    starts = tl.load(segment_start_ptr + window_positions, mask=in_range, other=0)
    # A full chunk ends where the count of positions since the segment start reaches a multiple of
    # CHUNK. Two such ends are at least CHUNK apart, so a window holds at most one.
    is_chunk_end = in_range & ((window_positions - starts + 1) % CHUNK == 0)
    chunk_end = tl.max(tl.where(is_chunk_end, window_positions, -1), axis=0)
    if chunk_end >= 0:
        table = tl.load(bag_of_index_ptr + tl.load(sort_order_ptr + chunk_end)) // batch_size
        dim = tl.load(table_dim_ptr + table)
        output_column = 0
        if POOLING != _POOLING_NONE:
            output_column = tl.load(table_output_offset_ptr + table)
        columns = tl.arange(0, BLOCK_D)
        in_row = columns < dim
        accumulator = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
        for tile_offset in range(0, CHUNK, BLOCK_L):
            sorted_positions = chunk_end - CHUNK + 1 + tile_offset + tl.arange(0, BLOCK_L)
            in_tile = sorted_positions <= chunk_end
            accumulator += _gradient_tile(
                sorted_positions, in_tile, sort_order_ptr, bag_of_index_ptr, offsets_ptr, per_sample_weights_ptr,
                grad_output_ptr, grad_output_stride, output_column, columns, in_row, batch_size,
                POOLING, HAS_PER_SAMPLE_WEIGHTS)
        tl.store(partial_gradients_ptr + window * BLOCK_D + columns, tl.sum(accumulator, axis=0))


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
def _row_update_kernel(
    sorted_rows_ptr,  # int64 [N]: global row ids, sorted
    sort_order_ptr,  # int64 [N]: lookup at each sorted position
    segment_start_ptr,  # int64 [N]: first sorted position of the segment holding each position
    partial_gradients_ptr,  # fp32 [cdiv(N, CHUNK), BLOCK_D]: gradient sums of full chunks
    num_lookups,  # N
    indices_ptr,  # int64 [N]: row within its table of each lookup
    bag_of_index_ptr,  # int64 [N]: bag t*B+b of each lookup
    offsets_ptr,  # int64 [T*B+1]: bag boundaries
    per_sample_weights_ptr,  # fp32 [N] (read only if HAS_PER_SAMPLE_WEIGHTS)
    slot_of_index_ptr,  # int32 [N]: slot holding each lookup's row, or -1
    grad_output_ptr,  # fp32 [B, total_dim] or [N, max_dim] (pooling none)
    grad_output_stride,  # elements between consecutive rows of grad_output
    device_weights_ptr,  # flat weights of DEVICE tables
    host_weights_ptr,  # flat weights of HOST tables
    managed_weights_ptr,  # flat weights of MANAGED tables
    device_state_ptr,  # flat fp32 optimizer state of DEVICE tables
    host_state_ptr,  # flat fp32 optimizer state of HOST tables
    managed_state_ptr,  # flat fp32 optimizer state of MANAGED tables
    cache_weights_ptr,  # [num_slots, cache_row_width] slot-cache rows
    cache_weights_stride,  # elements between consecutive slots of cache_weights
    cache_state_ptr,  # fp32 [num_slots, cache_state_width] optimizer state of cached rows
    cache_state_stride,  # elements between consecutive slots of cache_state
    table_tier_ptr,  # int32 [T]: tier code of each table
    table_weight_offset_ptr,  # int64 [T]: element offset of row 0 of each table in its tier's weights
    table_state_offset_ptr,  # int64 [T]: element offset of row 0 of each table in its tier's state
    table_dim_ptr,  # int32 [T]: embedding_dim of each table
    table_output_offset_ptr,  # int32 [T]: first column of each table in a grad_output row
    batch_size,  # B
    lr,  # learning rate
    eps,  # Adagrad / Adam denominator epsilon
    beta1,  # Adam first-moment decay
    beta2,  # Adam second-moment decay
    weight_decay,  # Adam weight decay (added to the update, times lr)
    bias_correction1,  # Adam: 1 - beta1^step
    bias_correction2,  # Adam: 1 - beta2^step
    seed,  # stochastic rounding: philox key
    step,  # optimizer step count: part of the philox counter, so a fixed seed still varies per step
    POOLING: tl.constexpr,  # pooling code (see forward.py)
    HAS_PER_SAMPLE_WEIGHTS: tl.constexpr,  # whether lookups carry per-sample weights
    USE_CACHE: tl.constexpr,  # whether any slot exists (else every row is in a backing store)
    OPTIMIZER: tl.constexpr,  # OPTIMIZER_SGD, OPTIMIZER_ROWWISE_ADAGRAD or OPTIMIZER_ADAM
    STOCHASTIC_ROUNDING: tl.constexpr,  # round fp16 / bf16 weights stochastically (else to nearest)
    CHUNK: tl.constexpr,  # lookups per chunk of a long segment (see _chunk_gradient_kernel)
    BLOCK_L: tl.constexpr,  # lookups (or partial sums) loaded per tile
    BLOCK_D: tl.constexpr,  # columns per tile: next power of two of the largest embedding_dim
):
    position = tl.program_id(0).to(tl.int64)
    row = tl.load(sorted_rows_ptr + position)
    next_row = tl.load(sorted_rows_ptr + position + 1, mask=position + 1 < num_lookups, other=-1)
    if row != next_row:  # the last position of a segment owns the row
        start = tl.load(segment_start_ptr + position)
        full_chunks = (position - start + 1) // CHUNK
        lookup = tl.load(sort_order_ptr + position)  # any lookup of the row gives table, row and slot
        table = tl.load(bag_of_index_ptr + lookup) // batch_size
        table_row = tl.load(indices_ptr + lookup)
        tier = tl.load(table_tier_ptr + table)
        dim = tl.load(table_dim_ptr + table)
        output_column = 0
        if POOLING != _POOLING_NONE:
            output_column = tl.load(table_output_offset_ptr + table)
        columns = tl.arange(0, BLOCK_D)
        in_row = columns < dim

        # Sum the lookups after the last full chunk, then the full chunks' partial sums.
        accumulator = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
        for tile_start in range(start + full_chunks * CHUNK, position + 1, BLOCK_L):
            sorted_positions = tile_start + tl.arange(0, BLOCK_L)
            accumulator += _gradient_tile(
                sorted_positions, sorted_positions <= position, sort_order_ptr, bag_of_index_ptr, offsets_ptr,
                per_sample_weights_ptr, grad_output_ptr, grad_output_stride, output_column, columns, in_row,
                batch_size, POOLING, HAS_PER_SAMPLE_WEIGHTS)
        # Chunk j of the segment ends at start + (j+1)*CHUNK - 1, in window (start + CHUNK - 1) // CHUNK + j.
        first_window = (start + CHUNK - 1) // CHUNK
        for chunk_offset in range(0, full_chunks, BLOCK_L):
            chunk_ids = chunk_offset + tl.arange(0, BLOCK_L)
            partial_ptrs = partial_gradients_ptr + (first_window + chunk_ids)[:, None] * BLOCK_D + columns[None, :]
            accumulator += tl.load(partial_ptrs, mask=(chunk_ids < full_chunks)[:, None], other=0.0)
        grad = tl.sum(accumulator, axis=0)

        # The newest copy of the row and its state: its slot, else its backing store.
        weights_ptr = _weights_of_tier(tier, device_weights_ptr, host_weights_ptr, managed_weights_ptr)
        weights_ptr += tl.load(table_weight_offset_ptr + table) + table_row * dim
        state_ptr = _weights_of_tier(tier, device_state_ptr, host_state_ptr, managed_state_ptr)
        state_ptr += tl.load(table_state_offset_ptr + table)
        if OPTIMIZER == _OPTIMIZER_ADAM:
            state_ptr += table_row * (2 * dim)  # m then v, dim values each
        else:
            state_ptr += table_row  # one accumulator per row (SGD has no state and never reads it)
        if USE_CACHE:
            slot = tl.load(slot_of_index_ptr + lookup)
            if slot >= 0:
                weights_ptr = cache_weights_ptr + slot.to(tl.int64) * cache_weights_stride
                state_ptr = cache_state_ptr + slot.to(tl.int64) * cache_state_stride

        # Every load of the row and its state comes before the barrier below, every store after it.
        # Threads of a program hold copies of the same values (the Adagrad accumulator in every
        # thread; each element in several threads when the row is narrower than the program): a
        # thread that stored before another one loaded would make that one apply the update twice.
        weights = tl.load(weights_ptr + columns, mask=in_row, other=0.0).to(tl.float32)
        if OPTIMIZER == _OPTIMIZER_SGD:
            weights = weights - lr * grad
        elif OPTIMIZER == _OPTIMIZER_ROWWISE_ADAGRAD:
            accumulated = tl.load(state_ptr) + tl.sum(grad * grad, axis=0) / dim.to(tl.float32)
            weights = weights - lr * grad / (tl.sqrt_rn(accumulated) + eps)
        else:
            m = beta1 * tl.load(state_ptr + columns, mask=in_row, other=0.0) + (1 - beta1) * grad
            v = beta2 * tl.load(state_ptr + dim + columns, mask=in_row, other=0.0) + (1 - beta2) * grad * grad
            update = (m / bias_correction1) / (tl.sqrt_rn(v / bias_correction2) + eps) + weight_decay * weights
            weights = weights - lr * update

        if STOCHASTIC_ROUNDING:
            # Philox counter (column, row low word, row high word, step): a distinct draw per element
            # and step.
            zeros = tl.zeros_like(columns)
            random_bits, _, _, _ = tl.philox(seed, columns, zeros + (row & 0xFFFFFFFF).to(tl.int32),
                                             zeros + (row >> 32).to(tl.int32), zeros + step)
            weights = _stochastic_round(weights, random_bits, weights_ptr.dtype.element_ty)
        tl.debug_barrier()
        if OPTIMIZER == _OPTIMIZER_ROWWISE_ADAGRAD:
            tl.store(state_ptr, accumulated)
        if OPTIMIZER == _OPTIMIZER_ADAM:
            tl.store(state_ptr + columns, m, mask=in_row)
            tl.store(state_ptr + dim + columns, v, mask=in_row)
        tl.store(weights_ptr + columns, weights.to(weights_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def _per_sample_weights_grad_kernel(
    per_sample_weights_grad_ptr,  # fp32 [N]: out, d loss / d per_sample_weights[i]
    grad_output_ptr,  # fp32 [B, total_dim] or [N, max_dim] (pooling none)
    grad_output_stride,  # elements between consecutive rows of grad_output
    device_weights_ptr,  # flat weights of DEVICE tables
    host_weights_ptr,  # flat weights of HOST tables
    managed_weights_ptr,  # flat weights of MANAGED tables
    cache_weights_ptr,  # [num_slots, cache_row_width] slot-cache rows
    cache_weights_stride,  # elements between consecutive slots
    table_tier_ptr,  # int32 [T]: tier code of each table
    table_weight_offset_ptr,  # int64 [T]: element offset of row 0 of each table in its tier's store
    table_dim_ptr,  # int32 [T]: embedding_dim of each table
    table_output_offset_ptr,  # int32 [T]: first column of each table in a grad_output row
    indices_ptr,  # int64 [N]: row within its table of each lookup
    offsets_ptr,  # int64 [T*B+1]: bag boundaries
    slot_of_index_ptr,  # int32 [N]: slot holding each lookup's row, or -1
    batch_size,  # B
    POOLING: tl.constexpr,  # pooling code (see forward.py)
    USE_CACHE: tl.constexpr,  # whether any slot exists
    BLOCK_L: tl.constexpr,  # lookups per tile
    BLOCK_D: tl.constexpr,  # columns per tile: next power of two of the largest embedding_dim
):
    bag = tl.program_id(0)
    table = bag // batch_size
    sample = bag - table * batch_size
    tier = tl.load(table_tier_ptr + table)
    dim = tl.load(table_dim_ptr + table)
    table_store_ptr = _weights_of_tier(tier, device_weights_ptr, host_weights_ptr, managed_weights_ptr)
    table_store_ptr += tl.load(table_weight_offset_ptr + table)
    start = tl.load(offsets_ptr + bag)
    end = tl.load(offsets_ptr + bag + 1)
    columns = tl.arange(0, BLOCK_D)
    in_row = columns < dim
    if POOLING != _POOLING_NONE:
        # Every lookup of the bag shares its output row's gradient: load it once.
        bag_grad = tl.load(grad_output_ptr + sample.to(tl.int64) * grad_output_stride
                           + tl.load(table_output_offset_ptr + table) + columns, mask=in_row, other=0.0)
        if POOLING == _POOLING_MEAN:
            bag_grad = bag_grad / tl.maximum(end - start, 1).to(tl.float32)
    for tile_start in range(start, end, BLOCK_L):
        positions = tile_start + tl.arange(0, BLOCK_L)
        in_tile = positions < end
        row_ptrs = _row_pointers(positions, in_tile, indices_ptr, slot_of_index_ptr, table_store_ptr, dim,
                                 cache_weights_ptr, cache_weights_stride, USE_CACHE)
        tile_mask = in_tile[:, None] & in_row[None, :]
        rows = tl.load(row_ptrs[:, None] + columns[None, :], mask=tile_mask, other=0.0).to(tl.float32)
        if POOLING == _POOLING_NONE:
            grads = tl.load(grad_output_ptr + positions[:, None] * grad_output_stride + columns[None, :],
                            mask=tile_mask, other=0.0)
        else:
            grads = bag_grad[None, :]
        tl.store(per_sample_weights_grad_ptr + positions, tl.sum(rows * grads, axis=1), mask=in_tile)


def _check_grad_output(grad_output: torch.Tensor, stores: RowStores, lookups: Lookups, mode: int) -> torch.Tensor:
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


def _warps_for(block_d: int) -> int:
    """Warps of the gather kernels: about one 4-element vector per thread across a row."""
    return 2 if block_d <= 64 else 4 if block_d <= 256 else 8


def update_config(block_d: int) -> tuple[int, int]:
    """``(BLOCK_L, num_warps)`` of ``_row_update_kernel``: most rows have one or two lookups (and
    hot ones are cut into chunks), so its tiles are short: masked-off rows still cost issue slots.

    Measured on an H200 at dim 128 (BLOCK_L, warps): (2, 2) 2.5 ms, (4, 2) 3.0, (8, 2) 3.5, (8, 4) 6.6.
    """
    if INTERPRETING:
        return tile_rows_for(block_d), _warps_for(block_d)
    return max(1, min(8, 256 // block_d)), 2 if block_d <= 128 else 4 if block_d <= 512 else 8


def backward_update(
    grad_output: torch.Tensor,
    stores: RowStores,
    lookups: Lookups,
    slot_of_index: torch.Tensor,
    pooling: str,
    optimizer_kind: int,
    lr: float,
    eps: float = 1e-8,
    beta1: float = 0.9,
    beta2: float = 0.999,
    weight_decay: float = 0.0,
    step: int = 1,
    stochastic_rounding: bool = False,
    seed: int = 0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> None:
    """Sum the gradient of each unique row of the batch and apply the optimizer to it, in place.

    Args:
        grad_output: fp32 ``[B, total_dim]`` (sum, mean) or ``[N, max_dim]`` (none): gradient of the
            output of ``pooled_forward``.
        stores: rows and optimizer state (updated in place: the slot when a lookup's slot is >= 0,
            else the backing store; state layout in ``kernels/rows.py``).
        lookups: the batch that produced the output.
        slot_of_index: int32 [N]: slot of each lookup's row, or -1 (all lookups of a row agree).
        pooling: ``"sum"``, ``"mean"`` or ``"none"``, as in the forward.
        optimizer_kind: ``tiered_tbe.optimizers.OptimizerKind`` (0 NONE returns at once, 1 SGD,
            2 row-wise Adagrad, 3 Adam); formulas in ``tiered_tbe/optimizers.py``.
        lr, eps, beta1, beta2, weight_decay: optimizer hyper-parameters (the unused ones are ignored).
        step: the 1-based optimizer step: Adam's bias correction, and part of stochastic rounding's draw.
        stochastic_rounding: round fp16 / bf16 weights stochastically instead of to nearest.
        seed: stochastic rounding's random key (the draws also depend on ``step``, row and column).
        chunk_size: lookups of one row summed by one program before the partial sums are combined
            (a power of two, at most 4096); only hot rows with more lookups than this use more than
            one program.
    """
    kind = int(optimizer_kind)
    if kind == OPTIMIZER_NONE or lookups.num_lookups == 0:
        return
    if kind not in (OPTIMIZER_SGD, OPTIMIZER_ROWWISE_ADAGRAD, OPTIMIZER_ADAM):
        raise ValueError(f"unknown optimizer kind {optimizer_kind}")
    if not 1 <= chunk_size <= 4096 or chunk_size & (chunk_size - 1):
        # A program loads a whole chunk's segment starts as one vector: keep it small.
        raise ValueError(f"chunk_size must be a power of two in [1, 4096], got {chunk_size}")
    if step < 1:
        raise ValueError(f"step is 1-based, got {step}")
    mode = pooling_code(pooling)
    check_lookups(stores, lookups, slot_of_index)
    grad_output = _check_grad_output(grad_output, stores, lookups, mode)
    tensors = launch_stores(stores)
    num_lookups = lookups.num_lookups
    device = lookups.indices.device

    # Group the lookups of each row, deterministically (stable sort), without leaving the device.
    sorted_rows, sort_order = sort_ids(lookups.global_rows, stores.num_rows or INT64_MAX, stable=True)
    # First position of each position's row; a binary search per position (torch's 1-D cummax on
    # CUDA runs in one thread block: 8 ms for 2M lookups on an H200).
    segment_start = torch.searchsorted(sorted_rows, sorted_rows)

    block_d = triton.next_power_of_2(stores.max_dim)
    update_block_l, update_num_warps = update_config(block_d)
    per_sample_weights = lookups.per_sample_weights
    has_per_sample_weights = per_sample_weights is not None
    per_sample_weights = per_sample_weights.contiguous() if has_per_sample_weights else grad_output
    bag_of_index = lookups.bag_of_index.contiguous()
    offsets = lookups.offsets.contiguous()

    num_windows = triton.cdiv(num_lookups, chunk_size)
    partial_gradients = torch.empty(num_windows, block_d, dtype=torch.float32, device=device)
    _chunk_gradient_kernel[(num_windows,)](
        partial_gradients, sort_order, segment_start, num_lookups,
        bag_of_index, offsets, per_sample_weights, grad_output, grad_output.stride(0),
        stores.table_dim, stores.table_output_offset, lookups.batch_size,
        POOLING=mode, HAS_PER_SAMPLE_WEIGHTS=has_per_sample_weights,
        CHUNK=chunk_size, BLOCK_L=min(tile_rows_for(block_d), chunk_size), BLOCK_D=block_d,
        num_warps=_warps_for(block_d),
    )
    _row_update_kernel[(num_lookups,)](
        sorted_rows, sort_order, segment_start, partial_gradients, num_lookups,
        lookups.indices.contiguous(), bag_of_index, offsets, per_sample_weights, slot_of_index.contiguous(),
        grad_output, grad_output.stride(0),
        tensors["device_weights"], tensors["host_weights"], tensors["managed_weights"],
        tensors["device_state"], tensors["host_state"], tensors["managed_state"],
        tensors["cache_weights"], tensors["cache_weights"].stride(0),
        tensors["cache_state"], tensors["cache_state"].stride(0),
        stores.table_tier, stores.table_weight_offset, stores.table_state_offset, stores.table_dim,
        stores.table_output_offset, lookups.batch_size,
        float(lr), float(eps), float(beta1), float(beta2), float(weight_decay),
        1.0 - float(beta1) ** step, 1.0 - float(beta2) ** step, int(seed), int(step) & 0x7FFFFFFF,
        POOLING=mode, HAS_PER_SAMPLE_WEIGHTS=has_per_sample_weights,
        USE_CACHE=tensors["cache_weights"].shape[0] > 0, OPTIMIZER=kind,
        STOCHASTIC_ROUNDING=bool(stochastic_rounding) and tensors["device_weights"].dtype != torch.float32,
        CHUNK=chunk_size, BLOCK_L=update_block_l, BLOCK_D=block_d, num_warps=update_num_warps,
    )


def per_sample_weights_grad(
    grad_output: torch.Tensor, stores: RowStores, lookups: Lookups, slot_of_index: torch.Tensor, pooling: str
) -> torch.Tensor:
    """fp32 [N]: d loss / d per_sample_weights[i] = dot(grad of lookup i's output, row i), / bag length for mean.

    Reads the rows as they are now: call it before ``backward_update`` changes them.
    """
    mode = pooling_code(pooling)
    check_lookups(stores, lookups, slot_of_index)
    grad_output = _check_grad_output(grad_output, stores, lookups, mode)
    tensors = launch_stores(stores)
    result = torch.empty(lookups.num_lookups, dtype=torch.float32, device=lookups.indices.device)
    num_bags = stores.num_tables * lookups.batch_size
    if num_bags == 0 or lookups.num_lookups == 0:
        return result
    block_d = triton.next_power_of_2(stores.max_dim)
    _per_sample_weights_grad_kernel[(num_bags,)](
        result, grad_output, grad_output.stride(0),
        tensors["device_weights"], tensors["host_weights"], tensors["managed_weights"],
        tensors["cache_weights"], tensors["cache_weights"].stride(0),
        stores.table_tier, stores.table_weight_offset, stores.table_dim, stores.table_output_offset,
        lookups.indices.contiguous(), lookups.offsets.contiguous(), slot_of_index.contiguous(), lookups.batch_size,
        POOLING=mode, USE_CACHE=tensors["cache_weights"].shape[0] > 0,
        BLOCK_L=tile_rows_for(block_d), BLOCK_D=block_d, num_warps=_warps_for(block_d),
    )
    return result
