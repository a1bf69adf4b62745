"""Row movers: how rows cross the bus between the slot cache's slots and the backing stores.

The slot cache decides everything on the device (hits, victims, locks, the remap); a mover
only carries bytes: the rows a prefetch fills into slots (weights and optimizer state) and
the dirty victims it writes back, and the dirty slots of a flush. Two movers:

``zero_copy`` (:mod:`~tiered_tbe.cache.zero_copy`)
    Copy kernels on the prefetch's stream read and write the backing stores in place over
    the bus (SMs do the moving). Simple, no host work; scattered 516-byte rows moved at
    16-34 GB/s on the H200 machine, and the copy blocks hold SMs that training wants.
``staged`` (:mod:`~tiered_tbe.cache.staged`)
    Host threads gather the missed rows into pinned staging buffers, the copy engines carry
    them (DMA, 54.5 GB/s measured), one kernel scatters them into their slots; write-backs go
    the other way. The prefetch's stream only computes the lists.

What every mover guarantees (the slot cache and the module rely on it):

1. **Fills are visible before use.** After :meth:`RowMover.wait_filled` of a batch, work
   issued on the current stream sees every slot that batch (and every batch prefetched
   before it) filled, and every backing row it reads in place (slot -1) holds every update
   written back before its prefetch.
2. **Write-backs before re-reads.** A row written back by one prefetch reaches its backing
   store before any later fill of that row reads it.
3. **A victim leaves before its slot is refilled.** A dirty victim's slot is read before the
   same prefetch's fill overwrites it.
4. **No metadata.** Movers touch slot rows and backing rows only, never tags, locks, dirty
   bits or policy state: those stay on the stream of the prefetch that owns them.

Which mover a cache uses when ``CacheConfig(mover=None)``: :data:`DEFAULT_MOVER`, by the
placement of its tables. The registry :data:`MOVERS` is the one list of movers: ``CacheConfig``,
the command lines and the tests read it. Adding a mover: a module with a :class:`RowMover`, a
factory below, and one line in ``MOVERS``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from tiered_tbe.base.codes import Placement
from tiered_tbe.base.sorting import sort_ids
from tiered_tbe.cache._kernels import NOT_CACHED
from tiered_tbe.cache.policy import EMPTY

# The mover a cache gets unless CacheConfig(mover=...) says otherwise, by the backing placement
# of its tables. Set from GPU measurements (results/measurements.jsonl, 2026-12-01, H200): zero-copy
# moved 19.4 GB/s for 70K rows of pinned memory and ~42-48 of managed memory; the staged mover
# 8.9 GB/s with torch's host copies, 12.5 GB/s with the numba copies (its
# serial step 7.7 ms against zero-copy's 4.6 on pinned memory), so zero-copy for both placements.
DEFAULT_MOVER = {Placement.HOST_CACHED: "zero_copy", Placement.MANAGED_CACHED: "zero_copy"}


def default_mover(placements: Iterable[Placement]) -> str:
    """The mover for a cache over tables of these placements: ``staged`` only when every one's default is."""
    defaults = {DEFAULT_MOVER[Placement(p)] for p in placements}
    return "staged" if defaults == {"staged"} else "zero_copy"


class Moves(NamedTuple):
    """What one prefetch decided, per unique row of its batch (device tensors [N], padded past
    the batch's unique rows): the assignment kernel's outputs (``cache/_kernels.py``)."""

    unique_rows: torch.Tensor  # int64: the batch's unique rows, ascending; NOT_CACHED padding
    slot_of_unique: torch.Tensor  # int32: slot of each, NO_SLOT when none
    outcome: torch.Tensor  # int8: OUTCOME_* of each
    victim_row: torch.Tensor  # int64: the row its fill evicted, EMPTY if none
    victim_was_dirty: torch.Tensor  # uint8: 1 when that row must be written back
    # int32 when the rows fit it, else int64: the rows to write back (the dirty victims, each a
    # distinct row), the dtype's largest value elsewhere (sorts last; outside every table)
    write_back_keys: torch.Tensor
    num_unique: torch.Tensor  # int32 [1]: how many unique rows the batch has (the entries above are padding)


