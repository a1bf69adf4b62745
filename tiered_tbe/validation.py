"""Checks of one batch in FBGEMM's TBE layout, run before anything is modified.

Cost: the checks are a handful of elementwise GPU reductions over the batch, folded into one
boolean; reading that boolean is the only host sync (one per forward with
``bounds_check="raise"``, none with ``"off"``). Only when it says something is wrong are the
offending positions found and named, on the host.
"""

from __future__ import annotations

import torch

from tiered_tbe.specs import TableSpec

_INDEX_DTYPES = (torch.int32, torch.int64)


def _name(tables: list[TableSpec], t: int) -> str:
    return f"table {t} ({tables[t].name!r})" if tables[t].name else f"table {t}"


def check_static(tables: list[TableSpec], indices, offsets, device: torch.device) -> int:
    """Shapes, dtypes and devices (no sync). Returns the batch size ``B``.

    Raises:
        ValueError: naming the argument and the value that is wrong.
    """
    num_tables = len(tables)
    for arg_name, tensor in (("indices", indices), ("offsets", offsets)):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{arg_name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 1:
            raise ValueError(f"{arg_name} must be 1-D, got shape {tuple(tensor.shape)}")
        if tensor.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{arg_name} must be int32 or int64, got {tensor.dtype}")
        if tensor.device.type != device.type:
            raise ValueError(f"{arg_name} is on {tensor.device}, the module's tables are on {device}")
    if (offsets.numel() - 1) % num_tables != 0 or offsets.numel() < 1:
        raise ValueError(
            f"offsets has {offsets.numel()} entries; FBGEMM's TBE layout needs T*B+1 with T={num_tables} "
            f"tables (table-major), e.g. {num_tables * 4 + 1} for B=4"
        )
    return (offsets.numel() - 1) // num_tables


def check_per_sample_weights(per_sample_weights, num_lookups: int, device: torch.device) -> None:
    """One floating-point weight per lookup, on the module's device."""
    if not isinstance(per_sample_weights, torch.Tensor) or not per_sample_weights.is_floating_point():
        raise ValueError("per_sample_weights must be a floating-point tensor")
    if tuple(per_sample_weights.shape) != (num_lookups,):
        raise ValueError(
            f"per_sample_weights has shape {tuple(per_sample_weights.shape)}, expected ({num_lookups},): "
            "one weight per lookup"
        )
    if per_sample_weights.device.type != device.type:
        raise ValueError(f"per_sample_weights is on {per_sample_weights.device}, the tables are on {device}")


def check_values(
    tables: list[TableSpec],
    indices: torch.Tensor,
    offsets: torch.Tensor,
    bag_of_index: torch.Tensor,
    num_rows_of_table: torch.Tensor,
    batch_size: int,
) -> None:
    """Offsets well formed and every index in range of its table (one host sync).

    Args:
        indices: int64 [N]; offsets: int64 [T*B+1]; bag_of_index: int64 [N] (t*B + b);
        num_rows_of_table: int64 [T] on the same device.

    Raises:
        ValueError: naming the table, the position and the value.
    """
    num_lookups = indices.numel()
    # Clamped: with malformed offsets a lookup's bag can fall outside the batch.
    table_of_index = (bag_of_index // max(batch_size, 1)).clamp_(0, len(tables) - 1)
    index_bad = (indices < 0) | (indices >= num_rows_of_table[table_of_index])
    offsets_bad = (offsets[1:] < offsets[:-1]).any() | (offsets[0] != 0) | (offsets[-1] != num_lookups)
    if not bool(index_bad.any() | offsets_bad):  # the one sync
        return
    offsets_cpu = offsets.cpu()
    if offsets_cpu[0] != 0:
        raise ValueError(f"offsets[0] must be 0, got {int(offsets_cpu[0])}")
    if offsets_cpu[-1] != num_lookups:
        raise ValueError(f"offsets[-1] must equal len(indices) = {num_lookups}, got {int(offsets_cpu[-1])}")
    decreasing = torch.nonzero(offsets_cpu[1:] < offsets_cpu[:-1])
    if decreasing.numel():
        i = int(decreasing[0])
        bag = i
        t = bag // max(batch_size, 1)
        raise ValueError(
            f"offsets must be non-decreasing: offsets[{i + 1}] = {int(offsets_cpu[i + 1])} < "
            f"offsets[{i}] = {int(offsets_cpu[i])} ({_name(tables, t)}, bag {bag % max(batch_size, 1)})"
        )
    position = int(torch.nonzero(index_bad.cpu())[0])
    t = int(table_of_index[position])
    value = int(indices[position])
    raise ValueError(
        f"{_name(tables, t)}: index {value} at position {position} is out of range "
        f"[0, {tables[t].num_embeddings})"
    )
