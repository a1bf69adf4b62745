"""Group a batch's lookups by global row, on the device: the backward's first step.

``sort_lookups`` linearizes the batch (``kernels/linearize.py``), sorts the lookups by global row
(a stable radix sort, on int32 keys when the rows fit: ``base/sorting.py``), gathers each sorted
position's bag (in the run-start kernel; or the sort carries the bags, when no caller reads a
lookup by sorted position), and run-length encodes the sorted rows: ``run_count`` (runs begun up to
each position, a cumulative sum) and ``run_end`` (one past the last position of each run, N past
the last run). The number of runs stays on the device, so nothing waits for the GPU; every
launch is sized from the number of lookups.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tiered_tbe.base.codes import INT32_MAX
from tiered_tbe.base.padded_inputs import POSITIONS, LaidOutInput, padded_input
from tiered_tbe.base.sorting import sort_ids, stable_sort

from .addressing import INTERPRETING, POOLING_NONE
from .linearize import linearize
from .rows import Lookups, RowStores


class SortedLookups(NamedTuple):
    """A batch's lookups grouped by global row (all on the device, nothing read back)."""

    sorted_rows: torch.Tensor  # int32/int64 [N]: global rows, ascending
    order: torch.Tensor | None  # int32 [N]: lookup at each sorted position (None: sort_lookups' need_order)
    sorted_bags: torch.Tensor  # int32 [N]: bag f*B+b of the lookup at each sorted position
    run_count: torch.Tensor  # int32 [N]: runs (distinct rows) begun up to and including each position
    run_end: torch.Tensor  # int32 [N]: one past the last sorted position of run u; N past the last run
    num_runs: torch.Tensor  # int32 [1]: distinct rows of the batch


@triton.jit(do_not_specialize=["num_lookups"])
def _run_starts_kernel(
    run_starts_ptr,  # int32 [N] out: 1 where a sorted position begins a run (its row differs from the previous)
    sorted_bags_ptr,  # int32 [N] out (if GATHER_BAGS): bag of the lookup at each sorted position
    sorted_rows_ptr,  # int32/int64 [N]: global rows, ascending
    order_ptr,  # int32 [N]: lookup at each sorted position (read if GATHER_BAGS)
    bag_of_index_ptr,  # int32 [N]: bag f*B+b of each lookup (read if GATHER_BAGS)
    num_lookups,  # N
    GATHER_BAGS: tl.constexpr,  # False when the sort carried the bags (sorted_bags is filled already)
    BLOCK: tl.constexpr,  # positions per program
):
    positions = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = positions < num_lookups
    rows = tl.load(sorted_rows_ptr + positions, mask=inside)
    previous = tl.load(sorted_rows_ptr + positions - 1, mask=inside & (positions > 0))
    tl.store(run_starts_ptr + positions, ((positions == 0) | (rows != previous)).to(tl.int32), mask=inside)
    if GATHER_BAGS:
        lookups = tl.load(order_ptr + positions, mask=inside, other=0)
        tl.store(sorted_bags_ptr + positions, tl.load(bag_of_index_ptr + lookups, mask=inside), mask=inside)


@triton.jit(do_not_specialize=["num_lookups"])
def _run_ends_kernel(
    run_end_ptr,  # int32 [N] out: one past the last position of each run; N past the last run
    num_runs_ptr,  # int32 [1] out: the number of runs
    run_count_ptr,  # int32 [N]: runs begun up to and including each position
    sorted_rows_ptr,  # int32/int64 [N]: global rows, ascending
    num_lookups,  # N
    BLOCK: tl.constexpr,  # positions per program
):
    positions = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = positions < num_lookups
    last = positions == num_lookups - 1
    rows = tl.load(sorted_rows_ptr + positions, mask=inside)
    following = tl.load(sorted_rows_ptr + positions + 1, mask=inside & ~last)
    ends_run = inside & (last | (rows != following))
    runs = tl.load(run_count_ptr + positions, mask=inside, other=1) - 1
    tl.store(run_end_ptr + runs, (positions + 1).to(tl.int32), mask=ends_run)
    # Run numbers from the batch's count on read as empty runs: N (no fill before this kernel).
    total_runs = tl.load(run_count_ptr + num_lookups - 1)
    past_runs = inside & (positions >= total_runs)
    tl.store(run_end_ptr + positions, (tl.zeros_like(positions) + num_lookups).to(tl.int32), mask=past_runs)
    tl.store(num_runs_ptr + tl.zeros_like(runs), runs + 1, mask=inside & last)


