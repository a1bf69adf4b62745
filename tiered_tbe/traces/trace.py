"""A lookup trace (:class:`Trace`): the global rows a module's prefetches would see, batch by
batch, with the bag structure that gives each batch back in FBGEMM's TBE layout; and the checks
the generators and the file loaders share."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tiered_tbe.base.offsets import OffsetsProblem, offsets_problem


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
        check_offsets(self.batch_offsets, self.rows.shape[0], "batch_offsets", "len(rows)")
        if (self.bag_size is None) == (self.stored_bag_offsets is None):
            raise ValueError("give exactly one of bag_size and stored_bag_offsets")
        if self.bag_size is not None:  # then batch_bag_offsets are checked through batch_offsets
            fixed_offsets = self.batch_bag_offsets * max(self.bag_size, 1)
            if self.bag_size < 1 or not np.array_equal(fixed_offsets, self.batch_offsets):
                raise ValueError("bag_size must be >= 1 and batch_offsets = batch_bag_offsets * bag_size")
        else:
            check_offsets(self.stored_bag_offsets, self.rows.shape[0], "stored_bag_offsets", "len(rows)")
            check_offsets(self.batch_bag_offsets, self.stored_bag_offsets.shape[0] - 1, "batch_bag_offsets",
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


def check_offsets(offsets: np.ndarray, end: int, name: str = "offsets", end_name: str = "len(indices)",
                   where: str = "") -> None:
    """:func:`tiered_tbe.base.offsets.offsets_problem` as a ValueError, prefixed by ``where`` (a file)."""
    problem = offsets_problem(offsets, end, name, end_name)
    if problem is None and offsets.dtype != np.int64:
        problem = OffsetsProblem(f"{name} must be int64, got {offsets.dtype}")
    if problem is not None:
        raise ValueError(f"{where}: {problem.message}" if where else problem.message)


def check_batch_shape(batch_size: int, bag_size: int, num_batches: int) -> None:
    for name, value in (("batch_size", batch_size), ("bag_size", bag_size), ("num_batches", num_batches)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value}")
