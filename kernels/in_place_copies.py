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

**Gathered before the forward, scattered after the backward** (``TIERED_TBE_IN_PLACE_GATHER``, off by default
until measured): instead of the forward copying the rows it reads, :func:`gather_in_place_rows` copies each
rank's row to its copy row first, in a kernel of few programs with several rows each in flight, and the
forward reads those lookups from the copies (HBM). The forward's own grid, which its HBM reads need, then
waits on the host link no longer: an H100 gathered random managed rows at the link's full rate (50.7 GB/s)
with 66 one-warp programs of 8 rows each and let a sort on another stream run beside it (0.94 of the sort's
time saved), where a program a row step took turns with the sort (0.04; ``tools/bench_link_sharing.py``,
docs/performance.md). So the prefetch stream's work can run beside a pipeline's reads of rows in place. The
copies hold the same values either way: both read the stores after the last backward, on the training stream.
The backward then reads and writes those rows in their copies (``COPIES_READ_AND_WRITTEN``) and
:func:`scatter_in_place_rows` writes them to their stores, on the same few programs, before the batch's unlock
lets a prefetch cache them again.

Plain-torch reference of what the backward reads for a row of rank ``r``:
``copies[r] if 0 <= r < num_copies else store_row``, equal by construction while the copy is valid.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .addressing import (
    DIM,
    WEIGHTS_ADDRESS,
    WEIGHTS_STRIDE,
    descriptor_field,
    descriptor_field_int32,
    feature_of_positions,
    row_pointers,
    table_row_zero,
)


class InPlaceCopies(NamedTuple):
    """What a forward writes and its backward reads back (see the module docstring)."""

    rank: torch.Tensor  # int32 [N]: the copy row of each lookup read in place, or -1
    rows: torch.Tensor  # [num_copies, row_width] of the weights' dtype: the copy rows
    # For a gather before the forward (gather_in_place_rows; None: the forward copies as it reads):
    lookup: torch.Tensor | None = None  # int32 [N]: at each rank below the count, a lookup of that rank's row
    count: torch.Tensor | None = None  # int32 [1]: the batch's rows read in place (CacheBatch.in_place_count)


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


# Programs of the gather of rows read in place: "0" (default) leaves the copying to the forward; "auto", half the
# SM count (the H100's best in tools/bench_link_sharing.py); a number, that many.
IN_PLACE_GATHER = os.environ.get("TIERED_TBE_IN_PLACE_GATHER", "0")
GATHER_ROWS = 8  # rows a gather program has in flight at once (4 lost 17% of the link's rate on the H100)
# What the backward's row updates do with a row that has a copy row (their READS_COPIES): read it there and
# write its store; or, where the copies were gathered, read and write it there (scatter_in_place_rows then
# writes the stores, on the same few programs as the gather).
COPIES_READ = 1
COPIES_READ_AND_WRITTEN = 2


