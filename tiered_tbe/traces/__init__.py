"""Lookup traces for cache studies: seeded synthetic generators and a user's own trace from a file.

A :class:`Trace` is the stream of global row ids that a module's prefetches would see, batch by
batch, plus enough of the bag structure to give each batch back in FBGEMM's TBE layout
(``indices`` table-local, ``offsets`` table-major with ``T * B + 1`` entries).

The trace itself is :mod:`.trace`; the generators (:mod:`.generators`):

- :func:`zipf_trace`: one table, row of popularity rank ``k`` drawn with probability
  proportional to ``k ** -alpha`` over a finite support (``alpha = 1.0`` is Zipf, not uniform),
  by the project's one sampler, :class:`tiered_tbe.zipf.ZipfSampler`.
- :func:`drifting_zipf_trace`: the same, with popularity moving over time: hot rows fade and
  others rise, as items do in click logs.
- :func:`criteo_trace`: 26 tables with the cardinalities of the Criteo Kaggle data set, one
  lookup per table per sample (or ``bag_size``), a Zipf exponent per table, optional row cap.

And the file loader (:mod:`.files`): :func:`load_trace`, ``.pt`` / ``.npy`` / ``.npz`` holding
indices and offsets in TBE layout, or a text file of one row id per line.

Every generator takes a ``seed`` and gives the same trace for the same arguments.

Example::

    >>> trace = zipf_trace(num_rows=100_000, alpha=1.05, batch_size=512, bag_size=4, num_batches=10, seed=0)
    >>> trace.rows.shape, trace.batch_offsets.shape
    ((20480,), (11,))
    >>> indices, offsets = trace.tbe_batch(0)  # one batch in TBE layout
"""

from tiered_tbe.traces.files import FILE_FORMATS, load_trace
from tiered_tbe.traces.generators import CRITEO_KAGGLE_TABLE_ROWS, criteo_trace, drifting_zipf_trace, zipf_trace
from tiered_tbe.traces.trace import Trace

__all__ = ["CRITEO_KAGGLE_TABLE_ROWS", "FILE_FORMATS", "Trace", "criteo_trace", "drifting_zipf_trace", "load_trace",
           "zipf_trace"]
