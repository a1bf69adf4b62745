"""Gradient of the per-sample weights: d loss / d w_i = dot(gradient of lookup i's output, row i).

It reads the rows as they are before the update: the autograd wiring computes it before
``backward_update`` (``kernels/backward.py``). Tiled like the forward (``kernels/addressing.py``),
and like it launched once per column group of the stores for sum and mean pooling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .addressing import (
    DIM,
    INTERPRETING,
    OUTPUT_OFFSET,
    POOLING_MEAN_CONSTEXPR,
    POOLING_NONE_CONSTEXPR,
    WEIGHTS_ADDRESS,
    WEIGHTS_STRIDE,
    bag_tile_bounds,
    descriptor_field,
    descriptor_field_int32,
    lookup_rows,
    pooling_code,
    program_feature,
    table_row_zero,
)
from .backward import check_grad_output
from .forward import launch_groups, launches_per_group
from .rows import Lookups, RowStores, check_lookups


@triton.jit(do_not_specialize=["batch_size"])
def _per_sample_weights_grad_kernel(
    per_sample_weights_grad_ptr,  # fp32 [N] out: d loss / d per_sample_weights[i]
    grad_output_ptr,  # fp32 [B, total_dim] or [N, max_dim] (pooling none)
    grad_output_stride,  # elements between consecutive rows of grad_output
    descriptor_ptr,  # int64 [G, DESCRIPTOR_COLUMNS]: the launch's features' table rows, dim, output column (and
    #                  feature, when GROUPED)
    cache_weights_ptr,  # [num_slots, row_width] slot rows
    cache_weights_stride,  # elements between consecutive slots
    indices_ptr,  # int32/int64 [N]: row within its feature's table of each lookup
    offsets_ptr,  # int32/int64 [F*B+1]: bag boundaries
    slot_of_index_ptr,  # int32 [N]: slot holding each lookup's row, or -1 (read only if USE_CACHE)
    batch_size,  # B
    POOLING: tl.constexpr,  # pooling code
    USE_CACHE: tl.constexpr,  # whether any lookup may have a slot
    ALIGN: tl.constexpr,  # every row start and dim is a multiple of this many elements
    ALIGN_BYTES: tl.constexpr,  # ALIGN in bytes of a weight
    BLOCK_B: tl.constexpr,  # bags per program
    BLOCK_L: tl.constexpr,  # lookups of each bag per step
    BLOCK_D: tl.constexpr,  # next power of two of the largest embedding_dim of the launch's features
    GROUPED: tl.constexpr,  # descriptor_ptr holds a column group's rows: program (i, g) takes the feature of row g
):
    row = tl.program_id(1)  # of the launch's descriptor
    feature = program_feature(descriptor_ptr, row, GROUPED)
    element = cache_weights_ptr.dtype.element_ty
    bags, in_batch, starts, ends = bag_tile_bounds(offsets_ptr, feature, tl.program_id(0) * BLOCK_B, batch_size,
                                                   BLOCK_B, BLOCK_L)
    lanes = tl.arange(0, BLOCK_B * BLOCK_L) % BLOCK_L
    table_rows = table_row_zero(descriptor_ptr, row, None, WEIGHTS_ADDRESS, element)
    row_stride = descriptor_field(descriptor_ptr, row, None, WEIGHTS_STRIDE)
    columns = tl.arange(0, BLOCK_D)
    in_row = columns < descriptor_field_int32(descriptor_ptr, row, None, DIM, ALIGN)
    if POOLING != POOLING_NONE_CONSTEXPR:
        # Every lookup of a bag shares its output row's gradient (one load per tile row, from L1).
        bag_grads = tl.load(grad_output_ptr + bags[:, None].to(tl.int64) * grad_output_stride
                            + descriptor_field_int32(descriptor_ptr, row, None, OUTPUT_OFFSET, ALIGN)
                            + columns[None, :],
                            mask=in_batch[:, None] & in_row[None, :], other=0.0)
        if POOLING == POOLING_MEAN_CONSTEXPR:
            bag_grads = bag_grads / tl.maximum(ends - starts, 1).to(tl.float32)[:, None]
    for step_start in range(0, tl.max(ends - starts, axis=0), BLOCK_L):
        positions = starts + step_start + lanes
        in_bag = positions < ends
        tile = lookup_rows(positions, in_bag, in_row, columns, indices_ptr, slot_of_index_ptr, table_rows, row_stride,
                           cache_weights_ptr, cache_weights_stride, USE_CACHE, ALIGN_BYTES)
        tile_mask = in_bag[:, None] & in_row[None, :]
        if POOLING == POOLING_NONE_CONSTEXPR:
            grads = tl.load(grad_output_ptr + positions[:, None] * grad_output_stride + columns[None, :],
                            mask=tile_mask, other=0.0)
        else:
            grads = bag_grads
        tl.store(per_sample_weights_grad_ptr + positions, tl.sum(tile * grads, axis=1), mask=in_bag)


def per_sample_weights_grad(
    grad_output: torch.Tensor, stores: RowStores, lookups: Lookups, slot_of_index: torch.Tensor | None, pooling: str
) -> torch.Tensor:
    """fp32 [N]: d loss / d per_sample_weights[i] = dot(grad of lookup i's output, row i), / bag length for mean.

    Reads the rows as they are now: call it before ``backward_update`` changes them.
    """
    mode = pooling_code(pooling)
    check_lookups(stores, lookups, slot_of_index)
    grad_output = check_grad_output(grad_output, stores, lookups, mode)
    result = torch.empty(lookups.num_lookups, dtype=torch.float32, device=lookups.indices.device)
    if lookups.batch_size == 0 or lookups.num_lookups == 0:
        return result
    use_cache = slot_of_index is not None and stores.uses_cache
    block_b, block_l = (2, 2) if INTERPRETING else (8, 4)
    grouped = launches_per_group(stores, mode)  # as the forward's
    for group in launch_groups(stores, grouped):
        _per_sample_weights_grad_kernel[(triton.cdiv(lookups.batch_size, block_b), len(group.features))](
            result, grad_output, grad_output.stride(0),
            group.descriptor, stores.cache_weights, stores.cache_weights.stride(0),
            lookups.indices, lookups.offsets, slot_of_index if use_cache else lookups.indices, lookups.batch_size,
            POOLING=mode, USE_CACHE=use_cache, ALIGN=stores.alignment,
            ALIGN_BYTES=stores.alignment * stores.weights_dtype.itemsize,
            BLOCK_B=block_b, BLOCK_L=block_l, BLOCK_D=group.block_d, GROUPED=grouped, num_warps=4,
        )
    return result
