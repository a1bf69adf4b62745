"""Checks of one batch in FBGEMM's TBE layout, run before anything is modified.

Cost: the checks are a handful of elementwise GPU reductions over the batch, folded into one
boolean; reading that boolean is the only host sync (one per forward with
``bounds_check="raise"``, none with ``"warn"``, which repairs a bad batch on the device instead
(:func:`repair_offsets`, :func:`repair_indices`), nor with ``"off"``). A batch prefetched ahead (``prefetch``, the
pipeline) queues the checks at its prefetch and reads the verdict at its forward, so the
prefetch itself never waits for the GPU. Only when the verdict is bad are the offending
positions found and named, on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiered_tbe.base.offsets import offsets_are_bad, offsets_problem
from tiered_tbe.specs import TableSpec

_INDEX_DTYPES = (torch.int32, torch.int64)


def _name(tables: list[TableSpec], t: int) -> str:
    return f"table {t} ({tables[t].name!r})" if tables[t].name else f"table {t}"


def _feature_name(tables: list[TableSpec], feature_table_map: list[int] | None, f: int) -> str:
    """``table t (...)`` when each feature is its table, else ``feature f (table t ...)``."""
    if feature_table_map is None:
        return _name(tables, f)
    return f"feature {f} ({_name(tables, feature_table_map[f])})"


def check_static(tables: list[TableSpec], indices, offsets, device: torch.device,
                 feature_table_map: list[int] | None = None) -> int:
    """Shapes, dtypes and devices (no sync). Returns the batch size ``B``. ``feature_table_map``:
    the table of each feature (None: one feature per table), so offsets has ``F * B + 1`` entries.

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
    if feature_table_map is not None:
        num_features = len(feature_table_map)
        if (offsets.numel() - 1) % num_features != 0 or offsets.numel() < 1:
            raise ValueError(
                f"offsets has {offsets.numel()} entries; FBGEMM's TBE layout needs F*B+1 with F={num_features} "
                f"features (feature-major, feature_table_map's order), e.g. {num_features * 4 + 1} for B=4"
            )
        return (offsets.numel() - 1) // num_features
    if (offsets.numel() - 1) % num_tables != 0 or offsets.numel() < 1:
        raise ValueError(
            f"offsets has {offsets.numel()} entries; FBGEMM's TBE layout needs T*B+1 with T={num_tables} "
            f"tables (table-major), e.g. {num_tables * 4 + 1} for B=4"
        )
    return (offsets.numel() - 1) // num_tables


def check_per_sample_weights(per_sample_weights, num_lookups: int, device: torch.device) -> None:
    """One float32 weight per lookup, on the module's device (as FBGEMM's TBE takes them: another
    dtype is refused rather than converted, which would cut the gradient off from the caller's tensor)."""
    if not isinstance(per_sample_weights, torch.Tensor) or not per_sample_weights.is_floating_point():
        raise ValueError("per_sample_weights must be a floating-point tensor")
    if per_sample_weights.dtype != torch.float32:
        raise ValueError(f"per_sample_weights must be float32, got {per_sample_weights.dtype} "
                         "(convert with .float())")
    if tuple(per_sample_weights.shape) != (num_lookups,):
        raise ValueError(
            f"per_sample_weights has shape {tuple(per_sample_weights.shape)}, expected ({num_lookups},): "
            "one weight per lookup"
        )
    if per_sample_weights.device.type != device.type:
        raise ValueError(f"per_sample_weights is on {per_sample_weights.device}, the tables are on {device}")


@dataclass
class ValueCheck:
    """The verdict of the value checks of one batch, still on the device.

    Computing it queues a few elementwise reductions and no sync; :meth:`raise_if_bad` reads
    the verdict (the one host sync) and, only when it is bad, finds and names the culprit.
    A prefetch computes it and the batch's forward reads it, by when the stream has caught up.
    """

    tables: list[TableSpec]
    indices: torch.Tensor  # int64 [N]
    offsets: torch.Tensor  # int64 [F*B+1]
    table_of_index: torch.Tensor  # int64 [N], the feature of each lookup, clamped into [0, F) (F = T by default)
    index_bad: torch.Tensor  # bool [N]: index out of its table's range
    bad: torch.Tensor  # bool scalar: any index or offset wrong
    batch_size: int
    feature_table_map: list[int] | None = None  # the table of each feature; None: feature t is table t

    def raise_if_bad(self) -> None:
        """Raises:
            ValueError: naming the table, the position and the value.
        """
        if not bool(self.bad):  # the one sync
            return
        problem = offsets_problem(self.offsets, self.indices.numel())
        if problem is not None:
            if problem.decreasing_at is None:
                raise ValueError(problem.message)
            f, b = divmod(problem.decreasing_at, max(self.batch_size, 1))  # the bag that ends before it starts
            raise ValueError(f"{problem.message} ({_feature_name(self.tables, self.feature_table_map, f)}, bag {b})")
        position = int(torch.nonzero(self.index_bad.cpu())[0])
        f = int(self.table_of_index[position])
        t = f if self.feature_table_map is None else self.feature_table_map[f]
        raise ValueError(
            f"{_feature_name(self.tables, self.feature_table_map, f)}: index {int(self.indices[position])} at "
            f"position {position} is out of range [0, {self.tables[t].num_embeddings})"
        )


