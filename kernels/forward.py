"""Pooled forward of table-batched embedding bags, reading each row from its slot or its backing store.

One launch per column group (``kernels/rows.py`` ``ColumnGroup``: the features whose dims round up
to one power of two; one launch for every feature when they all do): program ``(i, g)`` pools bags
``i * BLOCK_B .. + BLOCK_B - 1`` of the group's feature ``g``, ``BLOCK_L`` lookups of each bag per
step, so a tile holds ``BLOCK_B x BLOCK_L`` rows of the group's ``BLOCK_D`` columns loaded at once
(``kernels/addressing.py``). One lookup per bag (the common DLRM shape) runs 32-64 bags a program;
long bags few bags and long steps; narrow columns more bags. The autotuner picks the tile per
bag-length class and column tile, so one compiled kernel a group serves a model shape. Every bag is
summed by one program in an order fixed by its tile: each call gives the same bits.

Example (CPU simulation, one table of 10 rows of 4 columns, one bag of rows 1 and 2)::

    import tiered_tbe  # picks GPU or simulation mode before triton loads
    import torch
    from tiered_tbe.kernels.rows import Lookups, RowStores, no_cache
    from tiered_tbe.kernels.forward import pooled_forward

    table = torch.randn(10, 4)
    stores = RowStores((table,), (None,), *no_cache(torch.float32, "cpu"))
    lookups = Lookups(torch.tensor([1, 2]), torch.tensor([0, 2]), batch_size=1)
    out = pooled_forward(stores, lookups, None, "sum")   # == table[1] + table[2], shape [1, 4]
"""

from __future__ import annotations

import math
import os
import struct
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tiered_tbe.base.graphs import padded_size

from .addressing import (
    DIM,
    INTERPRETING,
    OUTPUT_OFFSET,
    POOLING_MEAN_CONSTEXPR,
    POOLING_NONE,
    POOLING_NONE_CONSTEXPR,
    WEIGHTS_ADDRESS,
    WEIGHTS_STRIDE,
    bag_length_class,
    bag_tile_bounds,
    descriptor_field,
    descriptor_field_int32,
    lookup_rows,
    pooling_code,
    program_feature,
    row_slice_alignment_bytes,
    table_row_zero,
)
from .grouping import pad_bags, pads_batches
from .in_place_copies import InPlaceCopies, keep_copies, uses_copies
from .rows import ColumnGroup, Lookups, RowStores, check_lookups

# Tiles of more than this many elements spill registers: the autotuner never tries them.
MAX_TILE_ELEMENTS = 8192

# (BLOCK_B, BLOCK_L, num_warps, GROUPS, STAGES) the autotuner tries, by bag-length class (log2 of
# the mean bag length): many bags of one lookup, or few bags walked many lookups at a time; GROUPS
# tiles of bags one after another in a program; STAGES steps of the bags' loop in flight at once.
_SHAPES_BY_CLASS = {
    0: [(16, 1, 4, 1, 1), (32, 1, 4, 1, 1), (32, 1, 8, 1, 1), (8, 1, 2, 1, 1), (16, 1, 4, 4, 1), (32, 1, 4, 2, 1),
        (8, 1, 2, 4, 1)],
    1: [(16, 1, 4, 1, 1), (8, 1, 2, 1, 1), (32, 1, 8, 1, 1), (8, 2, 4, 1, 1), (16, 1, 4, 4, 1), (8, 1, 2, 4, 1)],
    2: [(4, 4, 4, 1, 1), (4, 4, 2, 1, 1), (8, 4, 4, 1, 1), (16, 1, 4, 1, 1), (8, 1, 2, 1, 1), (4, 4, 2, 4, 1),
        (16, 1, 4, 4, 1)],
}
# Long bags: a few lookups of a few bags per step (at bags of 32 on an H200, Zipf 1.05: 0.120 ms
# against 0.150 for one lookup of many bags a step), one lookup of many bags per step with the loop
# pipelined (3-4 stages: 0.344 -> 0.274 ms at uniform lookups), or a whole bag per step for the
# longest bags (results/measurements.jsonl, 2026-12-02). One warp per bag, 16 of its lookups a step: 0.114 ms
# against 0.129 for (2, 8, 2) at bags of 32 fp32, Zipf 1.05.
_LONG_BAG_SHAPES = [(2, 8, 2, 1, 1), (4, 8, 4, 1, 1), (4, 4, 2, 1, 1), (8, 4, 4, 1, 1), (16, 1, 4, 1, 4),
                    (8, 1, 2, 1, 4), (1, 32, 4, 1, 1), (2, 16, 4, 1, 1), (1, 64, 8, 1, 1), (1, 16, 1, 1, 1)]
