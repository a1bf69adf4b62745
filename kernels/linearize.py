"""Linearize a batch: the global row id and the bag of every lookup, in one pass over the bags.

All tables of a module share one global row id space (``g = row_offset[t] + r``, the
descriptor's ``ROW_OFFSET``); the
cache keys its slots by ``g`` and the backward sorts lookups by ``g``. Both also need the bag
``f * B + b`` of each lookup, which the TBE layout gives only as bag boundaries (``offsets``).
One launch, tiled like the forward (``kernels/addressing.py``), writes both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tiered_tbe.base.codes import INT32_MAX

from .addressing import INTERPRETING, ROW_OFFSET, bag_length_class, bag_tile_bounds, descriptor_field
from .rows import Lookups, RowStores


@triton.jit(do_not_specialize=["num_lookups", "batch_size"])
def _linearize_kernel(
    global_rows_ptr,  # int32/int64 [N] out: the global row of row 0 of the lookup's table + indices[i]
    bag_of_index_ptr,  # int32 [N] out: f*B + b of the bag holding lookup i
    descriptor_ptr,  # int64 [F, DESCRIPTOR_COLUMNS]: the global row id of row 0 of each feature's table
    indices_ptr,  # int32/int64 [N]: row within its feature's table of each lookup
    offsets_ptr,  # int32/int64 [F*B+1]: bag boundaries, feature-major
    num_lookups,  # N: positions past it are never written, whatever the offsets say
    batch_size,  # B
    BLOCK_B: tl.constexpr,  # bags per program
    BLOCK_L: tl.constexpr,  # lookups of each bag per step
):
    feature = tl.program_id(1)
    bags, _, starts, ends = bag_tile_bounds(offsets_ptr, feature, tl.program_id(0) * BLOCK_B, batch_size, BLOCK_B,
                                            BLOCK_L)
    row_offset = descriptor_field(descriptor_ptr, feature, None, ROW_OFFSET)
    bag_ids = (feature * batch_size + bags).to(tl.int32)
    lanes = tl.arange(0, BLOCK_B * BLOCK_L) % BLOCK_L
    for step_start in range(0, tl.max(ends - starts, axis=0), BLOCK_L):
        positions = starts + step_start + lanes
        in_bag = (positions < ends) & (positions < num_lookups)
        rows = tl.load(indices_ptr + positions, mask=in_bag, other=0).to(tl.int64) + row_offset
        tl.store(global_rows_ptr + positions, rows.to(global_rows_ptr.dtype.element_ty), mask=in_bag)
        tl.store(bag_of_index_ptr + positions, bag_ids, mask=in_bag)


def linearize_tile(num_lookups: int, num_bags: int) -> tuple[int, int]:
    """``(BLOCK_B, BLOCK_L)`` of a batch: as many lanes a bag as its bag-length class's mean length
    (up to a warp), 128 positions a tile. A warp then reads and writes consecutive positions (one
    bag of 32, or 32 bags of one) rather than 8 runs of 4, which is what FBGEMM's linearize does;
    the class is the forward autotuner's, so a model shape compiles one tile."""
    block_l = min(32, 1 << bag_length_class(num_lookups, num_bags))
    return 128 // block_l, block_l


def linearize(stores: RowStores, lookups: Lookups, key_dtype: torch.dtype = torch.int64,
              tile: tuple[int, int] | None = None, padding_row: int | None = None) -> Lookups:
    """``lookups`` with ``global_rows`` (``key_dtype`` [N]) and ``bag_of_index`` (int32 [N]) filled in.

    ``key_dtype=torch.int32`` (sort keys) needs every global row id below 2^31. Lookups that
    come with both already are returned as they are. Indices are not checked here: an index out
    of its table's range gives a global row of another table (the module validates first).
    ``tile``: ``(BLOCK_B, BLOCK_L)`` instead of ``linearize_tile``'s (tests). ``padding_row``: the
    global row of the positions past ``offsets[-1]`` (a padded batch, ``grouping.pad_batch``; their bag
    is 0), which the kernel does not write.
    """
    if lookups.global_rows is not None and lookups.bag_of_index is not None:
        return lookups
    if key_dtype == torch.int32 and stores.num_rows > INT32_MAX:
        raise ValueError(f"int32 keys need fewer than 2^31 global rows, the tables have {stores.num_rows}")
    device = lookups.indices.device
    num_lookups = lookups.num_lookups
    if padding_row is None:
        global_rows = torch.empty(num_lookups, dtype=key_dtype, device=device)
        bag_of_index = torch.empty(num_lookups, dtype=torch.int32, device=device)
    else:
        global_rows = torch.full((num_lookups,), padding_row, dtype=key_dtype, device=device)
        bag_of_index = torch.zeros(num_lookups, dtype=torch.int32, device=device)
    if num_lookups > 0 and lookups.batch_size > 0:
        if tile is None:
            tile = (2, 2) if INTERPRETING else linearize_tile(num_lookups, stores.num_features * lookups.batch_size)
        block_b, block_l = tile
        grid = (triton.cdiv(lookups.batch_size, block_b), stores.num_features)
        _linearize_kernel[grid](global_rows, bag_of_index, stores.descriptor, lookups.indices,
                                lookups.offsets, num_lookups, lookups.batch_size, BLOCK_B=block_b, BLOCK_L=block_l,
                                num_warps=4)
    return lookups._replace(global_rows=global_rows, bag_of_index=bag_of_index)
