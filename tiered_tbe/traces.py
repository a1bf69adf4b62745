"""Lookup traces for cache studies: seeded synthetic generators and a user's own trace from a file.

A :class:`Trace` is the stream of global row ids that a module's prefetches would see, batch by
batch, plus enough of the bag structure to give each batch back in FBGEMM's TBE layout
(``indices`` table-local, ``offsets`` table-major with ``T * B + 1`` entries).

Generators:

- :func:`zipf_trace`: one table, row of popularity rank ``k`` drawn with probability
  proportional to ``k ** -alpha`` over a finite support (``alpha = 1.0`` is Zipf, not uniform),
  by the project's one sampler, :class:`tiered_tbe.zipf.ZipfSampler`.
- :func:`drifting_zipf_trace`: the same, with popularity moving over time: hot rows fade and
  others rise, as items do in click logs.
- :func:`criteo_trace`: 26 tables with the cardinalities of the Criteo Kaggle data set, one
  lookup per table per sample (or ``bag_size``), a Zipf exponent per table, optional row cap.
- :func:`load_trace`: ``.pt`` / ``.npy`` / ``.npz`` holding indices and offsets in TBE layout, or a
  text file of one row id per line.

Every generator takes a ``seed`` and gives the same trace for the same arguments.

Example::

    >>> trace = zipf_trace(num_rows=100_000, alpha=1.05, batch_size=512, bag_size=4, num_batches=10, seed=0)
    >>> trace.rows.shape, trace.batch_offsets.shape
    ((20480,), (11,))
    >>> indices, offsets = trace.tbe_batch(0)  # one batch in TBE layout
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tiered_tbe.base.offsets import OffsetsProblem, offsets_problem
from tiered_tbe.zipf import ZipfSampler

# Unique-value counts of the 26 categorical features (C1..C26) of the Criteo Kaggle Display
# Advertising Challenge training set (45,840,617 samples), as produced by the preprocessing of
# facebookresearch/dlrm (data_utils.py, `--data-set=kaggle`) and passed to DLRM as
# `--arch-embedding-size=1460-583-10131227-...-142572` in its benchmark scripts.
CRITEO_KAGGLE_TABLE_ROWS: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)


@dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, so a trace can key a weak cache
class Trace:
    """A stream of lookups, batch by batch, in the global row id space of one module.

    Lookup ``i`` reads global row ``rows[i]``; batch ``b`` is
    ``rows[batch_offsets[b]:batch_offsets[b + 1]]``. Global ids follow the project's layout: row
    ``r`` of table ``t`` is ``table_row_offsets[t] + r``. Bag ``j`` (counted over the whole trace)
    holds ``rows[bag_offsets[j]:bag_offsets[j + 1]]``; the bags of batch ``b`` are
    ``batch_bag_offsets[b]`` up to ``batch_bag_offsets[b + 1]``, table-major (``B`` bags of table 0,
    then ``B`` of table 1, ...), as in FBGEMM's TBE layout.

    Attributes:
        rows: int64 ``[num_lookups]`` global row ids, each in ``[0, num_rows)``.
        batch_offsets: int64 ``[num_batches + 1]``, starts at 0, ends at ``num_lookups``.
        table_rows: rows of each table; ``num_rows = sum(table_rows)``.
        batch_bag_offsets: int64 ``[num_batches + 1]`` bag offsets of every batch; each batch has
            a multiple of ``num_tables`` bags.
        bag_size: lookups of every bag, when all bags are the same size (generated traces) ...
        stored_bag_offsets: ... else int64 ``[num_bags + 1]``, the lookup offsets of every bag
            (file traces). Give exactly one: a fixed size saves an array as long as the trace.
        description: one line saying how the trace was made (for tables and plots).
        params: the generator's arguments, for reports.
    """

    rows: np.ndarray
    batch_offsets: np.ndarray
    table_rows: tuple[int, ...]
    batch_bag_offsets: np.ndarray
    bag_size: int | None = None
    stored_bag_offsets: np.ndarray | None = None
    description: str = ""
    params: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.rows.dtype != np.int64 or self.rows.ndim != 1:
            raise ValueError(f"rows must be 1-D int64, got {self.rows.dtype} of shape {self.rows.shape}")
        _check_offsets(self.batch_offsets, self.rows.shape[0], "batch_offsets", "len(rows)")
        if (self.bag_size is None) == (self.stored_bag_offsets is None):
            raise ValueError("give exactly one of bag_size and stored_bag_offsets")
        if self.bag_size is not None:  # then batch_bag_offsets are checked through batch_offsets
            fixed_offsets = self.batch_bag_offsets * max(self.bag_size, 1)
            if self.bag_size < 1 or not np.array_equal(fixed_offsets, self.batch_offsets):
                raise ValueError("bag_size must be >= 1 and batch_offsets = batch_bag_offsets * bag_size")
        else:
            _check_offsets(self.stored_bag_offsets, self.rows.shape[0], "stored_bag_offsets", "len(rows)")
            _check_offsets(self.batch_bag_offsets, self.stored_bag_offsets.shape[0] - 1, "batch_bag_offsets",
                           "the number of bags")
            if not np.array_equal(self.stored_bag_offsets[self.batch_bag_offsets], self.batch_offsets):
                raise ValueError("batch_offsets must fall on bag boundaries (bag_offsets[batch_bag_offsets])")
        if np.any(np.diff(self.batch_bag_offsets) % self.num_tables):
            raise ValueError(f"every batch needs a multiple of num_tables={self.num_tables} bags (T * B)")
        if self.rows.size and (self.rows.min() < 0 or self.rows.max() >= self.num_rows):
            raise ValueError(f"row ids must lie in [0, {self.num_rows}), "
                             f"got [{self.rows.min()}, {self.rows.max()}]")

    @property
    def num_rows(self) -> int:
        """Size of the global row id space (all tables)."""
        return int(sum(self.table_rows))

    @property
    def num_tables(self) -> int:
        return len(self.table_rows)

    @property
    def num_batches(self) -> int:
        return self.batch_offsets.shape[0] - 1

    @property
    def num_lookups(self) -> int:
        return self.rows.shape[0]

    @property
    def table_row_offsets(self) -> np.ndarray:
        """int64 ``[num_tables + 1]``: global id of row 0 of each table, then ``num_rows``."""
        return np.concatenate([[0], np.cumsum(self.table_rows, dtype=np.int64)])

    @property
    def bag_offsets(self) -> np.ndarray:
        """int64 ``[num_bags + 1]``: lookup offsets of every bag of the trace."""
        if self.stored_bag_offsets is not None:
            return self.stored_bag_offsets
        return np.arange(self.batch_bag_offsets[-1] + 1, dtype=np.int64) * self.bag_size

    def batch(self, b: int) -> np.ndarray:
        """Global row ids of batch ``b``: a view, int64 ``[lookups of batch b]``."""
        return self.rows[self.batch_offsets[b] : self.batch_offsets[b + 1]]

    def tbe_batch(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch ``b`` in FBGEMM's TBE layout.

        Returns:
            indices: int64 ``[lookups of batch b]`` table-local row ids.
            offsets: int64 ``[T * B + 1]``, table-major, starting at 0.
        """
        first_bag, end_bag = self.batch_bag_offsets[b], self.batch_bag_offsets[b + 1]
        num_bags = end_bag - first_bag
        if self.stored_bag_offsets is None:
            offsets = np.arange(num_bags + 1, dtype=np.int64) * self.bag_size
        else:
            offsets = self.stored_bag_offsets[first_bag : end_bag + 1] - self.stored_bag_offsets[first_bag]
        if num_bags == 0:
            return self.batch(b).copy(), offsets
        bag_table = np.arange(num_bags) // (num_bags // self.num_tables)  # table-major
        lookup_table = np.repeat(bag_table, np.diff(offsets))
        return self.batch(b) - self.table_row_offsets[lookup_table], offsets


