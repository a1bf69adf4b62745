"""Seeded synthetic traces: Zipf lookups over one table, with drifting popularity, or over the 26
tables of the Criteo Kaggle data set. Every generator gives the same trace for the same arguments."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tiered_tbe.traces.trace import Trace, check_batch_shape
from tiered_tbe.zipf import ZipfSampler

# Unique-value counts of the 26 categorical features (C1..C26) of the Criteo Kaggle Display
# Advertising Challenge training set (45,840,617 samples), as produced by the preprocessing of
# facebookresearch/dlrm (data_utils.py, `--data-set=kaggle`) and passed to DLRM as
# `--arch-embedding-size=1460-583-10131227-...-142572` in its benchmark scripts.
CRITEO_KAGGLE_TABLE_ROWS: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)


def _fixed_batches(num_batches: int, num_tables: int, batch_size: int, bag_size: int) -> dict:
    """Layout fields of a Trace whose batches all hold ``num_tables * batch_size`` bags of ``bag_size``."""
    batch_bags = np.arange(num_batches + 1, dtype=np.int64) * (num_tables * batch_size)
    return dict(batch_offsets=batch_bags * bag_size, batch_bag_offsets=batch_bags, bag_size=bag_size)


def zipf_trace(
    num_rows: int, alpha: float, batch_size: int, bag_size: int, num_batches: int, seed: int = 0
) -> Trace:
    """One table of ``num_rows`` rows, every lookup drawn independently from Zipf(``alpha``).

    Each batch has ``batch_size`` bags of ``bag_size`` lookups: ``batch_size * bag_size`` lookups.
    """
    check_batch_shape(batch_size, bag_size, num_batches)
    rng = np.random.default_rng(seed)
    sampler = ZipfSampler(num_rows, alpha, rng)
    lookups_per_batch = batch_size * bag_size
    rows = sampler.sample(rng, num_batches * lookups_per_batch)
    return Trace(
        rows=rows,
        table_rows=(num_rows,),
        **_fixed_batches(num_batches, 1, batch_size, bag_size),
        description=(f"zipf alpha={alpha:g}, {num_rows:,} rows, "
                     f"{num_batches} batches of {batch_size}x{bag_size}"),
        params=dict(trace="zipf", rows=num_rows, alpha=alpha, batch_size=batch_size, bag_size=bag_size,
                    batches=num_batches, seed=seed),
    )


def drifting_zipf_trace(
    num_rows: int,
    alpha: float,
    batch_size: int,
    bag_size: int,
    num_batches: int,
    drift_period: int = 100,
    seed: int = 0,
) -> Trace:
    """Zipf(``alpha``) lookups whose popular rows change over time.

    Popularity moves from one random ranking of the rows to a fresh one every ``drift_period``
    batches: at step ``j`` of a period, a lookup draws its rank from Zipf(``alpha``) and takes
    the row of that rank in the new ranking with probability ``j / drift_period``, else in the
    old one. The old hot rows fade while new ones rise, as items do in click logs; a policy
    that keeps once-hot rows (LFU without decay) falls behind.

    Args:
        drift_period: batches for the popularity to move fully to a new ranking (>= 1).
    """
    check_batch_shape(batch_size, bag_size, num_batches)
    if int(drift_period) != drift_period or drift_period < 1:
        raise ValueError(f"drift_period must be an integer >= 1, got {drift_period}")
    rng = np.random.default_rng(seed)
    sampler = ZipfSampler(num_rows, alpha, rng)
    lookups_per_batch = batch_size * bag_size
    ranks = sampler.sample_ranks(rng, num_batches * lookups_per_batch).reshape(num_batches, lookups_per_batch)
    rows = np.empty_like(ranks)
    old_ranking, new_ranking = sampler.id_of_rank, rng.permutation(num_rows)
    for b in range(num_batches):
        step = b % drift_period
        if step == 0 and b > 0:
            old_ranking, new_ranking = new_ranking, rng.permutation(num_rows)
        from_new = rng.random(lookups_per_batch) < step / drift_period
        rows[b] = np.where(from_new, new_ranking[ranks[b]], old_ranking[ranks[b]])
    return Trace(
        rows=rows.reshape(-1),
        table_rows=(num_rows,),
        **_fixed_batches(num_batches, 1, batch_size, bag_size),
        description=(f"drifting zipf alpha={alpha:g} period={drift_period}, {num_rows:,} rows, "
                     f"{num_batches} batches of {batch_size}x{bag_size}"),
        params=dict(trace="drift", rows=num_rows, alpha=alpha, drift_period=drift_period,
                    batch_size=batch_size, bag_size=bag_size, batches=num_batches, seed=seed),
    )


def criteo_trace(
    alpha: float | Sequence[float],
    batch_size: int,
    num_batches: int,
    bag_size: int = 1,
    row_cap: int | None = None,
    table_rows: Sequence[int] = CRITEO_KAGGLE_TABLE_ROWS,
    seed: int = 0,
) -> Trace:
    """A DLRM-like multi-table trace: the 26 Criteo Kaggle tables, Zipf lookups in each.

    Each sample looks up ``bag_size`` rows (1 in the real data set: one value per categorical
    feature) of every table; a batch holds ``batch_size`` samples, laid out table-major as in TBE.
    Tables draw independently, each from its own seeded stream and its own permutation.

    Args:
        alpha: one exponent for every table, or one per table.
        row_cap: if given, a table has ``min(cardinality, row_cap)`` rows, as DLRM's
            ``--max-ind-range`` hashes large vocabularies into fewer rows.
        table_rows: cardinalities (default :data:`CRITEO_KAGGLE_TABLE_ROWS`).
    """
    check_batch_shape(batch_size, bag_size, num_batches)
    cardinalities = [int(n) for n in table_rows]
    if row_cap is not None:
        if row_cap < 1:
            raise ValueError(f"row_cap must be >= 1, got {row_cap}")
        cardinalities = [min(n, row_cap) for n in cardinalities]
    num_tables = len(cardinalities)
    alphas = [float(alpha)] * num_tables if np.isscalar(alpha) else [float(a) for a in alpha]
    if len(alphas) != num_tables:
        raise ValueError(f"give one alpha or {num_tables} (one per table), got {len(alphas)}")

    lookups_per_table = batch_size * bag_size
    # [batch, table, lookup] is exactly the table-major TBE order of every batch, flattened.
    rows = np.empty((num_batches, num_tables, lookups_per_table), dtype=np.int64)
    row_offsets = np.concatenate([[0], np.cumsum(cardinalities)])
    for t, child in enumerate(np.random.SeedSequence(seed).spawn(num_tables)):
        rng = np.random.default_rng(child)
        sampler = ZipfSampler(cardinalities[t], alphas[t], rng)
        rows[:, t, :] = sampler.sample(rng, num_batches * lookups_per_table).reshape(num_batches, -1)
        rows[:, t, :] += row_offsets[t]
    alpha_text = f"{alphas[0]:g}" if len(set(alphas)) == 1 else "per-table"
    cap_text = f", row cap {row_cap:,}" if row_cap else ""
    return Trace(
        rows=rows.reshape(-1),
        table_rows=tuple(cardinalities),
        **_fixed_batches(num_batches, num_tables, batch_size, bag_size),
        description=(f"criteo-kaggle {num_tables} tables alpha={alpha_text}{cap_text}, "
                     f"{sum(cardinalities):,} rows, {num_batches} batches of {batch_size}x{bag_size}"),
        params=dict(trace="criteo", alpha=alphas, row_cap=row_cap, table_rows=cardinalities,
                    batch_size=batch_size, bag_size=bag_size, batches=num_batches, seed=seed),
    )
