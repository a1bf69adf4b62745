"""Triton helpers shared by the TBE kernels: where a lookup's row is, and the tiles of bags.

Every kernel finds a row the same way: table ``t``'s row 0 is at the address in column
``WEIGHTS_ADDRESS`` of row ``t`` of the stores' descriptor (``base/descriptors.py``; any memory
the GPU addresses), row ``r`` ``r * WEIGHTS_STRIDE`` elements further on, unless the lookup's
slot (``slot_of_index``) is ``>= 0``: then the newest copy is that slot of the cache. Addresses
are formed in int64 (row * stride passes 2^31 elements in large tables).

The forward-type kernels (pooled forward, linearize, per-sample-weight gradients) share one
tiling: program ``(i, f)`` takes bags ``i * BLOCK_B ..`` of feature ``f`` and walks them
``BLOCK_L`` lookups at a time, so one tile holds ``BLOCK_B x BLOCK_L`` lookups (many bags of
one lookup, or few long bags) and every load of the tile is issued at once. The pooled forward
and the per-sample-weight gradients launch once per column group (``kernels/rows.py``
``ColumnGroup``: features of one column tile), each over its group's descriptor rows: program
``(i, g)`` then pools the feature of row ``g`` (``program_feature``).
"""

from __future__ import annotations

import math
import os

import triton
import triton.language as tl

import tiered_tbe.base.mode  # noqa: F401  (first: picks GPU or simulation mode before kernels are defined)
from tiered_tbe.base import compiling, descriptors, interpreter

compiling.watch_triton_compiles()  # count compiles, and say so when the kernels of a new shape compile

# Triton runs its interpreter in CPU simulation mode (TRITON_INTERPRET=1, set by base.mode). Read
# from the environment, as Triton does, so the kernels can also be compiled for a GPU on a machine
# without one (tools/compile_kernels.py).
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
if INTERPRETING:
    interpreter.skip_repeated_language_patches()  # the same results, ~1.7x faster (base/interpreter.py)

# Codes of the POOLING constexpr.
POOLING_SUM = 0
POOLING_MEAN = 1
POOLING_NONE = 2
POOLING_CODES = {"sum": POOLING_SUM, "mean": POOLING_MEAN, "none": POOLING_NONE}

# Triton kernels may read module globals only when they are constexpr.
POOLING_MEAN_CONSTEXPR = tl.constexpr(POOLING_MEAN)
POOLING_NONE_CONSTEXPR = tl.constexpr(POOLING_NONE)

INTERPRETING_CONSTEXPR = tl.constexpr(INTERPRETING)

# The descriptor's columns (base/descriptors.py), as the constexprs the kernels index it with.
WEIGHTS_ADDRESS = tl.constexpr(descriptors.WEIGHTS_ADDRESS)
WEIGHTS_STRIDE = tl.constexpr(descriptors.WEIGHTS_STRIDE)
STATE_ADDRESS = tl.constexpr(descriptors.STATE_ADDRESS)
STATE_STRIDE = tl.constexpr(descriptors.STATE_STRIDE)
ROW_OFFSET = tl.constexpr(descriptors.ROW_OFFSET)
DIM = tl.constexpr(descriptors.DIM)
OUTPUT_OFFSET = tl.constexpr(descriptors.OUTPUT_OFFSET)
FEATURE = tl.constexpr(descriptors.FEATURE)
DESCRIPTOR_COLUMNS = tl.constexpr(descriptors.DESCRIPTOR_COLUMNS)


def pooling_code(pooling: str) -> int:
    """``"sum"`` -> 0, ``"mean"`` -> 1, ``"none"`` -> 2 (the kernels' ``POOLING`` constexpr)."""
    try:
        return POOLING_CODES[pooling]
    except KeyError:
        raise ValueError(f"pooling must be one of {sorted(POOLING_CODES)}, got {pooling!r}") from None


def bag_length_class(num_lookups: int, num_bags: int) -> int:
    """``floor(log2(mean bag length))``, 0..7: the autotuners' key for the shape of a batch (a
    class, so that batches of one model shape share one tuned, compiled kernel)."""
    mean = num_lookups / max(num_bags, 1)
    return 0 if mean < 2 else min(7, int(mean).bit_length() - 1)


def row_slice_alignment_bytes(tensor, stores) -> int:
    """Bytes that every row slice of a table in an fp32 ``[rows, columns]`` tensor laid out like the
    pooled output (grad_output, the output itself) starts at a multiple of, at most 16: the alignment
    hint of pointers formed from an address the kernel loads (``stores``: a ``RowStores``)."""
    elements = tensor.data_ptr() // 4 if tensor.data_ptr() % 4 == 0 else 1
    return 4 * math.gcd(elements, tensor.stride(0) if tensor.dim() == 2 else 1, *stores.dims, 4)