# The shapes above were tuned at 128 columns (Criteo, the big table). A group of narrower columns tries
# each with wider_bags(block_d) times the bags instead: the elements of a tile (bytes in flight a
# program) it has at 128 columns. Tuned as they are, at 8 columns a thread held 1-2 elements and no
# load was 16 bytes wide (Triton 3.6, sm_90); trying both would double a narrow group's candidates,
# each compiled at a model's first step (its autotuner's winner alone in a later process).
TUNED_COLUMNS = 128
MAX_WIDER_BAGS = 8


def wider_bags(block_d: int) -> int:
    """How many times a tuned shape's bags a group of ``block_d`` columns tries (1: as tuned)."""
    return max(1, min(MAX_WIDER_BAGS, TUNED_COLUMNS // block_d))


def _candidate_shapes(bag_class: int, block_d: int) -> list[tuple[int, int, int, int, int]]:
    """(BLOCK_B, BLOCK_L, num_warps, GROUPS, STAGES) the autotuner tries for a bag-length class and a
    column tile, before the tile budget: the class's tuned shapes, each with ``wider_bags(block_d)``
    times its bags."""
    widen = wider_bags(block_d)
    return [(bags * widen, lanes, warps, groups, stages)
            for bags, lanes, warps, groups, stages in _SHAPES_BY_CLASS.get(bag_class, _LONG_BAG_SHAPES)]


class ForwardTile(NamedTuple):
    """One tile shape of the forward kernel (``pooled_forward(..., tile=)`` bypasses the autotuner)."""

    bags: int  # BLOCK_B: bags per tile
    lanes: int  # BLOCK_L: lookups of each bag per step
    warps: int  # num_warps
    groups: int = 1  # GROUPS: tiles per program
    stages: int = 1  # STAGES: steps of the bags' loop in flight


_BAG_CLASSES = (*_SHAPES_BY_CLASS, max(_SHAPES_BY_CLASS) + 1)  # every class: the last stands for the long bags
_WIDER_BAGS = sorted({wider_bags(1 << bits) for bits in range(12)})  # every widening a column tile may take


def forward_tiles(block_d: int) -> list[ForwardTile]:
    """Every tile the autotuner may pick on a GPU for a column tile of ``block_d``, whatever the batch."""
    return sorted({ForwardTile(*shape) for bag_class in _BAG_CLASSES
                   for shape in _fitting(_candidate_shapes(bag_class, block_d), block_d)})


def _fitting(shapes, block_d: int):
    """The shapes whose tiles fit MAX_TILE_ELEMENTS at ``block_d`` columns (the smallest if none does)."""
    fitting = [shape for shape in shapes if shape[0] * shape[1] * block_d <= MAX_TILE_ELEMENTS]
    return fitting or [min(shapes, key=lambda shape: shape[0] * shape[1])]


# Every tile the autotuner may pick on a GPU, whatever the batch and the columns.
FORWARD_TILES = sorted({ForwardTile(bags * widen, *rest) for bag_class in _BAG_CLASSES
                        for bags, *rest in _SHAPES_BY_CLASS.get(bag_class, _LONG_BAG_SHAPES) for widen in _WIDER_BAGS})


def _forward_configs() -> list[triton.Config]:
    """Candidate tiles; a single one when interpreting (no timer there, and small tiles make the
    tests walk several steps of a bag, several tiles of a program and several programs of a table)."""
    if INTERPRETING:
        return [triton.Config({"BLOCK_B": 2, "BLOCK_L": 2, "GROUPS": 2, "STAGES": 1}, num_warps=4)]
    return [triton.Config({"BLOCK_B": tile.bags, "BLOCK_L": tile.lanes, "GROUPS": tile.groups, "STAGES": tile.stages},
                          num_warps=tile.warps) for tile in FORWARD_TILES]


def _config_shape(config: triton.Config) -> tuple[int, int, int, int, int]:
    return (config.kwargs["BLOCK_B"], config.kwargs["BLOCK_L"], config.num_warps, config.kwargs["GROUPS"],
            config.kwargs["STAGES"])


def _prune_configs(configs, named_args, **kwargs):
    """The shapes of the batch's bag-length class and the launch's column tile that fit
    MAX_TILE_ELEMENTS (the smallest if none)."""
    if len(configs) == 1:
        return configs
    block_d = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
    wanted = set(_fitting(_candidate_shapes(named_args["bag_length_class"], block_d), block_d))
    return [c for c in configs if _config_shape(c) in wanted]


@triton.autotune(
    configs=_forward_configs(),
    key=["bag_length_class", "BLOCK_D", "POOLING", "HAS_PER_SAMPLE_WEIGHTS", "USE_CACHE", "KEEPS_COPIES",
         "ALIGN_BYTES"],
    prune_configs_by={"early_config_prune": _prune_configs},
    # The winner is kept in Triton's cache folder: a later process of the same model shape loads the
    # winning tile only, instead of compiling and timing every candidate (seconds at start-up).
    cache_results=True,
)
@triton.jit(do_not_specialize=["batch_size"])
def _pooled_forward_kernel(
    addresses_ptr,  # int64 [6], read only if ADDRESSES: the addresses of this call's output, indices,
    #                 offsets, slot_of_index, per_sample_weights and in_place_rank (batch_addresses)
    output_ptr,  # fp32 [B, total_dim] (sum, mean) or [N, output_width] (none): out
    output_stride,  # elements between consecutive output rows
    output_width,  # pooling none: columns of an output row (zeros past the table's dim)
    descriptor_ptr,  # int64 [G, DESCRIPTOR_COLUMNS]: the launch's features' table rows, dim, output column (and
    #                  feature, when GROUPED)
    cache_weights_ptr,  # [num_slots, row_width] slot rows; its element type is every row's
    cache_weights_stride,  # elements between consecutive slots
    indices_ptr,  # int32/int64 [N]: row within its feature's table of each lookup
    offsets_ptr,  # int32/int64 [F*B+1]: bag f*B+b is lookups offsets[f*B+b] : offsets[f*B+b+1]
    slot_of_index_ptr,  # int32 [N]: slot holding each lookup's row, or -1 (read only if USE_CACHE)
    per_sample_weights_ptr,  # fp32 [N]: multiplies each row (read only if HAS_PER_SAMPLE_WEIGHTS)
    in_place_rank_ptr,  # int32 [N]: copy row of each lookup read in place, or -1 (read only if KEEPS_COPIES)
    copies_ptr,  # [num_copies, row_width] the rows read in place, kept for the backward (written if KEEPS_COPIES)
    copies_stride,  # elements between consecutive copy rows
    num_copies,  # copy rows: a lookup whose rank is past them keeps no copy
    batch_size,  # B: bags per table (not specialized: a last, smaller batch compiles nothing new)
    bag_length_class,  # log2 of the mean bag length, 0..7: the autotuner's key, unused in the body
    POOLING: tl.constexpr,  # POOLING_SUM, POOLING_MEAN or POOLING_NONE; constexpr so the branches fold
    HAS_PER_SAMPLE_WEIGHTS: tl.constexpr,  # whether rows are scaled by per-sample weights
    USE_CACHE: tl.constexpr,  # whether any slot exists (else every row comes from a backing store)
    KEEPS_COPIES: tl.constexpr,  # write each row read in place to its copy row (kernels/in_place_copies.py)
    ALIGN: tl.constexpr,  # every row start, row stride and dim is a multiple of this many elements
    ALIGN_BYTES: tl.constexpr,  # ALIGN in bytes
    BLOCK_B: tl.constexpr,  # bags per program
    BLOCK_L: tl.constexpr,  # lookups of each bag per step
    GROUPS: tl.constexpr,  # tiles of BLOCK_B bags per program
    STAGES: tl.constexpr,  # steps of a bag whose loads are in flight at once (Triton's loop pipeliner)
    BLOCK_D: tl.constexpr,  # columns per tile: next power of two of the largest embedding_dim of the launch's features
    GROUPED: tl.constexpr,  # descriptor_ptr holds a column group's rows: program (i, g) pools the feature of row g
    ADDRESSES: tl.constexpr,  # the five tensors are the ones at addresses_ptr's addresses (a CUDA graph
    #                           of the launch then reads and writes each call's own), typed as the arguments
    OUTPUT_ALIGN_BYTES: tl.constexpr,  # every output row slice of a table starts at a multiple of this
    INPUT_ALIGN_BYTES: tl.constexpr,  # with ADDRESSES: the indices', offsets', slots' and weights' alignment
):
    row = tl.program_id(1)  # of the launch's descriptor
    feature = program_feature(descriptor_ptr, row, GROUPED)  # whose bags the program pools
    if ADDRESSES:
        # Hinted where they are made: Triton knows nothing of a loaded address (kernels/addressing.py).
        output_ptr = tl.multiple_of(tl.load(addresses_ptr).to(output_ptr.dtype), OUTPUT_ALIGN_BYTES)
        indices_ptr = tl.multiple_of(tl.load(addresses_ptr + 1).to(indices_ptr.dtype), INPUT_ALIGN_BYTES)
        offsets_ptr = tl.multiple_of(tl.load(addresses_ptr + 2).to(offsets_ptr.dtype), INPUT_ALIGN_BYTES)
        slot_of_index_ptr = tl.multiple_of(tl.load(addresses_ptr + 3).to(slot_of_index_ptr.dtype), INPUT_ALIGN_BYTES)
        per_sample_weights_ptr = tl.multiple_of(tl.load(addresses_ptr + 4).to(per_sample_weights_ptr.dtype),
                                                INPUT_ALIGN_BYTES)
        in_place_rank_ptr = tl.multiple_of(tl.load(addresses_ptr + 5).to(in_place_rank_ptr.dtype), INPUT_ALIGN_BYTES)
    element = cache_weights_ptr.dtype.element_ty
    table_rows = table_row_zero(descriptor_ptr, row, None, WEIGHTS_ADDRESS, element)
    row_stride = descriptor_field(descriptor_ptr, row, None, WEIGHTS_STRIDE)
    # A multiple of the alignment (in elements), so masks stay constant across a vector.
    dim = descriptor_field_int32(descriptor_ptr, row, None, DIM, ALIGN)
    output_column = descriptor_field_int32(descriptor_ptr, row, None, OUTPUT_OFFSET, ALIGN)
    columns = tl.arange(0, BLOCK_D)
    in_row = columns < dim
    # GROUPS tiles a program, one after the other: fewer, longer programs (the H200 launches
    # short programs more slowly than it runs them).
    for group in range(GROUPS):
        first_bag = (tl.program_id(0) * GROUPS + group) * BLOCK_B
        accumulator = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
        if POOLING != POOLING_NONE_CONSTEXPR:
            # A [bags, lanes, columns] tile a step, summed over its lanes in registers.
            _, _, starts, ends = bag_tile_bounds(offsets_ptr, feature, first_bag, batch_size, BLOCK_B, 1)
            for step_start in tl.range(0, tl.max(ends - starts, axis=0), BLOCK_L, num_stages=STAGES):
                positions = starts[:, None] + step_start + tl.arange(0, BLOCK_L)[None, :]  # int64 [BLOCK_B, BLOCK_L]
                in_bag = positions < ends[:, None]
                tile = lookup_rows(positions, in_bag, in_row, columns, indices_ptr, slot_of_index_ptr, table_rows,
                                   row_stride, cache_weights_ptr, cache_weights_stride, USE_CACHE, ALIGN_BYTES)
                if KEEPS_COPIES:
                    keep_copies(tile, positions, in_bag, in_row, columns, in_place_rank_ptr, copies_ptr,
                                copies_stride, num_copies, ALIGN_BYTES)
                if HAS_PER_SAMPLE_WEIGHTS:
                    tile = tile * tl.load(per_sample_weights_ptr + positions, mask=in_bag, other=0.0)[:, :, None]
                accumulator += tl.sum(tile, axis=1)
        else:  # every lookup is its own output row
            # The tile's rows are (bag, lane) pairs: BLOCK_L lookups of each of BLOCK_B bags per step.
            _, _, starts, ends = bag_tile_bounds(offsets_ptr, feature, first_bag, batch_size, BLOCK_B, BLOCK_L)
            lanes = tl.arange(0, BLOCK_B * BLOCK_L) % BLOCK_L
            for step_start in tl.range(0, tl.max(ends - starts, axis=0), BLOCK_L, num_stages=STAGES):
                positions = starts + step_start + lanes  # int64 [BLOCK_B * BLOCK_L]
                in_bag = positions < ends
                tile = lookup_rows(positions, in_bag, in_row, columns, indices_ptr, slot_of_index_ptr, table_rows,
                                   row_stride, cache_weights_ptr, cache_weights_stride, USE_CACHE, ALIGN_BYTES)
                if KEEPS_COPIES:
                    keep_copies(tile, positions, in_bag, in_row, columns, in_place_rank_ptr, copies_ptr,
                                copies_stride, num_copies, ALIGN_BYTES)
                if HAS_PER_SAMPLE_WEIGHTS:
                    tile = tile * tl.load(per_sample_weights_ptr + positions, mask=in_bag, other=0.0)[:, None]
                # Columns past the table's dim are written as zeros, so no output element is left unset.
                # The hint where the pointers are made: Triton knows nothing of a loaded address.
                row_starts = tl.multiple_of(output_ptr + positions * output_stride, OUTPUT_ALIGN_BYTES)
                out_ptrs = row_starts[:, None] + columns[None, :]
                tl.store(out_ptrs, tile, mask=in_bag[:, None] & (columns < output_width)[None, :])

        if POOLING != POOLING_NONE_CONSTEXPR:
            bags = first_bag + tl.arange(0, BLOCK_B)
            if POOLING == POOLING_MEAN_CONSTEXPR:  # an empty bag stays all zeros
                bag_ids = feature.to(tl.int64) * batch_size + bags
                lengths = (tl.load(offsets_ptr + bag_ids + 1, mask=bags < batch_size, other=1)
                           - tl.load(offsets_ptr + bag_ids, mask=bags < batch_size, other=0))
                accumulator = accumulator / tl.maximum(lengths, 1).to(tl.float32)[:, None]
            row_starts = tl.multiple_of(output_ptr + bags.to(tl.int64) * output_stride + output_column,
                                        OUTPUT_ALIGN_BYTES)
            out_ptrs = row_starts[:, None] + columns[None, :]
            tl.store(out_ptrs, accumulator, mask=(bags < batch_size)[:, None] & in_row[None, :])


class _ForwardPlan(NamedTuple):
    """Everything a forward's launches bake in besides its tensors' addresses (hashable: part of a
    graph's key). The lookup count is not in it (only its bag-length class; pooling none: the
    padded size of its output), so a graph serves batches of bags of any lengths."""

    mode: int
    batch_size: int
    output_shape: tuple[int, int]  # of the output the kernels write (pooling none: padded_size(N) rows)
    grouped: bool  # one launch per column group (RowStores.column_groups), else one over every feature
    output_align_bytes: int
    input_align_bytes: int
    bag_length_class: int
    index_dtypes: tuple[torch.dtype, torch.dtype]
    use_cache: bool
    has_per_sample_weights: bool
    tile: ForwardTile | None
    keeps_copies: bool  # writes the rows read in place to copies (kernels/in_place_copies.py)


def pooled_forward(
    stores: RowStores, lookups: Lookups, slot_of_index: torch.Tensor | None, pooling: str,
    tile: ForwardTile | None = None, graphs=None, pad: bool | None = None, copies: InPlaceCopies | None = None,
) -> torch.Tensor:
    """Pool the rows of every bag of every table: one launch per column group of the stores
    (``RowStores.column_groups``; one for pooling none, and see :func:`launches_per_group`).

    Args:
        stores: the rows (every table's backing rows and the slot cache), see ``kernels/rows.py``.
        lookups: ``N`` lookups in ``F * B`` bags (feature-major offsets), int32 or int64.
        slot_of_index: int32 [N]: slot of ``stores.cache_weights`` holding each lookup's row, or -1
            to read the row from its table's backing store; ``None``: no lookup has a slot.
        pooling: ``"sum"``, ``"mean"`` (an empty bag gives zeros) or ``"none"``.
        tile: run this tile shape instead of the autotuner's (tests of every shape, tuning sweeps;
            ``TIERED_TBE_FORWARD_TILE=bags,lanes,warps[,groups,stages]`` sets it for every call).
        graphs: a :class:`~tiered_tbe.base.graphs.StepGraphs` of this ``stores``: the launch runs as
            a CUDA graph per batch shape, which reads the batch's tensors and writes its output at
            addresses passed in one small tensor (no device copy; a replay costs the host a few
            microseconds where Triton's launch path cost tens).
        pad: pooled: lay the batch out at ``padded_size(B)`` bags a feature (``grouping.pad_bags``: the
            padding's bags are empty and their output rows dropped; the output is bit for bit the
            unpadded one), so that batches whose batch size changes every step share a few graphs.
            Default: ``grouping.pads_batches`` (graphs on a GPU).
        copies: where to copy the rows read in place for the backward (``kernels/in_place_copies.py``):
            ``copies.rank`` int32 [N] (the prefetch's ``in_place_rank``), ``copies.rows`` [C, row_width]
            of the weights' dtype. The output is the same with or without.

    Returns:
        fp32 ``[B, stores.total_dim]`` for sum and mean: feature ``f``'s bag ``b`` in the dim of its
        table's columns from ``stores.output_offsets[f]`` (the dims of the features before it).
        For ``"none"``: fp32 ``[N, stores.max_dim]``, row ``i`` the (per-sample weighted) row of
        lookup ``i`` (zeros past a smaller table's dim): the first ``N`` rows of an output of
        ``padded_size(N)`` rows (``base/graphs.py``), so that batches whose lookup count changes
        every step share a few graphs.
    """
    mode = pooling_code(pooling)
    check_lookups(stores, lookups, slot_of_index)
    device = lookups.indices.device
    batch_size = lookups.batch_size
    # Of the batch's own bags: a padded batch picks the tile an unpadded one does (the same sums, bit for bit).
    bag_class = bag_length_class(lookups.num_lookups, stores.num_features * batch_size)
    if pad is None:
        pad = pads_batches(graphs, device, mode)
    if mode == POOLING_NONE:
        num_lookups = lookups.num_lookups
        padded = torch.empty(padded_size(num_lookups), stores.max_dim, dtype=torch.float32, device=device)
        output = leading_rows(padded, num_lookups)
    else:
        padded = torch.empty(padded_size(batch_size) if pad else batch_size, stores.total_dim,
                             dtype=torch.float32, device=device)
        output = leading_rows(padded, batch_size)
    if batch_size == 0 or output.numel() == 0:
        return output
    if mode != POOLING_NONE and padded.shape[0] != batch_size:  # the bags laid out at the output's rows
        lookups = pad_bags(lookups, stores.num_features, padded.shape[0])
        batch_size = lookups.batch_size
    override = os.environ.get("TIERED_TBE_FORWARD_TILE")  # a tuning run's tile for every forward
    if tile is None and override:
        tile = ForwardTile(*(int(value) for value in override.split(",")))
    use_cache = slot_of_index is not None and stores.uses_cache
    keeps_copies = uses_copies(copies, use_cache)
    if keeps_copies:
        _check_copies(stores, copies, lookups.num_lookups)
    tensors = (output, lookups.indices, lookups.offsets, slot_of_index if use_cache else None,
               lookups.per_sample_weights, copies.rank if keeps_copies else None)
    plan = _ForwardPlan(mode, batch_size, tuple(padded.shape), launches_per_group(stores, mode),
                        row_slice_alignment_bytes(output, stores),
                        min(_alignment_bytes(tensor) for tensor in tensors[1:] if tensor is not None),
                        bag_class,
                        (lookups.indices.dtype, lookups.offsets.dtype), use_cache, tensors[4] is not None, tile,
                        keeps_copies)
    copy_rows = copies.rows if keeps_copies else stores.cache_weights  # the kernel's argument, written if kept
    # Launched directly where no graph will be replayed (graphs off) or inside a caller's capture (a
    # capture bakes the addresses in; the address block's pinned copy would be replayed stale).
    if graphs is None or (device.type == "cuda" and (not graphs.enabled or torch.cuda.is_current_stream_capturing())):
        _enqueue_forward(plan, stores, None, *tensors, copy_rows)
    else:
        # The tensors go to the launch for their types only: the kernel reads them at the addresses. The
        # copy rows are the module's, one buffer for every batch: their address is part of the graph's key.
        graphs.run((plan, id(stores), copy_rows.data_ptr()), (batch_addresses(tensors),),
                   lambda addresses: _enqueue_forward(plan, stores, addresses[0], *tensors, copy_rows), device)
    return output


def _check_copies(stores: RowStores, copies: InPlaceCopies, num_lookups: int) -> None:
    rows, rank = copies.rows, copies.rank
    if rows.dim() != 2 or rows.dtype != stores.weights_dtype or rows.shape[1] != stores.cache_weights.shape[1] \
            or not rows.is_contiguous() or rows.device != stores.cache_weights.device:
        raise ValueError(f"copies.rows must be a contiguous [C, {stores.cache_weights.shape[1]}] "
                         f"{stores.weights_dtype} tensor beside the cache, got {tuple(rows.shape)} {rows.dtype}")
    if rank.dtype != torch.int32 or rank.shape != (num_lookups,):
        raise ValueError(f"copies.rank must be int32 [{num_lookups}], got {rank.dtype} {tuple(rank.shape)}")


def leading_rows(padded: torch.Tensor, rows: int) -> torch.Tensor:
    """``padded[:rows]`` (of a contiguous 2-D tensor) as a tensor of its own over the same memory, not a view:
    autograd refuses an in-place op on a view that a custom Function returns (the module's output, which a
    model may scale in place), and a copy would cost a pass over the output."""
    return padded.new_empty(0).set_(padded.untyped_storage(), padded.storage_offset(), (rows, padded.shape[1]),
                                    padded.stride())


def batch_addresses(tensors) -> torch.Tensor:
    """int64 [6] on the host: the address of each of ``(output, indices, offsets, slot_of_index,
    per_sample_weights, in_place_rank)`` (0 for a missing one), which a graphed forward reads its batch at."""
    return torch.frombuffer(bytearray(struct.pack("<6q", *(0 if t is None else t.data_ptr() for t in tensors))),
                            dtype=torch.int64)


def _alignment_bytes(tensor: torch.Tensor) -> int:
    """The largest power of two up to 16 that the tensor's address is a multiple of."""
    return math.gcd(tensor.data_ptr(), 16)


def launches_per_group(stores: RowStores, mode: int) -> bool:
    """Whether the forward-type kernels launch once per column group of ``stores`` for pooling
    ``mode``: where the stores have several, unless pooling none (rows written whole, zeros past a
    table's dim up to the widest) or ``TIERED_TBE_FORWARD_ONE_LAUNCH=1`` (one launch over every
    feature at the widest dim's column tile, as before the groups: measurements side by side)."""
    return (mode != POOLING_NONE and len(stores.column_groups) > 1
            and os.environ.get("TIERED_TBE_FORWARD_ONE_LAUNCH", "0") != "1")


def launch_groups(stores: RowStores, grouped: bool) -> tuple[ColumnGroup, ...]:
    """The column groups a forward-type kernel launches over: the stores' (``grouped``), or one of
    every feature with the widest dim's column tile and the whole descriptor."""
    if grouped:
        return stores.column_groups
    return (ColumnGroup(stores.block_d, tuple(range(stores.num_features)), stores.descriptor),)


def _grid(batch_size: int, num_features: int):
    """The grid of a launch over ``num_features`` features: tiles of bags, features."""
    return lambda meta: (triton.cdiv(batch_size, meta["BLOCK_B"] * meta["GROUPS"]), num_features)


def _enqueue_forward(plan: _ForwardPlan, stores: RowStores, addresses, output, indices, offsets, slot_of_index,
                     per_sample_weights, in_place_rank, copy_rows) -> None:
    """Launch the forward kernel (once per column group) on the tensors, or (``addresses``: an int64
    [6] device tensor of :func:`batch_addresses`) on the ones at those addresses, typed as these."""
    tile = plan.tile
    kernel, shape = _pooled_forward_kernel, {}
    if tile is not None:
        kernel = _pooled_forward_kernel.fn
        shape = dict(BLOCK_B=tile.bags, BLOCK_L=tile.lanes, GROUPS=tile.groups, STAGES=tile.stages,
                     num_warps=tile.warps)
    output_stride, output_width = plan.output_shape[1], plan.output_shape[1]  # a contiguous output
    for group in launch_groups(stores, plan.grouped):
        kernel[_grid(plan.batch_size, len(group.features))](
            addresses if addresses is not None else offsets, output, output_stride, output_width,
            group.descriptor, stores.cache_weights, stores.cache_weights.stride(0),
            indices, offsets, slot_of_index if plan.use_cache else indices,
            per_sample_weights if plan.has_per_sample_weights else output,
            in_place_rank if plan.keeps_copies else indices, copy_rows, copy_rows.stride(0), copy_rows.shape[0],
            plan.batch_size, plan.bag_length_class,
            POOLING=plan.mode,
            HAS_PER_SAMPLE_WEIGHTS=plan.has_per_sample_weights,
            USE_CACHE=plan.use_cache,
            KEEPS_COPIES=plan.keeps_copies,
            ALIGN=stores.alignment,
            ALIGN_BYTES=stores.alignment * stores.weights_dtype.itemsize,
            BLOCK_D=group.block_d,
            GROUPED=plan.grouped,
            ADDRESSES=addresses is not None,
            OUTPUT_ALIGN_BYTES=plan.output_align_bytes,
            INPUT_ALIGN_BYTES=plan.input_align_bytes,
            **shape,
        )