def start_value_check(
    tables: list[TableSpec],
    indices: torch.Tensor,
    offsets: torch.Tensor,
    table_of_index: torch.Tensor,
    num_rows_of_table: torch.Tensor,
    batch_size: int,
    feature_table_map: list[int] | None = None,
) -> ValueCheck:
    """Queue the checks that offsets are well formed and every index is in range of its table.

    Args:
        indices: int64 [N]; offsets: int64 [F*B+1]; table_of_index: int64 [N], the feature of each
        lookup (its table when each feature is its table), clamped into ``[0, F)`` (with malformed
        offsets a lookup's bag can fall outside the batch); num_rows_of_table: int64 [F], the rows
        of each feature's table, on the same device; feature_table_map: the table of each feature
        (None: feature t is table t), for the error messages.
    """
    index_bad = indices_out_of_range(indices, table_of_index, num_rows_of_table)
    offsets_bad = offsets_are_bad(offsets, indices.numel())
    return ValueCheck(tables, indices, offsets, table_of_index, index_bad, index_bad.any() | offsets_bad, batch_size,
                      feature_table_map)


def repair_offsets(offsets: torch.Tensor, num_lookups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``bounds_check="warn"`` (FBGEMM's ``BoundsCheckMode.WARNING``), on the device, no host sync:
    ``offsets`` (int64 [F*B+1]) clamped into ``[0, N]``, starting at 0, ending at ``N`` and never
    decreasing, so that each lookup lies in a bag; and how many changed (int64 [1])."""
    repaired = offsets.clamp(0, num_lookups)
    repaired[0] = 0
    repaired[-1] = num_lookups
    repaired = torch.cummax(repaired, 0).values
    return repaired, (repaired != offsets).sum().reshape(1)


def repair_indices(indices: torch.Tensor, table_of_index: torch.Tensor, num_rows_of_table: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``bounds_check="warn"``, on the device: ``indices`` (int64 [N]) with each one outside its
    table (``table_of_index`` [N] into ``num_rows_of_table`` int64 [F]) set to row 0, as FBGEMM's
    check sets it; and how many changed (int64 [1])."""
    bad = indices_out_of_range(indices, table_of_index, num_rows_of_table)
    return torch.where(bad, 0, indices), bad.sum().reshape(1)


def indices_out_of_range(indices: torch.Tensor, table_of_index: torch.Tensor,
                         num_rows_of_table: torch.Tensor) -> torch.Tensor:
    """bool [N]: each index outside ``[0, rows of its table)``."""
    return (indices < 0) | (indices >= num_rows_of_table[table_of_index])


BOUNDS_CHECKS = ("raise", "warn", "off")
NAN_CHECKS = ("off", "raise")


def check_finite_update(tables: list[TableSpec], pooling: str, grad_output: torch.Tensor, offsets: torch.Tensor,
                        batch_size: int, per_sample_weights: torch.Tensor | None,
                        feature_table_map: list[int] | None = None) -> None:
    """``nan_check="raise"``: refuse an update whose inputs are not all finite.

    Args:
        grad_output: fp32 ``[B, sum of dims]`` (``pooling="none"``: ``[N, dim]``), the gradient
            arriving at the module's output.
        offsets: int32/int64 ``[F*B+1]``, the batch's (a valid batch: it went through forward);
            batch_size: ``B``.
        per_sample_weights: fp32 [N] of the batch, or None.
        feature_table_map: the table of each feature (None: feature t is table t).

    Cost: one elementwise pass over each tensor and one host sync. Only when something is not
    finite are the culprit's position, table and value found.

    Raises:
        ValueError: naming the tensor, the first bad position, its table and its value.
    """
    bad_weights = None if per_sample_weights is None else ~torch.isfinite(per_sample_weights)
    bad_grad = ~torch.isfinite(grad_output)
    any_bad = bad_grad.any() if bad_weights is None else bad_grad.any() | bad_weights.any()
    if not bool(any_bad):  # the one sync
        return

    features = list(range(len(tables))) if feature_table_map is None else list(feature_table_map)

    def name(feature: int) -> str:
        return _feature_name(tables, feature_table_map, feature)

    def feature_of_lookup(position: int) -> int:
        bag = int(torch.searchsorted(offsets.cpu(), torch.tensor(position), right=True)) - 1
        return min(max(bag, 0) // max(batch_size, 1), len(features) - 1)

    refused = "nan_check='raise' refused the update of this batch (every row is as it was)"
    if bad_weights is not None and bool(bad_weights.any()):
        position = int(torch.nonzero(bad_weights)[0])
        raise ValueError(f"{refused}: per_sample_weights has {int(bad_weights.sum())} NaN/inf values, the first "
                         f"at position {position} ({name(feature_of_lookup(position))}) = "
                         f"{float(per_sample_weights[position])}")
    row, column = (int(i) for i in torch.nonzero(bad_grad)[0])
    if pooling == "none":  # one output row per lookup
        f, where = feature_of_lookup(row), f"lookup {row}"
    else:  # columns: the features' dims side by side
        ends = torch.tensor([tables[t].embedding_dim for t in features]).cumsum(0)
        f, where = int(torch.searchsorted(ends, column, right=True)), f"sample {row}"
    raise ValueError(f"{refused}: the gradient of the output has {int(bad_grad.sum())} NaN/inf values, the first "
                     f"at [{row}, {column}] ({name(f)}, {where}) = {float(grad_output[row, column])}")