@triton.jit
def descriptor_field(
    descriptor_ptr,  # int64 [F, DESCRIPTOR_COLUMNS]: the features' descriptor (base/descriptors.py)
    features,  # int32 scalar or tensor: the descriptor row (feature) of each element
    valid,  # bool, the shape of features: which rows to read (0 elsewhere); None: all of them
    COLUMN: tl.constexpr,  # the column: an int64 one (WEIGHTS_ADDRESS, ROW_OFFSET, ...)
):
    """int64 of ``features``' shape: column ``COLUMN`` of each feature's descriptor row."""
    pointers = descriptor_ptr + (features * DESCRIPTOR_COLUMNS + COLUMN)
    if valid is None:
        return tl.load(pointers)
    else:
        return tl.load(pointers, mask=valid, other=0)


@triton.jit
def descriptor_field_int32(
    descriptor_ptr,  # int64 [F, DESCRIPTOR_COLUMNS]: the features' descriptor (base/descriptors.py)
    features,  # int32 scalar or tensor: the descriptor row (feature) of each element
    valid,  # bool, the shape of features: which rows to read (0 elsewhere); None: all of them
    COLUMN: tl.constexpr,  # an int32 column (DIM, OUTPUT_OFFSET, FEATURE)
    MULTIPLE_OF: tl.constexpr,  # every value of the column is a multiple of this (the alignment hint)
):
    """int32 of ``features``' shape: column ``COLUMN`` of each feature's descriptor row, loaded as the
    low 32-bit word of its int64 value (little-endian), so the load stays 32 bits wide.

    The hint is given here, where the value is loaded: Triton 3.6 drops a ``tl.multiple_of``
    applied to the value a ``@triton.jit`` function returns, and a dim not known to be a multiple
    of the vector width costs the row loads their 16-byte vectors (their masks may change
    inside a vector)."""
    pointers = descriptor_ptr.to(tl.pointer_type(tl.int32)) + (features * DESCRIPTOR_COLUMNS + COLUMN) * 2
    if valid is None:
        values = tl.load(pointers)
    else:
        values = tl.load(pointers, mask=valid, other=0)
    if len(values.shape) == 2:  # tl.multiple_of takes one value per dimension
        return tl.multiple_of(values, [MULTIPLE_OF, MULTIPLE_OF])
    else:
        return tl.multiple_of(values, MULTIPLE_OF)


@triton.jit
def program_feature(
    descriptor_ptr,  # int64 [G, DESCRIPTOR_COLUMNS]: the launch's descriptor rows
    row,  # int32 scalar: the program's row of it (tl.program_id(1))
    GROUPED: tl.constexpr,  # the rows are a column group's copy (kernels/rows.py ColumnGroup), not every feature's
):
    """The feature whose bags the program pools: ``row`` itself when the launch covers every
    feature, else the row's ``FEATURE`` column: one load before the feature's offsets, of a line
    that every program of the row reads (from L2)."""
    if GROUPED:
        return descriptor_field_int32(descriptor_ptr, row, None, FEATURE, 1)
    else:
        return row


@triton.jit
def recomputed_features(
    features,  # int32 tensor: descriptor rows a kernel read already
):
    """``features`` again, through a move the compiler cannot see through, so that the descriptor
    loads made with the result compute their addresses afresh instead of reusing the 64-bit
    address of the rows read before (which the compiler would keep live meanwhile).

    The backward reads each run's dim and output column before its gradient loop and the run's
    row addresses after it. With one descriptor, the compiler kept the row's address live across
    the loop: row-wise Adagrad's row-update kernel took 44 registers against 40 with one tensor
    per field (fewer warps a multiprocessor; sm_90, Triton 3.6 and 3.9). Through this move it
    takes 40 again, and its loads and instruction count are unchanged or fewer."""
    if INTERPRETING_CONSTEXPR:
        return features
    else:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [features], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def table_row_zero(
    descriptor_ptr,  # int64 [F, DESCRIPTOR_COLUMNS]: the features' descriptor (base/descriptors.py)
    features,  # int32 scalar or tensor: the descriptor row (feature) of each element
    valid,  # bool, the shape of features, or None (as descriptor_field's)
    COLUMN: tl.constexpr,  # WEIGHTS_ADDRESS or STATE_ADDRESS
    ELEMENT: tl.constexpr,  # element type of the rows (tl.float32, tl.float16, tl.bfloat16)
):
    """Typed pointers to row 0 of the tables of ``features`` (weights or state)."""
    return descriptor_field(descriptor_ptr, features, valid, COLUMN).to(tl.pointer_type(ELEMENT))


