"""Pooled forward of table-batched embedding bags, reading each row from its slot or its backing store.

One launch covers every table: program ``t * B + b`` pools bag ``b`` of table ``t``. A program
walks its bag's lookups in tiles of ``BLOCK_L`` lookups by ``BLOCK_D`` columns (``BLOCK_D`` is
the next power of two of the largest ``embedding_dim``), loading a whole tile with one
vectorized load: the rows of a tile may come from the slot cache or from the table's backing
store, so the tile's row addresses are picked per lookup before the load. A table lives in one
tier, so which backing store to read is a scalar choice per program.

Example (CPU simulation, one DEVICE table of 10 rows of 4 columns, one bag of rows 1 and 2)::

    import tiered_tbe  # picks GPU or simulation mode before triton loads
    import torch
    from tiered_tbe.kernels.rows import Lookups, RowStores, TIER_DEVICE
    from tiered_tbe.kernels.forward import pooled_forward

    weights = torch.randn(10 * 4)
    empty = torch.empty(0)
    stores = RowStores(weights, empty, empty, empty, empty, empty,
                       table_tier=torch.tensor([TIER_DEVICE], dtype=torch.int32),
                       table_weight_offset=torch.zeros(1, dtype=torch.int64),
                       table_state_offset=torch.zeros(1, dtype=torch.int64),
                       table_dim=torch.tensor([4], dtype=torch.int32),
                       table_output_offset=torch.zeros(1, dtype=torch.int32),
                       cache_weights=torch.empty(0, 1), cache_state=torch.empty(0, 1),
                       max_dim=4, total_dim=4)
    indices = torch.tensor([1, 2])
    lookups = Lookups(indices, offsets=torch.tensor([0, 2]), bag_of_index=torch.zeros(2, dtype=torch.int64),
                      global_rows=indices, per_sample_weights=None, batch_size=1)
    out = pooled_forward(stores, lookups, torch.full((2,), -1, dtype=torch.int32), "sum")
    # out == weights.view(10, 4)[1] + weights.view(10, 4)[2], shape [1, 4]
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .rows import TIER_HOST, TIER_MANAGED, Lookups, RowStores

# Codes of the POOLING constexpr.
POOLING_SUM = 0
POOLING_MEAN = 1
POOLING_NONE = 2
POOLING_CODES = {"sum": POOLING_SUM, "mean": POOLING_MEAN, "none": POOLING_NONE}

# Triton kernels may read module globals only when they are constexpr.
_POOLING_MEAN = tl.constexpr(POOLING_MEAN)
_POOLING_NONE = tl.constexpr(POOLING_NONE)
_TIER_HOST = tl.constexpr(TIER_HOST)
_TIER_MANAGED = tl.constexpr(TIER_MANAGED)

# Triton reads TRITON_INTERPRET when a kernel is decorated; `tiered_tbe` sets it before we get here.
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Tiles larger than this many elements spill registers (a [BLOCK_L, BLOCK_D] fp32 tile plus the
# accumulator of the same shape): the autotuner never tries them.
MAX_TILE_ELEMENTS = 8192


def pooling_code(pooling: str) -> int:
    """``"sum"`` -> 0, ``"mean"`` -> 1, ``"none"`` -> 2 (the kernels' ``POOLING`` constexpr)."""
    try:
        return POOLING_CODES[pooling]
    except KeyError:
        raise ValueError(f"pooling must be one of {sorted(POOLING_CODES)}, got {pooling!r}") from None


def tile_rows_for(block_d: int, *, interpreting: bool = INTERPRETING) -> int:
    """Lookups per tile for kernels that are not autotuned: a 4096-element tile, at least one row.

    In the interpreter a small tile makes the tests walk several tiles of one bag.
    """
    if interpreting:
        return 4
    return max(1, min(32, 4096 // block_d))


def _forward_configs() -> list[triton.Config]:
    """Candidate tile heights and warp counts; a single one when interpreting (no timer there)."""
    if INTERPRETING:
        return [triton.Config({"BLOCK_L": 4}, num_warps=4)]
    # Short tiles win on the H200 for dim 128 (2 rows, 2 warps: many programs in flight beat wide
    # loads per program); the taller ones serve small dims.
    shapes = [(1, 2), (2, 1), (2, 2), (2, 4), (4, 2), (4, 4), (8, 4), (16, 4), (32, 8)]
    return [triton.Config({"BLOCK_L": block_l}, num_warps=num_warps) for block_l, num_warps in shapes]


def _prune_large_tiles(configs, named_args, **kwargs):
    """Drop tiles of more than MAX_TILE_ELEMENTS elements; keep the shortest ones if none fit."""
    block_d = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
    fitting = [c for c in configs if c.kwargs["BLOCK_L"] * block_d <= MAX_TILE_ELEMENTS]
    if fitting:
        return fitting
    shortest = min(c.kwargs["BLOCK_L"] for c in configs)
    return [c for c in configs if c.kwargs["BLOCK_L"] == shortest]


@triton.jit
def _weights_of_tier(
    tier,  # int32 scalar: TIER_DEVICE, TIER_HOST or TIER_MANAGED
    device_ptr,  # flat store of DEVICE tables
    host_ptr,  # flat store of HOST tables (pinned host memory, read over the bus)
    managed_ptr,  # flat store of MANAGED tables
):
    """The backing store of a tier (one scalar choice per program: a table lives in one tier)."""
    store_ptr = device_ptr
    if tier == _TIER_HOST:
        store_ptr = host_ptr
    if tier == _TIER_MANAGED:
        store_ptr = managed_ptr
    return store_ptr


@triton.jit
def _row_pointers(
    positions,  # int64 [BLOCK_L]: lookup positions of the tile
    in_tile,  # bool [BLOCK_L]: which positions are real lookups
    indices_ptr,  # int64 [N]: row within its table of each lookup
    slot_of_index_ptr,  # int32 [N]: slot holding the row, or -1
    table_store_ptr,  # pointer to row 0 of the table in its backing store
    dim,  # int32 scalar: embedding_dim of the table
    cache_weights_ptr,  # [num_slots, cache_row_width] slot-cache rows
    cache_weights_stride,  # elements between consecutive slots
    USE_CACHE: tl.constexpr,  # False when there is no slot cache: skip the slot loads
):
    """Pointer to column 0 of the newest copy of each lookup's row: its slot, else its backing row."""
    rows = tl.load(indices_ptr + positions, mask=in_tile, other=0)
    # int64: row * dim passes 2^31 elements in large tables.
    row_ptrs = table_store_ptr + rows.to(tl.int64) * dim
    if USE_CACHE:
        slots = tl.load(slot_of_index_ptr + positions, mask=in_tile, other=-1)
        slot_ptrs = cache_weights_ptr + slots.to(tl.int64) * cache_weights_stride
        row_ptrs = tl.where(slots >= 0, slot_ptrs, row_ptrs)
    return row_ptrs


@triton.autotune(
    configs=_forward_configs(),
    key=["BLOCK_D", "POOLING", "HAS_PER_SAMPLE_WEIGHTS", "USE_CACHE"],
    prune_configs_by={"early_config_prune": _prune_large_tiles},
)
@triton.jit
def _pooled_forward_kernel(
    output_ptr,  # fp32 [B, total_dim] (sum, mean) or [N, output_width] (none)
    output_stride,  # elements between consecutive output rows
    output_width,  # columns of an output row written for pooling none (zeros past the table's dim)
    device_weights_ptr,  # flat weights of DEVICE tables
    host_weights_ptr,  # flat weights of HOST tables
    managed_weights_ptr,  # flat weights of MANAGED tables
    cache_weights_ptr,  # [num_slots, cache_row_width] slot-cache rows, same dtype as the stores
    cache_weights_stride,  # elements between consecutive slots
    table_tier_ptr,  # int32 [T]: tier code of each table
    table_weight_offset_ptr,  # int64 [T]: element offset of row 0 of each table in its tier's store
    table_dim_ptr,  # int32 [T]: embedding_dim of each table
    table_output_offset_ptr,  # int32 [T]: first output column of each table
    indices_ptr,  # int64 [N]: row within its table of each lookup
    offsets_ptr,  # int64 [T*B+1]: bag t*B+b is lookups offsets[t*B+b] : offsets[t*B+b+1]
    slot_of_index_ptr,  # int32 [N]: slot holding each lookup's row, or -1
    per_sample_weights_ptr,  # fp32 [N]: multiplies each row (read only if HAS_PER_SAMPLE_WEIGHTS)
    batch_size,  # B: bags per table
    POOLING: tl.constexpr,  # POOLING_SUM, POOLING_MEAN or POOLING_NONE; constexpr so the branches fold
    HAS_PER_SAMPLE_WEIGHTS: tl.constexpr,  # whether rows are scaled by per-sample weights
    USE_CACHE: tl.constexpr,  # whether any slot exists (else every row comes from a backing store)
    BLOCK_L: tl.constexpr,  # lookups loaded per tile
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
    # A 2-D accumulator: adding whole tiles keeps the cross-lookup reduction out of the loop.
    accumulator = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    for tile_start in range(start, end, BLOCK_L):
        positions = tile_start + tl.arange(0, BLOCK_L)
        in_tile = positions < end
        row_ptrs = _row_pointers(positions, in_tile, indices_ptr, slot_of_index_ptr, table_store_ptr, dim,
                                 cache_weights_ptr, cache_weights_stride, USE_CACHE)
        tile = tl.load(row_ptrs[:, None] + columns[None, :], mask=in_tile[:, None] & in_row[None, :],
                       other=0.0).to(tl.float32)
        if HAS_PER_SAMPLE_WEIGHTS:
            weights = tl.load(per_sample_weights_ptr + positions, mask=in_tile, other=0.0)
            tile = tile * weights[:, None]
        if POOLING == _POOLING_NONE:  # every lookup is its own output row
            # Columns past the table's dim are written as zeros, so no output element is left unset.
            out_ptrs = output_ptr + positions[:, None] * output_stride + columns[None, :]
            tl.store(out_ptrs, tile, mask=in_tile[:, None] & (columns[None, :] < output_width))
        else:
            accumulator += tile

    if POOLING != _POOLING_NONE:
        pooled = tl.sum(accumulator, axis=0)
        if POOLING == _POOLING_MEAN:  # an empty bag stays all zeros
            pooled = pooled / tl.maximum(end - start, 1).to(tl.float32)
        out_ptrs = (output_ptr + sample.to(tl.int64) * output_stride
                    + tl.load(table_output_offset_ptr + table) + columns)
        tl.store(out_ptrs, pooled, mask=in_row)


def launch_stores(stores: RowStores) -> dict[str, torch.Tensor]:
    """Weights and state tensors of ``stores``, ready to pass to a kernel.

    Triton types a pointer by its tensor's dtype, and the kernels pick one of the three backing
    stores with a scalar ``if``: all four weight tensors must share one dtype. Empty stores (a tier
    no table uses) may be built with any dtype; they are replaced by empty tensors of the weights'
    dtype. Returns ``device_weights, host_weights, managed_weights, cache_weights`` (weights dtype)
    and ``device_state, host_state, managed_state, cache_state`` (fp32).
    """
    weight_names = ("device_weights", "host_weights", "managed_weights", "cache_weights")
    state_names = ("device_state", "host_state", "managed_state", "cache_state")
    dtypes = {getattr(stores, name).dtype for name in weight_names if getattr(stores, name).numel() > 0}
    if len(dtypes) > 1:
        raise TypeError(f"all weight stores must share one dtype, got {sorted(map(str, dtypes))}")
    weights_dtype = dtypes.pop() if dtypes else stores.device_weights.dtype
    if weights_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"weights must be float32, float16 or bfloat16, got {weights_dtype}")
    tensors = {}
    for name in weight_names + state_names:
        tensor = getattr(stores, name)
        dtype = weights_dtype if name in weight_names else torch.float32
        if tensor.numel() == 0:
            tensor = torch.empty((0,) * tensor.dim(), dtype=dtype, device=tensor.device)
        elif tensor.dtype != dtype:
            raise TypeError(f"RowStores.{name} must be {dtype}, got {tensor.dtype}")
        tensors[name] = tensor
    for name in ("cache_weights", "cache_state"):
        if tensors[name].dim() != 2 or (tensors[name].numel() > 0 and tensors[name].stride(1) != 1):
            raise ValueError(f"RowStores.{name} must be 2-D with contiguous rows")
    return tensors


def check_lookups(stores: RowStores, lookups: Lookups, slot_of_index: torch.Tensor) -> None:
    """Shape and dtype checks that need no device synchronization (values are the caller's job)."""
    num_lookups = lookups.num_lookups
    num_bags = stores.num_tables * lookups.batch_size
    if lookups.offsets.numel() != num_bags + 1:
        raise ValueError(f"offsets must have T*B+1 = {num_bags + 1} entries, got {lookups.offsets.numel()}")
    for name in ("indices", "offsets", "bag_of_index", "global_rows"):
        tensor = getattr(lookups, name)
        if tensor.dtype != torch.int64 or tensor.dim() != 1:
            raise TypeError(f"Lookups.{name} must be a 1-D int64 tensor, got {tensor.dtype} {tuple(tensor.shape)}")
    if lookups.per_sample_weights is not None and (
        lookups.per_sample_weights.dtype != torch.float32 or lookups.per_sample_weights.shape != (num_lookups,)
    ):
        raise TypeError(f"per_sample_weights must be fp32 [{num_lookups}]")
    if slot_of_index.dtype != torch.int32 or slot_of_index.shape != (num_lookups,):
        raise TypeError(f"slot_of_index must be int32 [{num_lookups}], got {slot_of_index.dtype} "
                        f"{tuple(slot_of_index.shape)}")


def pooled_forward(stores: RowStores, lookups: Lookups, slot_of_index: torch.Tensor, pooling: str) -> torch.Tensor:
    """Pool the rows of every bag of every table in one launch.

    Args:
        stores: the rows (backing stores and slot cache), see ``kernels/rows.py``.
        lookups: ``N`` lookups in ``T * B`` bags (table-major offsets).
        slot_of_index: int32 [N]: slot of ``stores.cache_weights`` holding each lookup's row, or -1 to
            read the row from its table's backing store.
        pooling: ``"sum"``, ``"mean"`` (an empty bag gives zeros) or ``"none"``.

    Returns:
        fp32 ``[B, stores.total_dim]`` for sum and mean: table ``t``'s bag ``b`` at columns
        ``table_output_offset[t] : + table_dim[t]``. For ``"none"``: fp32 ``[N, stores.max_dim]``,
        row ``i`` the (per-sample weighted) row of lookup ``i``; the caller makes every dim equal
        (columns past a smaller table's dim would be zeros).
    """
    mode = pooling_code(pooling)
    check_lookups(stores, lookups, slot_of_index)
    tensors = launch_stores(stores)
    device = lookups.indices.device
    batch_size = lookups.batch_size
    num_bags = stores.num_tables * batch_size
    if mode == POOLING_NONE:
        output = torch.empty(lookups.num_lookups, stores.max_dim, dtype=torch.float32, device=device)
    else:
        output = torch.empty(batch_size, stores.total_dim, dtype=torch.float32, device=device)
    if num_bags == 0 or output.numel() == 0:
        return output
    per_sample_weights = lookups.per_sample_weights
    _pooled_forward_kernel[(num_bags,)](
        output, output.stride(0), output.shape[1],
        tensors["device_weights"], tensors["host_weights"], tensors["managed_weights"],
        tensors["cache_weights"], tensors["cache_weights"].stride(0),
        stores.table_tier, stores.table_weight_offset, stores.table_dim, stores.table_output_offset,
        lookups.indices.contiguous(), lookups.offsets.contiguous(), slot_of_index.contiguous(),
        per_sample_weights.contiguous() if per_sample_weights is not None else output,
        batch_size,
        POOLING=mode,
        HAS_PER_SAMPLE_WEIGHTS=per_sample_weights is not None,
        USE_CACHE=tensors["cache_weights"].shape[0] > 0,
        BLOCK_D=triton.next_power_of_2(stores.max_dim),
    )
    return output
