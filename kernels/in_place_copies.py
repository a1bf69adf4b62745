"""Rows read in place, copied to HBM by the forward for the backward.

A lookup whose row has no slot reads it from its backing store (host or managed memory), over the
bus: once in the forward, then once more in the backward, which updates it there (read, then
write). Each crossing costs about as much as any other (the H100 moved random rows of managed
memory in place at ~47-50 GB/s read or written, and a read-modify-write took the sum of both:
``docs/performance.md``). So the forward, which has the row in registers anyway, also writes it
to a copy row in HBM, and the backward reads that copy instead: a row read in place crosses the
bus twice a step instead of three times.

The cache ranks the rows of a batch that got no slot (``CacheBatch.in_place_rank``: int32 [N], the
rank of each lookup's row among them, -1 for a lookup with a slot); the module keeps ``num_copies``
copy rows (``CacheConfig.in_place_copies``) and a row ranked past them keeps none (its backward
reads the store, as before). Every lookup of a row writes the same values to its copy: no order
between them is needed. The copies are valid only while nothing else changed the stores: the
module (``tiered_tbe/module.py``) lets a backward read them only if no other training forward and
no other backward ran since the batch's forward (else it reads the stores, which is always right).

Plain-torch reference of what the backward reads for a row of rank ``r``:
``copies[r] if 0 <= r < num_copies else store_row``, equal by construction while the copy is valid.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class InPlaceCopies(NamedTuple):
    """What a forward writes and its backward reads back (see the module docstring)."""

    rank: torch.Tensor  # int32 [N]: the copy row of each lookup read in place, or -1
    rows: torch.Tensor  # [num_copies, row_width] of the weights' dtype: the copy rows


def uses_copies(copies: InPlaceCopies | None, use_cache: bool) -> bool:
    """Whether a forward keeps (or its backward reads) ``copies``: a batch that may read rows in place
    (``use_cache``: some lookup may lack a slot) and at least one copy row."""
    return use_cache and copies is not None and copies.rows.shape[0] > 0


@triton.jit
def keep_copies(
    tile,  # fp32 [*positions.shape, BLOCK_D]: the rows of the lookups (lookup_rows' result)
    positions,  # int64 [F] or [BAGS, LANES]: lookup positions of the tile
    in_bag,  # bool, same shape: which positions are real lookups
    in_row,  # bool [BLOCK_D]: the table's columns
    columns,  # int32 [BLOCK_D]
    in_place_rank_ptr,  # int32 [N]: copy row of each lookup read in place, or -1
    copies_ptr,  # [num_copies, row_width]: the copy rows, the weights' element type
    copies_stride,  # elements between consecutive copy rows
    num_copies,  # copy rows; a rank past them keeps no copy
    ALIGN_BYTES: tl.constexpr,  # every row start is a multiple of this many bytes
):
    """Write the row of every lookup of the tile that was read in place (and ranked below
    ``num_copies``) to its copy row, in the weights' element type (an exact round trip through fp32)."""
    ranks = tl.load(in_place_rank_ptr + positions, mask=in_bag, other=-1)
    keeps = in_bag & (ranks >= 0) & (ranks < num_copies)
    starts = copies_ptr + tl.where(keeps, ranks, 0).to(tl.int64) * copies_stride
    if len(starts.shape) == 2:  # tl.multiple_of takes one value per dimension
        starts = tl.multiple_of(starts, [ALIGN_BYTES, ALIGN_BYTES])
    else:
        starts = tl.multiple_of(starts, ALIGN_BYTES)
    tl.store(tl.expand_dims(starts, -1) + columns, tile.to(copies_ptr.dtype.element_ty),
             mask=tl.expand_dims(keeps, -1) & in_row)


@triton.jit
def read_pointers(
    weight_rows,  # pointer tensor [R]: column 0 of each row where the update writes it (slot or store)
    ranks,  # int32 [R]: copy row of each row, or -1
    copies_ptr,  # [num_copies, row_width]: the copy rows, the weights' element type
    copies_stride,  # elements between consecutive copy rows
    num_copies,  # copy rows
    ALIGN_BYTES: tl.constexpr,  # every row start is a multiple of this many bytes
):
    """Where the backward reads each row before updating it: its copy row if it has one, else
    ``weight_rows`` (its slot or its store)."""
    has_copy = (ranks >= 0) & (ranks < num_copies)
    pointers = tl.where(has_copy, copies_ptr + tl.where(has_copy, ranks, 0).to(tl.int64) * copies_stride,
                        weight_rows)
    return tl.multiple_of(pointers, ALIGN_BYTES)