def sorted_write_backs(rows: torch.Tensor, slots: torch.Tensor, rows_end: int):
    """Write-backs in ascending row order, each row once.

    Args:
        rows: int64 [M], the row to write back from each slot, EMPTY to skip.
        slots: int32/int64 [M], the slots.
        rows_end: one past the largest row.

    Returns:
        ``(sorted_rows int64 [M], sorted_slots [M], selected uint8 [M])``: ``selected[i]`` is 1
        for the first entry of each row (skipped entries sort last, with 0).
    """
    keys = torch.where(rows == EMPTY, NOT_CACHED, rows)
    sorted_rows, order = sort_ids(keys, rows_end)
    selected = sorted_rows != NOT_CACHED
    selected[1:] &= sorted_rows[1:] != sorted_rows[:-1]
    return sorted_rows, slots[order], selected.to(torch.uint8)


class RowMover:
    """The interface of a row mover (see the module docstring for what each guarantees).

    Every call is made on the thread and stream of the cache operation it serves.
    """

    name = ""
    # Whether hand_off gives enqueue's tensors to something that reads them after the prefetch returns (the
    # staged mover's threads): then a prefetch's graph copies its outputs rather than lending them.
    hands_off_device_lists = False

    def enqueue(self, moves: Moves) -> tuple[torch.Tensor, ...]:
        """Begin the write-backs and fills one prefetch decided, device part: launches on the
        current stream only, so the slot cache captures it with its prefetch in one CUDA graph.
        Returns the device tensors :meth:`hand_off` needs (a replay passes copies)."""
        raise NotImplementedError

    def hand_off(self, enqueued: tuple[torch.Tensor, ...]):
        """The host part, after :meth:`enqueue`'s work (run or replayed) on the current stream:
        hand ``enqueued`` to whatever carries the rows; returns a ticket for :meth:`wait_filled`
        (or None). Never waits for the device."""
        return None

    def wait_filled(self, ticket) -> None:
        """Order the current stream after the fills of the prefetch that returned ``ticket``
        (guarantee 1). May block the host while the mover catches up (back-pressure)."""
        raise NotImplementedError

    def write_back(self, sorted_rows: torch.Tensor, sorted_slots: torch.Tensor, selected: torch.Tensor) -> None:
        """Copy slot ``sorted_slots[i]`` to backing row ``sorted_rows[i]`` where ``selected[i]``
        (as :func:`sorted_write_backs` returns them), after the current stream's work so far;
        for ``flush`` and ``write_back``. Done (for the current stream) when it returns."""
        raise NotImplementedError

    def drain(self) -> None:
        """Wait until every move started so far has landed; the current stream is ordered after them."""
        raise NotImplementedError

    def close(self) -> None:
        """Finish every move and release the mover's threads and buffers (a later call restarts them)."""
        self.drain()


def _zero_copy(weights, state, tables, device, launcher, rows_end, threads, staging_rows) -> RowMover:
    from tiered_tbe.cache.zero_copy import ZeroCopyMover

    return ZeroCopyMover(weights, state, tables, device, launcher, rows_end)


def _staged(weights, state, tables, device, launcher, rows_end, threads, staging_rows) -> RowMover:
    from tiered_tbe.cache.staged import StagedMover

    return StagedMover(weights, state, tables, device, rows_end, threads=threads, staging_rows=staging_rows)


# The registry: name -> the factory of its mover (its module is imported when a cache first uses it).
MOVERS: dict[str, Callable[..., RowMover]] = {"zero_copy": _zero_copy, "staged": _staged}


def make_mover(name: str, weights: torch.Tensor, state: torch.Tensor, tables, device: torch.device, launcher,
               rows_end: int, threads: int | None = None, staging_rows: int | None = None) -> RowMover:
    """The mover called ``name`` (a key of :data:`MOVERS`) for a cache's slot rows (``weights``
    [S, row_width], ``state`` [S, state_width]) and ``tables`` (``CachedTable``); ``threads`` and
    ``staging_rows`` are the staged mover's (host threads per gather or scatter, rows per staging
    buffer)."""
    try:
        factory = MOVERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"mover must be one of {list(MOVERS)}, got {name!r}") from None
    return factory(weights, state, tables, device, launcher, rows_end, threads, staging_rows)
