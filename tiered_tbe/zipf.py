"""The Zipf sampler of the project: lookups whose row of popularity rank ``k`` has probability ``∝ k ** -alpha``.

One definition of the distribution, for every trace, benchmark and the main job: a table's
ranks ``1 .. num_rows`` get weights ``k ** -alpha`` (``alpha = 0``: uniform), their normalized
cumulative sum is the CDF, a draw ``u`` in ``[0, 1)`` takes the smallest rank ``k`` with
``cdf[k] > u`` (exact inverse CDF), and ranks map to rows through a random permutation of the
table (hot rows scattered over the ids, hence over the sets of the cache, as hashed ids of real
data are). Two ways to draw, the same rank for the same ``u``:

- :class:`ZipfSampler`: on the host, numpy generators, O(1) per draw with a guide table (the
  traces of :mod:`tiered_tbe.traces`, the main job's data);
- :class:`DeviceZipfSampler`: several tables at once on a device, one ``torch.searchsorted``
  over their CDFs laid end to end (the GPU benchmarks draw each batch where it is used).

Example::

    >>> rng = np.random.default_rng(0)
    >>> sampler = ZipfSampler(num_rows=1000, alpha=1.05, rng=rng)
    >>> sampler.sample(rng, 4)  # int64 row ids in [0, 1000)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numba
import numpy as np
import torch

# Uniforms drawn per call of the inverse CDF: bounds the float64 scratch memory of long traces.
_SAMPLE_CHUNK = 1 << 22


@numba.njit(cache=True, nogil=True)
def _inverse_cdf(cdf, guide, uniforms, out):
    """``out[i]`` = smallest rank ``k`` with ``cdf[k] > uniforms[i]`` (0-based ranks).

    cdf: float64 ``[num_rows]``, non-decreasing, ``cdf[-1] == 1``. guide: int64 ``[m + 1]``,
    ``guide[j]`` = the answer for ``u = j / m``; the answer for any ``u`` in ``[j/m, (j+1)/m)``
    is at or after ``guide[j]``, so a short forward scan replaces the binary search
    (``np.searchsorted`` costs ~10x more on large supports: 23 dependent cache misses per draw).
    """
    buckets = guide.shape[0] - 1
    last = cdf.shape[0] - 1
    for i in range(uniforms.shape[0]):
        u = uniforms[i]
        rank = guide[min(int(u * buckets), buckets)]
        while rank > 0 and cdf[rank - 1] > u:  # u * buckets may round up into the next bucket
            rank -= 1
        while rank < last and cdf[rank] <= u:
            rank += 1
        out[i] = rank


class ZipfSampler:
    """Draws row ids of one table with ``P(rank k) ∝ k ** -alpha``, ``k = 1 .. num_rows``, exactly.

    Args:
        num_rows: size of the support (rows of the table).
        alpha: exponent, a finite number >= 0 (1.0 is the classic Zipf law, 0 uniform).
        rng: generator of the rank -> row permutation (drawn here, once).

    Attributes:
        cdf: float64 ``[num_rows]``, the CDF over ranks (``cdf[-1] == 1``).
        id_of_rank: int64 ``[num_rows]``, the row of each rank (0 = hottest).
    """

    def __init__(self, num_rows: int, alpha: float, rng: np.random.Generator):
        if int(num_rows) != num_rows or num_rows < 1:
            raise ValueError(f"num_rows must be a whole number >= 1, got {num_rows}")
        if not alpha >= 0 or not math.isfinite(alpha):
            raise ValueError(f"alpha must be a finite number >= 0, got {alpha}")
        self.num_rows = int(num_rows)
        self.alpha = alpha
        cdf = np.cumsum(np.arange(1, self.num_rows + 1, dtype=np.float64) ** -alpha)
        self.cdf = cdf / cdf[-1]  # cdf[-1] becomes exactly 1.0, so the scan always stops
        self.id_of_rank = rng.permutation(self.num_rows).astype(np.int64)
        self._guide: np.ndarray | None = None

    @property
    def guide(self) -> np.ndarray:
        """int64 ``[num_rows + 1]``: the rank of ``u = j / num_rows`` (one bucket per row: the
        expected scan of :func:`_inverse_cdf` is about one step). Built at the first host draw."""
        if self._guide is None:
            bucket_starts = np.arange(self.num_rows + 1) / self.num_rows
            self._guide = np.searchsorted(self.cdf, bucket_starts, side="right").astype(np.int64)
        return self._guide

    def ranks_of(self, uniforms: np.ndarray) -> np.ndarray:
        """int64 ranks (0 = hottest) of float64 ``uniforms`` in ``[0, 1)``: the inverse CDF."""
        out = np.empty(uniforms.shape[0], dtype=np.int64)
        _inverse_cdf(self.cdf, self.guide, np.ascontiguousarray(uniforms, dtype=np.float64), out)
        return out

    def sample_ranks(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """int64 ``[count]`` popularity ranks, 0 = hottest."""
        out = np.empty(count, dtype=np.int64)
        for start in range(0, count, _SAMPLE_CHUNK):
            stop = min(start + _SAMPLE_CHUNK, count)
            out[start:stop] = self.ranks_of(rng.random(stop - start))
        return out

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """int64 ``[count]`` row ids in ``[0, num_rows)``."""
        return self.id_of_rank[self.sample_ranks(rng, count)]


class DeviceZipfSampler:
    """The distributions of several :class:`ZipfSampler` s, drawn together on ``device``.

    Each table's CDF is shifted by its table number ``t`` (values in ``(t, t + 1]``) and laid end
    to end with the others: ``torch.searchsorted`` of ``t + u`` then finds the rank of ``u`` in
    table ``t`` only, the same rank :meth:`ZipfSampler.ranks_of` gives. Memory on the device: 16
    bytes per row of all tables (float64 CDF, int64 permutation); the samplers may be dropped.

    Args:
        samplers: one per table.
        device: where the draws happen and their results live.
        generator: the ``torch.Generator`` (on ``device``) of the uniforms.
    """

    def __init__(self, samplers: Sequence[ZipfSampler], device: torch.device | str, generator: torch.Generator):
        self.device = torch.device(device)
        self.generator = generator
        self.num_tables = len(samplers)
        on = dict(device=self.device)
        starts = np.concatenate([[0], np.cumsum([s.num_rows for s in samplers])])
        self.row_start = torch.tensor(starts, dtype=torch.int64, **on)  # [T + 1]
        self.shifted_cdf = torch.empty(int(starts[-1]), dtype=torch.float64, **on)
        self.local_row = torch.empty(int(starts[-1]), dtype=torch.int64, **on)  # rank -> row, per table
        for t, sampler in enumerate(samplers):
            part = slice(int(starts[t]), int(starts[t + 1]))
            self.shifted_cdf[part] = torch.from_numpy(sampler.cdf).to(**on) + t  # not in place: may alias the sampler's
            self.local_row[part] = torch.from_numpy(sampler.id_of_rank).to(**on)

    def ranks_of(self, uniforms: torch.Tensor, table_of_draw: torch.Tensor) -> torch.Tensor:
        """int64 positions in the laid-out ranks (table start + rank) of float64 ``uniforms`` in
        ``[0, 1)``, each drawn in table ``table_of_draw`` (int64, same shape)."""
        position = torch.searchsorted(self.shifted_cdf, uniforms + table_of_draw, right=True)
        return torch.minimum(position, self.row_start[table_of_draw + 1] - 1)  # t + u may round up to t + 1

    def sample(self, draws_per_table: int) -> torch.Tensor:
        """int64 ``[num_tables * draws_per_table]`` table-local rows, table-major (table 0's first)."""
        table_of_draw = torch.arange(self.num_tables, device=self.device).repeat_interleave(draws_per_table)
        uniforms = torch.rand(table_of_draw.numel(), dtype=torch.float64, generator=self.generator,
                              device=self.device)
        return self.local_row[self.ranks_of(uniforms, table_of_draw)]