def pad_batch(stores: RowStores, lookups: Lookups, slot_of_index: torch.Tensor | None,
              presorted: tuple[torch.Tensor, torch.Tensor] | None, size: int,
              in_place_rank: torch.Tensor | None = None):
    """``(lookups, slot_of_index, presorted, in_place_rank)`` padded to ``size`` lookups, so that batches
    whose lookup count changes every step share a few CUDA graphs of the backward (``base/graphs.padded_size``).
    Each padded array is a graph input laid out where the replay copies it in
    (``base/padded_inputs.PaddedInput``): read the results only through ``StepGraphs.run`` or ``to_device``.

    A padding lookup's global row is ``stores.num_rows`` (past every table: it sorts after every
    lookup, and the update kernels skip its run), its index and bag 0 (a gradient row that exists), its
    per-sample weight 0, its slot -1 and its rank -1 (no copy); in ``presorted`` the padding's rows follow
    the batch's and its positions are its own. ``offsets`` stay the batch's: its last entry, the real count,
    ends its last bag.
    """
    if size <= lookups.num_lookups:
        return lookups, slot_of_index, presorted, in_place_rank
    lookups = lookups._replace(indices=padded_input(lookups.indices, size, 0),
                               per_sample_weights=padded_input(lookups.per_sample_weights, size, 0),
                               global_rows=padded_input(lookups.global_rows, size, stores.num_rows),
                               bag_of_index=padded_input(lookups.bag_of_index, size, 0))
    if presorted is not None:
        sorted_rows, order = presorted
        presorted = (padded_input(sorted_rows, size, stores.num_rows), padded_input(order, size, POSITIONS))
    return lookups, padded_input(slot_of_index, size, -1), presorted, padded_input(in_place_rank, size, -1)


def pads_batches(graphs, device: torch.device, mode: int) -> bool:
    """Whether a step's launches pad a batch (``pad_batch``, ``pad_bags``): where they run as CUDA graphs
    (``graphs``, a ``StepGraphs``, enabled) on a GPU, so that batches whose lookup count or batch size
    changes every step replay a few graphs instead of running eagerly (~1-6 ms of host time a step on the
    H200 machine, docs/performance.md); never for pooling none, whose output rows and gradient rows are its
    lookups'. ``TIERED_TBE_PAD_BATCHES=0`` turns it off (to bisect)."""
    return (graphs is not None and getattr(graphs, "enabled", True) and device.type == "cuda"
            and mode != POOLING_NONE and os.environ.get("TIERED_TBE_PAD_BATCHES", "1") != "0")


def size_changed(graphs, size) -> bool:
    """Whether a batch of ``size`` differs in size from the one ``graphs`` (a ``StepGraphs``) saw before it
    (``StepGraphs.size_changed``): only such a batch needs padding to replay a graph. A stand-in without the
    method counts every size as new."""
    changed = getattr(graphs, "size_changed", None)
    return True if changed is None else changed(size)


def padded_batch_size(batch_size: int) -> int:
    """The batch size a padded backward lays its bags out at (``pad_bags``): the next power of two. Its
    launches are sized by lookups, never by bags, so empty bags cost only their offsets, and one size an
    octave leaves the lookup count's padded size as the only part of a graph key that changes (batch sizes
    drawn from 8K-16K every step: one or two sizes, not ~5 times as many graphs)."""
    return 1 << max(batch_size - 1, 0).bit_length()


