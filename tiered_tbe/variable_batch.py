"""Variable batch size per feature (TorchRec's "VBE"): FBGEMM's layout in, FBGEMM's layout out.

A variable-batch input gives every feature ``f`` its own batch size on every rank ``r``,
``batch_sizes[f][r]`` (TorchRec's ``batch_size_per_feature_per_rank``). Its offsets list the bags
feature by feature, and within a feature rank by rank: ``sum(batch_sizes) + 1`` entries. The
pooled output is one flat fp32 tensor laid out rank by rank, then feature by feature, then sample
by sample (FBGEMM's VBE output, what TorchRec's output all-to-all splits by rank)::

    [r=0: f=0 (B[0][0] x D_0), f=1 (B[1][0] x D_1), ... | r=1: f=0 (B[0][1] x D_0), ...]

The kernels run on a fixed batch: the batch of the largest feature, ``B = max_f sum_r B[f][r]``.
Feature ``f``'s bags fill its first ``sum_r B[f][r]`` places and empty bags pad the rest, so the
lookups (``indices``) stay as they are and only the offsets grow, to ``F * B + 1``. The pooled
``[B, sum of dims]`` output is then gathered into the layout above: one ``index_select`` of units
of ``gcd(dims)`` columns (one unit per bag when every feature has the same dim). Its gradient
flows back through the same gather (autograd scatters it into the padded ``[B, sum of dims]``,
zeros in the padding bags, which have no lookups and so update nothing).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tiered_tbe.base.graphs import to_device


def _check_batch_sizes(batch_sizes, num_features: int) -> tuple[tuple[int, ...], ...]:
    if not isinstance(batch_sizes, Sequence) or len(batch_sizes) != num_features:
        got = len(batch_sizes) if isinstance(batch_sizes, Sequence) else type(batch_sizes).__name__
        raise ValueError(f"batch_size_per_feature_per_rank must hold one list per feature ({num_features}), got {got}")
    sizes = tuple(tuple(int(b) for b in per_rank) for per_rank in batch_sizes)
    ranks = {len(per_rank) for per_rank in sizes}
    if len(ranks) != 1 or 0 in ranks:
        raise ValueError(f"batch_size_per_feature_per_rank: every feature needs one batch size per rank (the same "
                         f"number of ranks, at least one), got lengths {[len(p) for p in sizes]}")
    for f, per_rank in enumerate(sizes):
        if min(per_rank) < 0:
            raise ValueError(f"batch_size_per_feature_per_rank: feature {f} has a negative batch size {per_rank}")
    return sizes


class VariableBatch:
    """The layout of one variable-batch input, and the two moves between it and the kernels' fixed batch.

    Args:
        batch_sizes: ``[F][R]`` ints, the batch size of each feature on each rank.
        feature_dims: ``[F]`` embedding dims of the features, in order.
        device: where the kernels run.

    Raises:
        ValueError: ``batch_sizes`` not one list of ``R >= 1`` non-negative sizes per feature.
    """

    def __init__(self, batch_sizes, feature_dims: Sequence[int], device: torch.device):
        self.batch_sizes = _check_batch_sizes(batch_sizes, len(feature_dims))
        self.feature_dims = tuple(int(d) for d in feature_dims)
        self.device = device
        self.bags_per_feature = [sum(per_rank) for per_rank in self.batch_sizes]
        self.num_bags = sum(self.bags_per_feature)
        self.batch_size = max(self.bags_per_feature, default=0)  # B of the kernels' fixed batch
        self.num_ranks = len(self.batch_sizes[0]) if self.batch_sizes else 1
        self.output_size = sum(b * d for per_rank, d in zip(self.batch_sizes, self.feature_dims) for b in per_rank)

    def check_offsets(self, offsets: torch.Tensor) -> None:
        """``offsets`` must have one entry per bag, plus one (no sync)."""
        if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1:
            raise ValueError("offsets must be a 1-D torch.Tensor")
        if offsets.numel() != self.num_bags + 1:
            raise ValueError(f"offsets has {offsets.numel()} entries; with batch_size_per_feature_per_rank it needs "
                             f"sum of the batch sizes + 1 = {self.num_bags + 1}")

    def padded_offsets(self, offsets: torch.Tensor) -> torch.Tensor:
        """``[F * B + 1]`` offsets, the dtype of ``offsets``: feature ``f``'s bags, then empty bags up to ``B``.

        Entry ``f * B + b`` is ``offsets[start_f + min(b, bags_f)]``, ``start_f`` the feature's first bag.
        """
        self.check_offsets(offsets)
        num_features = len(self.feature_dims)
        starts = [0]
        for bags in self.bags_per_feature[:-1]:
            starts.append(starts[-1] + bags)
        small = to_device([torch.tensor([self.bags_per_feature, starts], dtype=torch.int64)], offsets.device)[0]
        places = torch.arange(self.batch_size, dtype=torch.int64, device=offsets.device)
        source = torch.minimum(places[None, :], small[0][:, None]) + small[1][:, None]  # [F, B]
        last = torch.full((1,), self.num_bags, dtype=torch.int64, device=offsets.device)
        return offsets[torch.cat([source.reshape(num_features * self.batch_size), last])]

    def gather_output(self, pooled: torch.Tensor) -> torch.Tensor:
        """fp32 ``[output_size]`` in FBGEMM's VBE layout, from the kernels' ``[B, sum of dims]`` (differentiable)."""
        if self.output_size == 0:
            return pooled.reshape(-1)[:0]
        unit = math.gcd(*self.feature_dims)
        units_per_row = sum(self.feature_dims) // unit
        first_unit, widths, first_rows, sizes = [], [], [], []
        column = 0
        first_unit_of_feature = []
        for d in self.feature_dims:
            first_unit_of_feature.append(column // unit)
            column += d
        for r in range(self.num_ranks):
            for f, per_rank in enumerate(self.batch_sizes):
                if per_rank[r] == 0:
                    continue
                first_unit.append(first_unit_of_feature[f])
                widths.append(self.feature_dims[f] // unit)
                first_rows.append(sum(per_rank[:r]))
                sizes.append(per_rank[r] * widths[-1])
        total = sum(sizes)
        segment_starts = [0]
        for size in sizes[:-1]:
            segment_starts.append(segment_starts[-1] + size)
        device = pooled.device
        table = torch.tensor([first_unit, widths, first_rows, segment_starts, sizes], dtype=torch.int64)
        first_unit_t, widths_t, first_rows_t, starts_t, sizes_t = to_device([table], device)[0]
        segment = torch.repeat_interleave(torch.arange(len(sizes), device=device), sizes_t, output_size=total)
        within = torch.arange(total, device=device) - starts_t[segment]
        width = widths_t[segment]
        source = (first_rows_t[segment] + within // width) * units_per_row + first_unit_t[segment] + within % width
        return pooled.reshape(-1, unit).index_select(0, source).reshape(-1)


def fixed_batch_offsets(offsets: torch.Tensor, layout: VariableBatch | None) -> torch.Tensor:
    """``offsets`` for the kernels: as given (a fixed batch), or a variable batch's padded to a fixed one."""
    return offsets if layout is None else layout.padded_offsets(offsets)