@triton.jit
def row_pointers(
    table_rows,  # pointer tensor: row 0 of each lookup's table in its backing store
    rows,  # int tensor, same shape: row within the table
    row_stride,  # int64 (scalar or same shape): elements between rows of the table
    slots,  # int32, same shape: slot holding the row, or -1 (ignored unless USE_CACHE)
    cache_ptr,  # [num_slots, width] slot rows, same element type as the table rows
    cache_stride,  # elements between consecutive slots
    USE_CACHE: tl.constexpr,  # False: every row comes from its backing store
    ALIGN_BYTES: tl.constexpr,  # every row start is a multiple of this many bytes
):
    """Pointer to column 0 of the newest copy of each row (1-D or 2-D): its slot, else its backing row.

    The alignment hint lets the loads of a row be 16-byte vectors (Triton knows nothing of
    pointers formed from loaded addresses). It must be given here: Triton 3.6 drops a
    ``tl.multiple_of`` applied to the value a ``@triton.jit`` function returns.
    """
    pointers = table_rows + rows.to(tl.int64) * row_stride
    if USE_CACHE:
        pointers = tl.where(slots >= 0, cache_ptr + slots.to(tl.int64) * cache_stride, pointers)
    if len(pointers.shape) == 2:  # tl.multiple_of takes one value per dimension
        pointers = tl.multiple_of(pointers, [ALIGN_BYTES, ALIGN_BYTES])
    else:
        pointers = tl.multiple_of(pointers, ALIGN_BYTES)
    return pointers


@triton.jit
def lookup_rows(
    positions,  # int64 [F] or [BAGS, LANES]: lookup positions of the tile
    in_bag,  # bool, same shape: which positions are real lookups
    in_row,  # bool [BLOCK_D]: the table's columns
    columns,  # int32 [BLOCK_D]
    indices_ptr,  # int32/int64 [N]: row within its feature's table of each lookup
    slot_of_index_ptr,  # int32 [N]: slot holding each lookup's row, or -1 (read only if USE_CACHE)
    table_rows,  # pointer: row 0 of the table in its backing store
    row_stride,  # int64: elements between rows of the table
    cache_ptr,  # [num_slots, width] slot rows, same element type as the table rows
    cache_stride,  # elements between consecutive slots
    USE_CACHE: tl.constexpr,  # False: every row comes from its backing store
    ALIGN_BYTES: tl.constexpr,  # every row start is a multiple of this many bytes
):
    """fp32 [*positions.shape, BLOCK_D]: the newest copy of each lookup's row (zeros outside the
    tile and the table).

    A 2-D tile of positions (a row of lanes per bag) lets a bag's lanes be summed in registers
    (``tl.sum(axis=1)``); flattened to [BAGS * LANES, BLOCK_D] and reshaped to sum, the same tile
    went through shared memory and ran 2-5x slower on an H200."""
    rows = tl.load(indices_ptr + positions, mask=in_bag, other=0)
    slots = tl.zeros_like(rows)
    if USE_CACHE:
        slots = tl.load(slot_of_index_ptr + positions, mask=in_bag, other=-1)
    pointers = row_pointers(table_rows, rows, row_stride, slots, cache_ptr, cache_stride, USE_CACHE, ALIGN_BYTES)
    return tl.load(tl.expand_dims(pointers, -1) + columns, mask=tl.expand_dims(in_bag, -1) & in_row,
                   other=0.0).to(tl.float32)


@triton.jit
def bag_tile_bounds(
    offsets_ptr,  # int32/int64 [F*B+1]: bag boundaries
    feature,  # scalar: the program's feature
    first_bag,  # scalar: the tile's first bag within the feature
    batch_size,  # B
    BLOCK_B: tl.constexpr,  # bags per program
    BLOCK_L: tl.constexpr,  # lanes per bag: the tile's rows are (bag, lane) pairs, bag-major
):
    """``(bags, in_batch, starts, ends)`` of the tile's ``BLOCK_B * BLOCK_L`` rows: int32 bag
    number within the feature of each row, whether that bag exists, int64 first lookup and one
    past the last lookup of the bag (``BLOCK_L=1``: one row per bag, the bags of a
    [bags, lanes, columns] tile).
    """
    bags = first_bag + tl.arange(0, BLOCK_B * BLOCK_L) // BLOCK_L
    in_batch = bags < batch_size
    bag_ids = feature.to(tl.int64) * batch_size + bags
    starts = tl.load(offsets_ptr + bag_ids, mask=in_batch, other=0).to(tl.int64)
    ends = tl.load(offsets_ptr + bag_ids + 1, mask=in_batch, other=0).to(tl.int64)
    return bags, in_batch, starts, ends
