"""A user's own trace from a file: text (one row id per line), ``.pt`` / ``.npy`` / ``.npz`` holding
indices and offsets in TBE layout (concatenated batches, or a list of batches)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from tiered_tbe.traces.trace import Trace, check_batch_shape, check_offsets

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
    check_batch_shape(batch_size, bag_size, 1)
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
    check_offsets(offsets, indices.size, where=source)
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
        check_offsets(offsets, indices.size, where=source + where)
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