class PaddedBags(LaidOutInput):
    """Offsets ``[F * B + 1]`` laid out at ``B'`` bags a feature (``[F * B' + 1]``), as a graph input that a
    replay lays out in its static tensor (``base/padded_inputs.py``): feature ``f``'s ``B`` offsets into its
    first ``B`` places (one strided copy for every feature), where its last bag ends into the other
    ``B' - B`` (the features' ends, expanded), and the batch's end last. Where the offsets were made first by
    two ``cat``s and then copied in."""

    __slots__ = ("offsets", "num_features", "batch_size", "padded_batch_size", "size")

    def __init__(self, offsets: torch.Tensor, num_features: int, batch_size: int, padded_batch_size: int):
        self.offsets = offsets  # int32/int64 [F * B + 1], the batch's
        self.num_features = num_features  # F
        self.batch_size = batch_size  # B
        self.padded_batch_size = padded_batch_size  # B' > B
        self.size = num_features * padded_batch_size + 1

    def data(self) -> torch.Tensor:
        return self.offsets

    def _parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The bags' offsets [F, B], the features' ends expanded [F, B' - B] and the batch's end [1]."""
        bags = self.offsets[:-1].view(self.num_features, self.batch_size)
        ends = self.offsets[self.batch_size::self.batch_size].unsqueeze(1)  # [F, 1]: offsets[(f+1)*B]
        return bags, ends.expand(self.num_features, self.padded_batch_size - self.batch_size), self.offsets[-1:]

    def materialize(self) -> torch.Tensor:
        bags, ends, last = self._parts()
        return torch.cat([torch.cat([bags, ends], 1).view(-1), last])

    def copy_pairs(self, static: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        grid = static[:-1].view(self.num_features, self.padded_batch_size)
        return [grid[:, :self.batch_size], grid[:, self.batch_size:], static[-1:]], list(self._parts())


def pad_bags(lookups: Lookups, num_features: int, batch_size: int, laid_out: bool = False) -> Lookups:
    """``lookups`` laid out at ``batch_size`` bags a feature, so that batches whose batch size changes every
    step share a few CUDA graphs (the graph's key holds the offsets' length and the kernels' batch size):
    feature ``f``'s bags ``B .. batch_size - 1`` are empty (their offsets repeat where its last bag ends), and
    ``bag_of_index`` (where given) is renumbered to the new layout (``f * batch_size + b``). Every bag of the
    batch keeps its lookups, so the forward's rows and the backward's update are the unpadded ones, bit for bit
    (the caller's output rows and gradient rows past ``B`` are never read). No sync.

    ``laid_out``: the offsets as a :class:`PaddedBags` graph input, for a caller that hands them to
    ``StepGraphs.run`` or ``to_device`` only (the backward); else a tensor (two ``cat``s: the forward reads
    its batch by address)."""
    extra = batch_size - lookups.batch_size
    if extra <= 0 or num_features == 0 or num_features * batch_size >= INT32_MAX:  # bag ids are int32
        return lookups
    old = lookups.batch_size
    offsets = PaddedBags(lookups.offsets, num_features, old, batch_size)
    bag_of_index = lookups.bag_of_index
    if bag_of_index is not None:  # f*B + b -> f*B' + b = (f*B + b) + f*(B' - B)
        bag_of_index = bag_of_index.add(torch.div(bag_of_index, old, rounding_mode="floor"), alpha=extra)
    return lookups._replace(offsets=offsets if laid_out else offsets.materialize(), batch_size=batch_size,
                            bag_of_index=bag_of_index)


def sort_lookups(stores: RowStores, lookups: Lookups, presorted: tuple[torch.Tensor, torch.Tensor] | None = None,
                 need_order: bool = True, padded: bool = False) -> SortedLookups:
    """Group a batch's lookups by global row (step 1 of the module docstring). No host sync.

    ``need_order=False``: the caller reads no lookup by sorted position (no per-sample weights,
    no slots, pooled output), so the sort carries each lookup's bag instead of its position
    (``order`` is None) and no kernel gathers the bags.

    ``presorted``: ``(sorted_rows, order)`` of a stable sort of the batch's global rows made
    already (int32/int64 [N], int32 [N]: the cache's prefetch when every table is cached), used
    instead of sorting again; ``lookups`` must then carry ``bag_of_index``.

    ``padded``: the batch ends with ``pad_batch``'s padding (positions from ``offsets[-1]`` on), whose
    global row ``stores.num_rows`` linearize leaves to this function to write."""
    num_lookups = lookups.num_lookups
    if num_lookups >= INT32_MAX:
        raise ValueError(f"a batch holds at most 2^31 - 1 lookups, got {num_lookups}")
    device = lookups.offsets.device
    small = stores.num_rows <= INT32_MAX
    if presorted is not None:
        sorted_rows, order = presorted
        if lookups.bag_of_index is None or sorted_rows.numel() != num_lookups or order.numel() != num_lookups:
            raise ValueError(f"presorted needs the batch's bag_of_index and {num_lookups} sorted rows and positions, "
                             f"got {sorted_rows.numel()} and {order.numel()}")
    else:
        lookups = linearize(stores, lookups, key_dtype=torch.int32 if small else torch.int64,
                            padding_row=stores.num_rows if padded else None)
        if lookups.global_rows.dtype == torch.int32 or not small:
            bound = stores.num_rows if padded else max(stores.num_rows - 1, 0)
            if need_order:
                sorted_rows, order = stable_sort(lookups.global_rows, bound)
            else:
                sorted_rows, sorted_bags = stable_sort(lookups.global_rows, bound, values=lookups.bag_of_index)
                order = None
        else:  # int64 rows computed by the caller (the module's checked path): sort them on int32 keys
            sorted_rows, order = sort_ids(lookups.global_rows, stores.num_rows + int(padded))
    run_starts = torch.empty(num_lookups, dtype=torch.int32, device=device)
    run_end = torch.empty(num_lookups, dtype=torch.int32, device=device)
    num_runs = torch.empty(1, dtype=torch.int32, device=device)
    if num_lookups == 0:
        return SortedLookups(sorted_rows, order, lookups.bag_of_index, run_starts, run_end, num_runs.zero_())
    # The bag of each sorted position, gathered once (a dependent load less per lookup in the kernels),
    # unless the sort carried the bags.
    gather_bags = order is not None
    if gather_bags:
        sorted_bags = torch.empty(num_lookups, dtype=torch.int32, device=device)
    block = 256 if INTERPRETING else 1024
    grid = (triton.cdiv(num_lookups, block),)
    _run_starts_kernel[grid](run_starts, sorted_bags, sorted_rows, order if gather_bags else sorted_bags,
                             lookups.bag_of_index, num_lookups, GATHER_BAGS=gather_bags, BLOCK=block)
    run_count = torch.cumsum(run_starts, 0, dtype=torch.int32)
    _run_ends_kernel[grid](run_end, num_runs, run_count, sorted_rows, num_lookups, BLOCK=block)
    return SortedLookups(sorted_rows, order, sorted_bags, run_count, run_end, num_runs)