def _check_offsets(offsets: np.ndarray, end: int, name: str = "offsets", end_name: str = "len(indices)",
                   where: str = "") -> None:
    """:func:`tiered_tbe.base.offsets.offsets_problem` as a ValueError, prefixed by ``where`` (a file)."""
    problem = offsets_problem(offsets, end, name, end_name)
    if problem is None and offsets.dtype != np.int64:
        problem = OffsetsProblem(f"{name} must be int64, got {offsets.dtype}")
    if problem is not None:
        raise ValueError(f"{where}: {problem.message}" if where else problem.message)


# --------------------------------------------------------------------------------------------
# Generators.
# --------------------------------------------------------------------------------------------


def _check_shape_args(batch_size: int, bag_size: int, num_batches: int) -> None:
    for name, value in (("batch_size", batch_size), ("bag_size", bag_size), ("num_batches", num_batches)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value}")


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
    _check_shape_args(batch_size, bag_size, num_batches)
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
    _check_shape_args(batch_size, bag_size, num_batches)
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
    _check_shape_args(batch_size, bag_size, num_batches)
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


# --------------------------------------------------------------------------------------------
# A user's trace from a file.
# --------------------------------------------------------------------------------------------

FILE_FORMATS = """\
Trace files:
  .txt (or any text)  one global row id per line ('#' starts a comment). Batches of
                      batch_size * bag_size lookups, bags of bag_size.
  .pt / .pth          torch.save of one of the forms below (tensors or arrays).
  .npy / .npz         np.save of one of the forms below; .npz with keys 'indices', 'offsets' and
                      optionally 'batch_size', 'table_rows'.
Forms:
  a 1-D integer array                  global row ids, as in a text file
  (indices, offsets)                   TBE layout of many batches concatenated; offsets has
                                       num_bags + 1 entries; a batch is num_tables * batch_size bags
  {'indices', 'offsets', 'batch_size'?, 'table_rows'?}   the same, with the batch size and table
                                       cardinalities inside (then indices are table-local)
  [(indices, offsets), ...] or [{'indices', 'offsets'}, ...]   one TBE batch each (offsets of each
                                       start at 0 and have T * B + 1 entries)
"""


