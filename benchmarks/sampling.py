"""The benchmarks' batches: lookups in FBGEMM's TBE layout drawn on the device by the project's Zipf sampler.

- :class:`ZipfBatches`: Zipf(alpha) per table by the project's one sampler (:mod:`tiered_tbe.zipf`); bags
  of one length or of lengths drawn per bag or per batch, per-sample weights, batch sizes that change
  every batch.
- :func:`cycle`: a run of batches cycling through a few drawn ones.
- :func:`global_rows`: a batch's rows in the one id space of all its tables.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tiered_tbe.zipf import DeviceZipfSampler, ZipfSampler

BAG_LENGTHS = ("fixed", "per_bag", "per_batch")  # how ZipfBatches draws the lookups of each bag


class ZipfBatches:
    """Batches of lookups in FBGEMM's TBE layout, drawn on ``device`` by the project's Zipf sampler.

    Every table draws its rows independently from :class:`tiered_tbe.zipf.ZipfSampler`'s
    distribution (its own seeded permutation), all tables at once on the device
    (:class:`tiered_tbe.zipf.DeviceZipfSampler`). The CDFs are built on the host (about a second
    per 30M rows), then kept on ``device``: 16 bytes per row of all tables.

    Args:
        table_rows: rows of each table.
        alpha: Zipf exponent (>= 0); ``0`` draws rows uniformly.
        batch_size: bags per table per batch (``B``); with ``min_batch_size``, the largest.
        bag_size: lookups per bag (``L``), or the most a bag holds when lengths are drawn.
        device: where the batches (and the CDFs) live.
        seed: seeds the permutations and every draw.
        bag_lengths: ``"fixed"`` (every bag ``bag_size`` lookups), ``"per_bag"`` (each bag's length
            drawn uniformly in ``0..bag_size``: empty bags included) or ``"per_batch"`` (one length
            per table and batch, drawn uniformly in ``1..bag_size``: the length changes every batch).
        weighted: also draw per-sample weights (fp32, uniform in ``[0.5, 1.5)``), one per lookup.
        min_batch_size: draw each batch's ``B`` uniformly in ``min_batch_size..batch_size``
            (None: every batch has ``batch_size`` bags per table).

    ``next()`` returns ``(indices, offsets)``, or ``(indices, offsets, per_sample_weights)`` when
    ``weighted``: int64 ``[N]`` table-local rows, table-major; int64 ``[T * B + 1]`` offsets (one
    tensor for every batch when their bags are all ``bag_size`` long and ``B`` never changes); fp32
    ``[N]`` weights.
    """

    def __init__(self, table_rows: Sequence[int], alpha: float, batch_size: int, bag_size: int,
                 device: torch.device | str, seed: int = 0, bag_lengths: str = "fixed", weighted: bool = False,
                 min_batch_size: int | None = None):
        if bag_lengths not in BAG_LENGTHS:
            raise ValueError(f"bag_lengths must be one of {BAG_LENGTHS}, got {bag_lengths!r}")
        if min_batch_size is not None and not 1 <= min_batch_size <= batch_size:
            raise ValueError(f"min_batch_size must be between 1 and batch_size = {batch_size}, got {min_batch_size}")
        self.table_rows = [int(n) for n in table_rows]
        self.alpha, self.batch_size, self.bag_size = alpha, batch_size, bag_size
        self.bag_lengths, self.weighted, self.min_batch_size = bag_lengths, weighted, min_batch_size
        self.device = torch.device(device)
        streams = np.random.SeedSequence(seed).spawn(len(self.table_rows))
        samplers = [ZipfSampler(n, alpha, np.random.default_rng(stream)) for n, stream in zip(self.table_rows, streams)]
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.sampler = DeviceZipfSampler(samplers, self.device, self.generator)
        self.sizes = torch.Generator().manual_seed(seed)  # batch sizes, on the host
        lookups = len(self.table_rows) * batch_size * bag_size
        self.offsets = torch.arange(0, lookups + 1, bag_size, dtype=torch.int64, device=self.device)

    @property
    def uniform(self) -> bool:
        """Every batch of the same shape: ``B`` bags of ``bag_size`` lookups per table."""
        return self.bag_lengths == "fixed" and self.min_batch_size is None

    def next(self) -> tuple[torch.Tensor, ...]:
        if self.uniform:
            indices, offsets = self.sampler.sample(self.batch_size * self.bag_size), self.offsets
        else:
            indices, offsets = self._next_ragged()
        if not self.weighted:
            return indices, offsets
        weights = torch.rand(indices.numel(), generator=self.generator, device=self.device) + 0.5
        return indices, offsets, weights

    def _next_ragged(self) -> tuple[torch.Tensor, torch.Tensor]:
        num_tables, on = len(self.table_rows), dict(device=self.device)
        batch_size = self.batch_size if self.min_batch_size is None else int(
            torch.randint(self.min_batch_size, self.batch_size + 1, (), generator=self.sizes))
        if self.bag_lengths == "per_bag":
            lengths = torch.randint(0, self.bag_size + 1, (num_tables * batch_size,), generator=self.generator, **on)
        elif self.bag_lengths == "per_batch":
            per_table = torch.randint(1, self.bag_size + 1, (num_tables,), generator=self.generator, **on)
            lengths = per_table.repeat_interleave(batch_size)
        else:
            lengths = torch.full((num_tables * batch_size,), self.bag_size, dtype=torch.int64, **on)
        offsets = torch.zeros(num_tables * batch_size + 1, dtype=torch.int64, **on)
        torch.cumsum(lengths, 0, out=offsets[1:])
        lookups_of_table = lengths.view(num_tables, batch_size).sum(1)
        table_of_draw = torch.arange(num_tables, **on).repeat_interleave(lookups_of_table)
        uniforms = torch.rand(table_of_draw.numel(), dtype=torch.float64, generator=self.generator, **on)
        return self.sampler.local_row[self.sampler.ranks_of(uniforms, table_of_draw)], offsets

    def batches(self, count: int) -> list[tuple[torch.Tensor, ...]]:
        return [self.next() for _ in range(count)]


def cycle(batches: Sequence, count: int, first: int = 0) -> list:
    """``count`` batches, cycling through ``batches`` from the one at ``first``."""
    return [batches[(first + i) % len(batches)] for i in range(count)]


def global_rows(indices: torch.Tensor, offsets: torch.Tensor, table_rows: Sequence[int]) -> torch.Tensor:
    """Global row ids (row ``r`` of table ``t`` = rows of tables before ``t`` + ``r``) of a TBE batch."""
    num_tables = len(table_rows)
    batch_size = (offsets.numel() - 1) // num_tables
    starts = torch.tensor([0, *table_rows], dtype=torch.int64, device=indices.device).cumsum(0)[:-1]
    bounds = offsets[:: batch_size]  # [T + 1]: where each table's lookups start
    return indices + starts.repeat_interleave(bounds[1:] - bounds[:-1])