def gather_programs(device: torch.device) -> int:
    """Programs of :func:`gather_in_place_rows` on ``device`` (0: no gather; ``IN_PLACE_GATHER``)."""
    if IN_PLACE_GATHER == "auto":
        return _half_the_sms(device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else 4
    return int(IN_PLACE_GATHER)


@functools.cache
def _half_the_sms(index: int) -> int:
    return max(torch.cuda.get_device_properties(index).multi_processor_count // 2, 1)


def gathers(copies: InPlaceCopies | None, use_cache: bool, device: torch.device) -> bool:
    """Whether the rows read in place are gathered into ``copies`` before the forward (and read there)."""
    return uses_copies(copies, use_cache) and copies.lookup is not None and gather_programs(device) > 0


@triton.jit
def _copy_in_place_rows_kernel(
    copies_ptr,  # [num_copies, row_width]: copy row r holds the row of rank r (its table's dim of columns)
    copies_stride,  # elements between consecutive copy rows
    num_copies,  # C: ranks at or past it keep no copy
    in_place_lookup_ptr,  # int32 [N]: at each rank below the count, a lookup of that rank's row
    in_place_count_ptr,  # int32 [1]: the batch's rows read in place
    indices_ptr,  # int32/int64 [N]: each lookup's row within its feature's table
    offsets_ptr,  # int32/int64 [F*B+1]: bag f*B+b is lookups offsets[f*B+b] : offsets[f*B+b+1]
    descriptor_ptr,  # int64 [F, DESCRIPTOR_COLUMNS]: every feature's table (base/descriptors.py)
    batch_size,  # B
    num_features,  # F
    SEARCH_STEPS: tl.constexpr,  # (F + 1).bit_length(): steps of the search for a lookup's feature
    ROWS: tl.constexpr,  # rows a program has in flight at once
    BLOCK_D: tl.constexpr,  # columns: the next power of two of the widest dim
    ALIGN: tl.constexpr,  # every row start, row stride and dim is a multiple of this many elements
    ALIGN_BYTES: tl.constexpr,  # ALIGN in bytes
    TO_STORES: tl.constexpr,  # copy rows -> backing stores (after an update), else stores -> copy rows
):
    # A grid-stride loop over the ranks, as far as the batch's count (read here: no host sync).
    count = tl.minimum(tl.load(in_place_count_ptr), num_copies)
    columns = tl.arange(0, BLOCK_D)
    for first in range(tl.program_id(0) * ROWS, count, tl.num_programs(0) * ROWS):
        ranks = first + tl.arange(0, ROWS)
        valid = ranks < count
        lookups = tl.load(in_place_lookup_ptr + ranks, mask=valid, other=0).to(tl.int64)
        feature = feature_of_positions(offsets_ptr, batch_size, lookups, valid, num_features, SEARCH_STEPS)
        feature = feature.to(tl.int32)
        index = tl.load(indices_ptr + lookups, mask=valid, other=0)
        table_rows = table_row_zero(descriptor_ptr, feature, valid, WEIGHTS_ADDRESS, copies_ptr.dtype.element_ty)
        row_stride = descriptor_field(descriptor_ptr, feature, valid, WEIGHTS_STRIDE)
        dim = descriptor_field_int32(descriptor_ptr, feature, valid, DIM, ALIGN)
        stored = row_pointers(table_rows, index, row_stride, index, table_rows, row_stride, False, ALIGN_BYTES)
        copied = tl.multiple_of(copies_ptr + ranks.to(tl.int64) * copies_stride, ALIGN_BYTES)
        columns_of_row = valid[:, None] & (columns[None, :] < dim[:, None])
        if TO_STORES:
            tile = tl.load(copied[:, None] + columns[None, :], mask=columns_of_row)
            tl.store(stored[:, None] + columns[None, :], tile, mask=columns_of_row)
        else:
            tile = tl.load(stored[:, None] + columns[None, :], mask=columns_of_row)
            tl.store(copied[:, None] + columns[None, :], tile, mask=columns_of_row)


def gather_in_place_rows(descriptor: torch.Tensor, block_d: int, alignment: int, indices: torch.Tensor,
                         offsets: torch.Tensor, batch_size: int, copies: InPlaceCopies, programs: int) -> None:
    """Copy the row of every rank below ``copies.count`` (and below the copy rows) to its copy row.

    Args:
        descriptor: int64 [F, DESCRIPTOR_COLUMNS], every feature's table (``RowStores.descriptor``);
            ``block_d`` the next power of two of the widest dim, ``alignment`` the rows' (in elements).
        indices, offsets: the batch's lookups (int32/int64 [N], [F*B+1]; the lookups at the positions the
            prefetch saw, its bags possibly padded with empty ones to ``batch_size`` a feature).
        copies: ``rows`` [C, row_width] written; ``lookup`` int32 [N] and ``count`` int32 [1] read.
        programs: programs of one warp; each keeps ``GATHER_ROWS`` rows in flight.
    No host sync; a CUDA graph may capture it.
    """
    _copy_in_place_rows(descriptor, block_d, alignment, indices, offsets, batch_size, copies, programs, False)


def scatter_in_place_rows(descriptor: torch.Tensor, block_d: int, alignment: int, indices: torch.Tensor,
                          offsets: torch.Tensor, batch_size: int, copies: InPlaceCopies, programs: int) -> None:
    """Copy every copy row of a rank below ``copies.count`` back to its row's backing store, after a
    backward that updated the rows there (``COPIES_READ_AND_WRITTEN``); arguments as
    :func:`gather_in_place_rows`'s."""
    _copy_in_place_rows(descriptor, block_d, alignment, indices, offsets, batch_size, copies, programs, True)


def _copy_in_place_rows(descriptor, block_d, alignment, indices, offsets, batch_size, copies, programs,
                        to_stores: bool) -> None:
    num_features = descriptor.shape[0]
    _copy_in_place_rows_kernel[(programs,)](
        copies.rows, copies.rows.stride(0), copies.rows.shape[0], copies.lookup, copies.count, indices, offsets,
        descriptor, batch_size, num_features, SEARCH_STEPS=(num_features + 1).bit_length(), ROWS=GATHER_ROWS,
        BLOCK_D=block_d, ALIGN=alignment, ALIGN_BYTES=alignment * copies.rows.element_size(), TO_STORES=to_stores,
        num_warps=1)