def load_trace(
    path: str | os.PathLike,
    batch_size: int | None = None,
    bag_size: int = 1,
    table_rows: Sequence[int] | None = None,
) -> Trace:
    """Read a user's trace; see :data:`FILE_FORMATS` for what a file may hold.

    Args:
        path: the file.
        batch_size: bags per table per batch, for forms that do not split the lookups into
            batches themselves (text, a 1-D array, a concatenated ``(indices, offsets)``); a value
            stored in the file wins.
        bag_size: lookups per bag for the forms without offsets (text, 1-D array).
        table_rows: cardinalities of the tables when ``indices`` are table-local; without it
            (and none in the file), there is one table and ids are global, the id space is
            ``max id + 1``.

    Returns:
        A :class:`Trace`. Raises ``ValueError`` naming the problem if the content does not fit.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"trace file {path!r} does not exist")
    suffix = os.path.splitext(path)[1].lower()
    if suffix in (".pt", ".pth"):
        import torch

        # weights_only: a trace is plain tensors and containers; never run pickled code.
        content = torch.load(path, map_location="cpu", weights_only=True)
    elif suffix == ".npz":
        with np.load(path, allow_pickle=False) as archive:
            content = {key: archive[key] for key in archive.files}
    elif suffix == ".npy":
        try:
            content = np.load(path, allow_pickle=False)
        except ValueError:
            # A dict or tuple saved with np.save is a pickled object array: the user's own file,
            # loaded on the user's request.
            content = np.load(path, allow_pickle=True)
            content = content.item() if content.ndim == 0 else list(content)
    else:  # any other suffix is read as text: one row id per line
        try:
            content = np.loadtxt(path, dtype=np.int64, comments="#", ndmin=1)
        except ValueError as error:
            raise ValueError(f"cannot read {path!r} as one integer row id per line: {error}") from None
    return _trace_from_content(content, path, batch_size, bag_size, table_rows)


def _as_int64(value, name: str) -> np.ndarray:
    array = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
    if array.dtype == object:  # a row of a pickled object array: try it as integers
        try:
            array = array.astype(np.int64)
        except (TypeError, ValueError):
            pass
    if array.ndim != 1 or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
        raise ValueError(f"{name} must be a 1-D integer array, got {array.dtype} of shape {array.shape}")
    return np.ascontiguousarray(array, dtype=np.int64)


def _is_array(value) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def _trace_from_content(content, path, batch_size, bag_size, table_rows) -> Trace:
    source = os.path.basename(path)
    if isinstance(content, dict):
        missing = {"indices", "offsets"} - set(content)
        if missing:
            raise ValueError(f"{source}: a dict trace needs keys 'indices' and 'offsets'; "
                             f"missing {sorted(missing)}")
        if "batch_size" in content:
            batch_size = int(np.asarray(content["batch_size"]))
        if "table_rows" in content:
            table_rows = [int(n) for n in np.asarray(content["table_rows"]).reshape(-1)]
        return _from_concatenated(content["indices"], content["offsets"], source, batch_size, table_rows)
    if isinstance(content, (tuple, list)):
        if len(content) == 2 and all(_is_array(part) for part in content):
            return _from_concatenated(content[0], content[1], source, batch_size, table_rows)
        return _from_batch_list(content, source, table_rows)
    if _is_array(content):
        ids = _as_int64(content, f"{source}: row ids")
        return _from_row_ids(ids, source, batch_size, bag_size)
    raise ValueError(f"{source}: cannot read a trace from a {type(content).__name__}\n{FILE_FORMATS}")


def _from_row_ids(ids: np.ndarray, source: str, batch_size: int | None, bag_size: int) -> Trace:
    if batch_size is None:
        raise ValueError(f"{source}: a list of row ids needs a batch size (--batch-size) "
                         "to cut it into batches")
    _check_shape_args(batch_size, bag_size, 1)
    if ids.size == 0:
        raise ValueError(f"{source}: the trace is empty")
    if ids.min() < 0:
        raise ValueError(f"{source}: row ids must be >= 0, found {ids.min()}")
    lookups_per_batch = batch_size * bag_size
    # The last batch and bag may be short: keep every lookup of the file.
    bag_offsets = np.append(np.arange(0, ids.size, bag_size, dtype=np.int64), ids.size)
    num_batches = -(-ids.size // lookups_per_batch)
    batch_bag_offsets = np.minimum(np.arange(num_batches + 1, dtype=np.int64) * batch_size,
                                   bag_offsets.size - 1)
    return Trace(
        rows=ids,
        batch_offsets=bag_offsets[batch_bag_offsets],
        table_rows=(int(ids.max()) + 1,),
        batch_bag_offsets=batch_bag_offsets,
        stored_bag_offsets=bag_offsets,
        description=f"file {source}: {ids.size:,} lookups, {num_batches} batches of {batch_size}x{bag_size}",
        params=dict(trace="file", file=source, batch_size=batch_size, bag_size=bag_size),
    )


def _globalize(indices, offsets, table_rows, batch_bags, source, where=""):
    """Table-local ``indices`` of whole batches -> global ids (int64), checking bounds.

    ``batch_bags``: int64 ``[num_batches + 1]`` bag offsets of the batches in ``offsets``.
    """
    if table_rows is None:
        if indices.size and indices.min() < 0:
            raise ValueError(f"{source}{where}: indices must be >= 0, found {indices.min()}")
        return indices
    num_tables = len(table_rows)
    row_offsets = np.concatenate([[0], np.cumsum(table_rows, dtype=np.int64)])
    bags_in_batch = np.diff(batch_bags)
    bag_batch = np.repeat(np.arange(bags_in_batch.size), bags_in_batch)
    bags_per_table = bags_in_batch[bag_batch] // num_tables
    bag_table = (np.arange(offsets.size - 1) - batch_bags[bag_batch]) // bags_per_table
    lookup_table = np.repeat(bag_table, np.diff(offsets))
    limits = np.asarray(table_rows, dtype=np.int64)[lookup_table]
    bad = np.flatnonzero((indices < 0) | (indices >= limits))
    if bad.size:
        i = bad[0]
        raise ValueError(
            f"{source}{where}: lookup {i} of table {lookup_table[i]} has index {indices[i]}, outside "
            f"[0, {limits[i]}) ({bad.size} such lookups)"
        )
    return indices + row_offsets[lookup_table]


def _from_concatenated(indices, offsets, source, batch_size, table_rows) -> Trace:
    indices = _as_int64(indices, f"{source}: indices")
    offsets = _as_int64(offsets, f"{source}: offsets")
    _check_offsets(offsets, indices.size, where=source)
    num_tables = len(table_rows) if table_rows is not None else 1
    if batch_size is None:
        raise ValueError(
            f"{source}: concatenated (indices, offsets) need a batch size (--batch-size, or a 'batch_size' "
            "key) to know where one batch ends"
        )
    bags_per_batch = num_tables * batch_size
    num_bags = offsets.size - 1
    if num_bags == 0 or num_bags % bags_per_batch:
        raise ValueError(
            f"{source}: {num_bags} bags are not a whole number of batches of num_tables * batch_size = "
            f"{num_tables} * {batch_size} bags"
        )
    num_batches = num_bags // bags_per_batch
    batch_bags = np.arange(num_batches + 1, dtype=np.int64) * bags_per_batch
    rows = _globalize(indices, offsets, table_rows, batch_bags, source)
    return _tbe_trace(rows, offsets, batch_bags, table_rows, source, batch_size)


def _from_batch_list(batches, source, table_rows) -> Trace:
    if len(batches) == 0:
        raise ValueError(f"{source}: the list of batches is empty")
    num_tables = len(table_rows) if table_rows is not None else 1
    rows_parts, offsets_parts, batch_bags = [], [np.zeros(1, np.int64)], [0]
    lookups = 0
    for b, batch in enumerate(batches):
        where = f" batch {b}"
        if isinstance(batch, dict):
            if not {"indices", "offsets"} <= set(batch):
                raise ValueError(f"{source}{where}: needs keys 'indices' and 'offsets'")
            indices, offsets = batch["indices"], batch["offsets"]
        elif isinstance(batch, (tuple, list)) and len(batch) == 2:
            indices, offsets = batch
        else:
            raise ValueError(f"{source}{where}: expected (indices, offsets) or a dict, "
                             f"got {type(batch).__name__}\n{FILE_FORMATS}")
        indices = _as_int64(indices, f"{source}{where}: indices")
        offsets = _as_int64(offsets, f"{source}{where}: offsets")
        _check_offsets(offsets, indices.size, where=source + where)
        num_bags = offsets.size - 1
        if num_bags == 0 or num_bags % num_tables:
            raise ValueError(f"{source}{where}: {num_bags} bags is not T * B with T={num_tables} tables")
        rows_parts.append(_globalize(indices, offsets, table_rows, np.array([0, num_bags]), source, where))
        offsets_parts.append(offsets[1:] + lookups)
        lookups += indices.size
        batch_bags.append(batch_bags[-1] + num_bags)
    rows = np.concatenate(rows_parts)
    bag_offsets = np.concatenate(offsets_parts)
    return _tbe_trace(rows, bag_offsets, np.asarray(batch_bags, np.int64), table_rows, source, None)


def _tbe_trace(rows, bag_offsets, batch_bags, table_rows, source, batch_size) -> Trace:
    if table_rows is None:
        table_rows = (int(rows.max()) + 1 if rows.size else 1,)
    num_batches = batch_bags.size - 1
    return Trace(
        rows=rows,
        batch_offsets=bag_offsets[batch_bags],
        table_rows=tuple(int(n) for n in table_rows),
        batch_bag_offsets=batch_bags,
        stored_bag_offsets=bag_offsets,
        description=(f"file {source}: {rows.size:,} lookups, {num_batches} batches, "
                     f"{len(table_rows)} table(s)"),
        params=dict(trace="file", file=source, batch_size=batch_size, tables=len(table_rows)),
    )
