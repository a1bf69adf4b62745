"""Backward of the pooled embedding bags with the optimizer fused in: each unique row updated once.

The gradient of a row is the sum, over every lookup of that row in the batch (in one bag or
across bags), of the output gradient of the lookup's bag (the table's columns) times the
lookup's per-sample weight, divided by the bag length for mean pooling. The optimizer
(``kernels/optimizers/``) then updates the row and its state once, in its slot when the
lookup's slot is ``>= 0``, else in its table's backing store.

How, without atomics and without a host synchronization (``sort_lookups``, then three kernels):

1. Sort the lookups by global row (``kernels/linearize.py`` then a radix sort on 32-bit keys
   when the rows fit; or start from the cache prefetch's stable sort, ``presorted``) and
   run-length encode the sorted rows on the device: ``run_count[i]`` (runs begun up to sorted
   position ``i``, a cumulative sum) and ``run_end[u]`` (one past the last position of run
   ``u``); the number of runs stays on the device.
2. Hot rows (``kernels/hot_rows.py``). The sorted positions fall into windows of ``CHUNK``; a
   window inside one run is *pure*. A run holding a pure window is *hot*:
   ``hot_window_sums_kernel`` sums each pure window into ``window_sums``, and
   ``hot_row_update_kernel`` (``BackwardConfig.hot_windows`` windows a program; the first pure
   window of a run owns it) adds its run's window sums, the lookups before its first and
   after its last pure window, and applies the optimizer.
3. Other rows (fewer than ``2 * CHUNK - 1`` lookups): ``_row_update_kernel`` (``kernels/cold_rows.py``), tiles of
   ``ROWS`` consecutive runs, up to the batch's count of runs (read on the device), a grid's
   stride apart (at most ``BackwardConfig.tiles`` a program: the grid is sized by lookups, and
   a program per tile of possible runs was ~90% programs that found none on Criteo). It sums
   each run's lookups ``BLOCK_L`` at a time (a ``[ROWS, BLOCK_L, BLOCK_D]`` tile summed over its
   lanes; one at a time in a tile whose runs are all single lookups) and applies the optimizer
   to the tile's rows at once (a slice of a warp per row, as FBGEMM's warp-per-row kernels, with
   every load of the tile issued together). Tables of mixed dims: one launch per column group, each
   over its tables' runs with a tile of its own width (``kernels/run_groups.py``).

A batch whose lookup count or batch size changes every step is padded to ``padded_size(N)`` lookups and
a power of two of bags a feature where its launches run as CUDA graphs (``grouping.pad_batch``,
``grouping.pad_bags``), so a few graphs serve it; its padding's run is never updated, its bags are empty.

The gradient of a lookup and the optimizer's update of a tile of rows are shared by both
(``kernels/update_rows.py``, with the step's arguments the kernels read from one device tensor,
so one CUDA graph per batch shape serves every step: ``base/graphs.py``).

Each row is owned by one program, so no two programs write the same row, and every sum runs in
an order fixed by the inputs: two identical steps give bit-identical results.

Per-sample-weight gradients (``kernels/per_sample_weights.py``) need the rows before the update: the
caller computes them first.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton

from tiered_tbe.base.graphs import GraphLaunches, padded_size, to_device

from .addressing import INTERPRETING, POOLING_NONE, pooling_code, row_slice_alignment_bytes
from .cold_rows import _row_update_kernel
from .grouping import (
    SortedLookups,
    pad_bags,
    pad_batch,
    padded_batch_size,
    pads_batches,
    size_changed,
    sort_lookups,
)
from .hot_rows import hot_group_sums_kernel, hot_row_update_kernel, hot_window_sums_kernel
from .in_place_copies import InPlaceCopies, uses_copies
from .optimizers import FusedOptimizer
from .rows import Lookups, RowStores, check_lookups
from .run_groups import plan_run_groups
from .update_rows import (
    advance_step_arguments,
    advance_step_kernel,
    hyper_view,
    step_arguments,
)


class BackwardConfig(NamedTuple):
    """Tile shapes of the backward kernels (``TIERED_TBE_BACKWARD=rows,lanes,warps,chunk[,tiles,...]``,
    the fields in order, overrides the defaults, for tuning runs)."""

    rows: int  # runs per program of _row_update_kernel
    lanes: int  # lookups of each run per step
    num_warps: int
    chunk: int  # CHUNK: window of sorted positions; runs holding a whole window are hot
    tiles: int = 2 if INTERPRETING else 16  # tiles of runs a program of _row_update_kernel takes at most
    # Windows a program of hot_row_update_kernel looks at (one in ~20 owns a hot run on Criteo).
    hot_windows: int = 4 if INTERPRETING else 16
    # Windows a program of hot_window_sums_kernel looks at, and its warps: 8 over 2 warps against one
    # over 4 took the big-table backward from 1.048 to 1.013 ms at uniform lookups (the programs mostly
    # find no pure window) and from 0.739 to 0.706 at Zipf 1.05 (results/measurements.jsonl, 2026-12-02).
    sum_windows: int = 2 if INTERPRETING else 8
    sum_warps: int = 4 if INTERPRETING else 2


def default_config(block_d: int) -> BackwardConfig:
    """Measured on an H200 at dim 128 (results/measurements.jsonl); the interpreter takes small tiles so
    the tests walk several steps, tiles and programs."""
    return _config(block_d, os.environ.get("TIERED_TBE_BACKWARD"))


@functools.lru_cache(maxsize=64)  # made once per shape and override: it is asked for every backward
def _config(block_d: int, override: str | None) -> BackwardConfig:
    if override:
        return BackwardConfig(*(int(value) for value in override.split(",")))
    if INTERPRETING:
        return BackwardConfig(rows=2, lanes=2, num_warps=4, chunk=4)
    # Small tiles beat 16 rows over 4 warps once the kernel strides over the batch's runs (Criteo
    # step 0.90 -> 0.81 of FBGEMM's, big Zipf 1.35 -> 1.12), and a warp per row of 128 (2 rows over
    # 2 warps) beats 4 rows over 2 warps: big uniform backward 1.062 -> 1.026 ms, Zipf 0.681 -> 0.650
    # (results/measurements.jsonl, 2026-12-02). More lanes than one lost at every count measured.
    return BackwardConfig(rows=max(1, min(16, 256 // block_d)), lanes=1, num_warps=2 if block_d <= 256 else 4,
                          chunk=32)


# Windows per group of the second level of hot-row sums (a power of two).
HOT_GROUP = 4 if INTERPRETING else 32
# Lookups before a hot run's first pure window (and after its last) summed per step: a whole
# window at once, so the run's owner issues those loads together rather than in a chain of steps.
HOT_LANES = 2 if INTERPRETING else 32

__all__ = ["BackwardConfig", "HOT_GROUP", "SortedLookups", "backward_update", "default_config", "sort_lookups",
           "step_arguments"]


def check_grad_output(grad_output: torch.Tensor, stores: RowStores, lookups: Lookups, mode: int) -> torch.Tensor:
    """grad_output as the kernels read it: fp32, 2-D, contiguous rows (copied only if it is not)."""
    if mode == POOLING_NONE:
        expected = (lookups.num_lookups, stores.max_dim)
    else:
        expected = (lookups.batch_size, stores.total_dim)
    if tuple(grad_output.shape) != expected:
        raise ValueError(f"grad_output must have shape {expected}, got {tuple(grad_output.shape)}")
    if grad_output.dtype != torch.float32:
        raise TypeError(f"grad_output must be fp32, got {grad_output.dtype}")
    if grad_output.numel() > 0 and grad_output.stride(1) != 1:
        grad_output = grad_output.contiguous()
    return grad_output


class _UpdatePlan(NamedTuple):
    """Everything a backward's launches bake in besides its tensors (hashable: part of a graph's key)."""

    mode: int
    batch_size: int
    grad_output_stride: int
    grad_align_bytes: int
    block_d: int
    config: BackwardConfig
    use_cache: bool
    optimizer_triton: tuple
    num_hyper: int
    stochastic_rounding: bool
    reads_step: bool  # the kernels read the step (stochastic rounding, an optimizer's USES_STEP)
    padded: bool  # the batch went through grouping.pad_batch (its padding, if any, ends it)
    reads_copies: bool  # rows read in place are read from the forward's copies (kernels/in_place_copies.py)


def backward_update(
    grad_output: torch.Tensor,
    stores: RowStores,
    lookups: Lookups,
    slot_of_index: torch.Tensor | None,
    pooling: str,
    optimizer: FusedOptimizer,
    step: int = 1,
    stochastic_rounding: bool = False,
    seed: int = 0,
    sorted_lookups: SortedLookups | None = None,
    config: BackwardConfig | None = None,
    graphs=None,
    presorted: tuple[torch.Tensor, torch.Tensor] | None = None,
    then: GraphLaunches | None = None,
    pad: bool | None = None,
    copies: InPlaceCopies | None = None,
) -> None:
    """Sum the gradient of each unique row of the batch and apply the optimizer to it, in place.

    Args:
        grad_output: fp32 ``[B, total_dim]`` (sum, mean) or ``[N, max_dim]`` (none): gradient of the
            output of ``pooled_forward``.
        stores: rows and optimizer state (updated in place: the slot when a lookup's slot is >= 0,
            else the table's backing store; layouts in ``kernels/rows.py``).
        lookups: the batch that produced the output.
        slot_of_index: int32 [N]: slot of each lookup's row, or -1 (all lookups of a row agree);
            ``None``: no lookup has a slot.
        pooling: ``"sum"``, ``"mean"`` or ``"none"``, as in the forward.
        optimizer: a :class:`~tiered_tbe.kernels.optimizers.FusedOptimizer` (its math in its module).
        step: the 1-based optimizer step (Adam-type bias corrections; part of stochastic rounding's draw).
        stochastic_rounding: round fp16 / bf16 weights stochastically instead of to nearest.
        seed: stochastic rounding's random key (the draws also depend on ``step``, row and column).
        sorted_lookups: ``sort_lookups(stores, lookups)`` when the caller made it already.
        config: tile shapes (default :func:`default_config`).
        graphs: a :class:`~tiered_tbe.base.graphs.StepGraphs` of this ``stores``: the launches
            run as a CUDA graph of the batch's shape (bit-identical to running them one by one).
        presorted: ``(sorted_rows, order)``, a stable sort of the batch's global rows made already
            (the cache's prefetch): the grouping starts from it instead of sorting again
            (``sort_lookups``; the same result). Unlike ``sorted_lookups`` it runs in the graph.
        then: launches to enqueue after the update, in its graph (the slot cache's unlock of the
            batch, ``SlotCache.unlock_launches``): one replay a step instead of two.
        pad: pad the batch to ``padded_size(N)`` lookups and ``padded_batch_size(B)`` bags a feature
            (``grouping.pad_batch``, ``grouping.pad_bags``: the same update), so that batches whose lookup
            count or batch size changes every step replay a few graphs rather than run eagerly (~1-6 ms of
            host time). Default: ``grouping.pads_batches`` (graphs on a GPU, pooling not none), for a batch
            whose size differs from the one before it (``grouping.size_changed``).
        copies: the copies the batch's forward made of the rows it read in place (``pooled_forward(...,
            copies=)``), read instead of the backing stores: valid only if nothing changed those rows since
            that forward (the caller's to know; ``kernels/in_place_copies.py``). The same update.
    """
    if not isinstance(optimizer, FusedOptimizer):
        raise TypeError(f"optimizer must be a FusedOptimizer (tiered_tbe.optimizers), got {type(optimizer).__name__}")
    if step < 1:
        raise ValueError(f"step is 1-based, got {step}")
    mode = pooling_code(pooling)
    check_lookups(stores, lookups, slot_of_index)
    grad_output = check_grad_output(grad_output, stores, lookups, mode)
    if lookups.num_lookups == 0 or lookups.batch_size == 0:
        if then is not None:
            then.enqueue(to_device(then.inputs, grad_output.device))
        return
    if pad is None:  # and only where the batch's size changed: one of the size before it needs no padding
        pad = pads_batches(graphs, grad_output.device, mode) and size_changed(graphs, (lookups.num_lookups,
                                                                                       lookups.batch_size))
    pad = bool(pad) and sorted_lookups is None
    if pad and mode == POOLING_NONE:
        raise ValueError("pooling none's gradient rows are its lookups': its batch cannot be padded")
    if sorted_lookups is None:
        lookups = without_unread_inputs(lookups, presorted)
    reads_copies = uses_copies(copies, slot_of_index is not None and stores.uses_cache)
    ranks = copies.rank if reads_copies else None
    if pad:  # grad_output keeps its B rows: the padding's bags are empty, so no kernel reads a row past B.
        # A batch of a padded size already takes the same launches (and graph) as the ones padded to it.
        lookups = pad_bags(lookups, stores.num_features, padded_batch_size(lookups.batch_size), laid_out=True)
        lookups, slot_of_index, presorted, ranks = pad_batch(stores, lookups, slot_of_index, presorted,
                                                             padded_size(lookups.num_lookups), ranks)
    block_d = stores.block_d
    config = config or default_config(block_d)
    if not 2 <= config.chunk <= 1024 or config.chunk & (config.chunk - 1):
        raise ValueError(f"config.chunk must be a power of two in [2, 1024], got {config.chunk}")
    if config.tiles < 1:
        raise ValueError(f"config.tiles must be at least 1, got {config.tiles}")
    hyper = tuple(float(value) for value in optimizer.kernel_hyper())
    rounds_stochastically = bool(stochastic_rounding) and stores.weights_dtype != torch.float32
    plan = _UpdatePlan(
        mode=mode, batch_size=lookups.batch_size, grad_output_stride=grad_output.stride(0),
        grad_align_bytes=row_slice_alignment_bytes(grad_output, stores), block_d=block_d, config=config,
        use_cache=slot_of_index is not None and stores.uses_cache, optimizer_triton=optimizer.TRITON,
        num_hyper=len(hyper),
        stochastic_rounding=rounds_stochastically,
        reads_step=rounds_stochastically or optimizer.USES_STEP, padded=pad, reads_copies=reads_copies)
    copy_rows = copies.rows if reads_copies else stores.cache_weights  # the kernels' argument, read if reads_copies
    # The step is read by stochastic rounding and by the optimizers whose update reads it (Adam's
    # bias corrections), and passed only then: otherwise a replay's arguments stay the same from
    # step to step. When passed, the graph advances it on the device after the step's kernels
    # (advance_step_kernel), and the next replay finds it there: no copy either way.
    inputs = (lookups.indices, lookups.offsets, lookups.per_sample_weights, lookups.global_rows,
              lookups.bag_of_index, slot_of_index if plan.use_cache else None,
              step_arguments(grad_output, hyper, seed if plan.stochastic_rounding else 0,
                             step if plan.reads_step else 0),
              ranks, *(presorted or (None, None)))

    update_inputs = len(inputs)
    if then is not None:
        inputs = (*inputs, *then.inputs)

    def enqueue(tensors):
        _enqueue_update(plan, stores, *tensors[:update_inputs], copy_rows=copy_rows, sorted_lookups=sorted_lookups)
        if then is not None:
            then.enqueue(tensors[update_inputs:])

    if graphs is None or sorted_lookups is not None:
        enqueue(to_device(inputs, grad_output.device))
    else:
        # The copy rows are the module's, one buffer for every batch: their address is part of the graph's key.
        graphs.run((plan, id(stores), copy_rows.data_ptr(), None if then is None else then.key), inputs, enqueue,
                   grad_output.device,
                   advance=advance_step_arguments if plan.reads_step else None)


class _RowUpdateLaunch(NamedTuple):
    """One launch of ``_row_update_kernel``: over every run, or over a column group's runs."""

    block_d: int  # BLOCK_D
    rows: int  # ROWS
    grouped: bool  # GROUPED
    groups: tuple  # (runs_end, run_shift, group_begin, group_end): plan_run_groups' and the group's entries
    table_steps: int  # TABLE_STEPS


def updates_per_group(stores: RowStores) -> bool:
    """Whether the row-update kernel launches once per column group of the stores' tables: where they
    have several, unless ``TIERED_TBE_BACKWARD_ONE_LAUNCH=1`` (one launch over every run at the widest
    dim's column tile, as before the groups: measurements side by side)."""
    return stores.table_groups is not None and os.environ.get("TIERED_TBE_BACKWARD_ONE_LAUNCH", "0") != "1"


def _row_update_launches(stores: RowStores, s: SortedLookups, config: BackwardConfig) -> list[_RowUpdateLaunch]:
    """The row-update launches of a batch: one per column group of the stores' tables (their grouped runs
    planned on the device, ``kernels/run_groups.py``), each with tiles of runs of its own width (``config``'s
    runs a tile scaled to the group's columns, at most 16), or one over every run."""
    if not updates_per_group(stores):
        dummy = s.run_end[:1]  # never read
        return [_RowUpdateLaunch(stores.block_d, config.rows, False, (dummy, dummy, 0, 1), 1)]
    groups = stores.table_groups
    runs_end, run_shift = plan_run_groups(groups, s.sorted_rows, s.run_count, s.num_runs)
    table_steps = max(1, groups.tables.numel().bit_length())
    launches, begin = [], 0
    for block_d, end in zip(groups.block_ds, groups.ends):
        rows = max(1, min(16, config.rows * stores.block_d // block_d))
        launches.append(_RowUpdateLaunch(block_d, rows, True, (runs_end, run_shift, begin, end), table_steps))
        begin = end
    return launches


def without_unread_inputs(lookups: Lookups, presorted: tuple[torch.Tensor, torch.Tensor] | None) -> Lookups:
    """``lookups`` without what the update never reads, so that its graph does not copy it in (nor a padded
    batch pad it): the indices once the batch comes linearized (``global_rows`` and ``bag_of_index``: only
    ``linearize`` reads them), the global rows when ``presorted`` stands for their sort. Each is a copy of N
    entries a step: on the Criteo tables (1.7M lookups) ~20 MB of the ~0.09 ms of device-to-device copies a
    cached step made (H200, results/measurements.jsonl)."""
    if lookups.global_rows is not None and lookups.bag_of_index is not None:
        lookups = lookups._replace(indices=None)
        if presorted is not None:
            lookups = lookups._replace(global_rows=None)
    return lookups


def _enqueue_update(plan: _UpdatePlan, stores: RowStores, indices, offsets, per_sample_weights, global_rows,
                    bag_of_index, slot_of_index, step_args, in_place_rank=None, sorted_rows=None, order=None,
                    copy_rows=None, sorted_lookups: SortedLookups | None = None) -> None:
    """Enqueue the backward's launches. Reads the batch only through its arguments (``step_args``:
    grad_output's address, the step, the hyper-parameters), so a CUDA graph of it serves every
    batch of its shape."""
    lookups = Lookups(indices, offsets, plan.batch_size, per_sample_weights, global_rows, bag_of_index)
    num_lookups = lookups.num_lookups
    device = offsets.device
    config, block_d = plan.config, plan.block_d
    chunk = config.chunk
    has_per_sample_weights = per_sample_weights is not None
    need_order = has_per_sample_weights or plan.use_cache or plan.mode == POOLING_NONE
    s = sorted_lookups or sort_lookups(stores, lookups, None if sorted_rows is None else (sorted_rows, order),
                                       need_order=need_order, padded=plan.padded)
    hyper = hyper_view(step_args, plan.num_hyper)
    load_state, update, store_state = plan.optimizer_triton
    common = dict(POOLING=plan.mode, HAS_PER_SAMPLE_WEIGHTS=has_per_sample_weights, ALIGN=stores.alignment,
                  GRAD_ALIGN_BYTES=plan.grad_align_bytes, SHARED_TABLES=stores.shares_tables, CHUNK=chunk,
                  BLOCK_D=block_d)
    updating = dict(USE_CACHE=plan.use_cache, OPTIMIZER_LOAD_STATE=load_state, OPTIMIZER_UPDATE=update,
                    OPTIMIZER_STORE_STATE=store_state, STOCHASTIC_ROUNDING=plan.stochastic_rounding,
                    NUM_HYPER=plan.num_hyper, ALIGN_BYTES=stores.alignment * stores.weights_dtype.itemsize,
                    STATE_ALIGN_BYTES=4 * stores.state_alignment)
    order = s.order if s.order is not None else s.sorted_bags  # then never read: pooled, no weights, no slots
    # Per-sample weights and slots by sorted position, gathered once (no dependent load in the kernels).
    sorted_weights = per_sample_weights[order] if has_per_sample_weights else hyper
    sorted_slots = slot_of_index[order] if plan.use_cache else s.run_end
    sorted_ranks = in_place_rank[order] if plan.reads_copies else sorted_slots
    if copy_rows is None:
        copy_rows = stores.cache_weights
    copy_args = (sorted_ranks, copy_rows, copy_rows.stride(0), copy_rows.shape[0])
    gradient_args = (order, s.sorted_bags, sorted_weights, offsets, step_args, plan.grad_output_stride,
                     stores.descriptor)
    update_args = (s.sorted_rows, sorted_slots, stores.cache_weights, stores.cache_weights.stride(0),
                   stores.cache_state, stores.cache_state.stride(0), hyper)

    num_windows = triton.cdiv(num_lookups, chunk)
    window_sums = torch.empty(num_windows, block_d, dtype=torch.float32, device=device)
    hot_window_sums_kernel[(triton.cdiv(num_windows, config.sum_windows),)](
        window_sums, s.run_count, *gradient_args, s.sorted_rows, stores.num_rows, num_lookups, plan.batch_size,
        **common, WINDOWS=config.sum_windows,
        num_warps=config.sum_warps)
    group = HOT_GROUP
    num_groups = triton.cdiv(num_windows, group)
    group_sums = torch.empty(num_groups, block_d, dtype=torch.float32, device=device)
    hot_group_sums_kernel[(num_groups,)](group_sums, window_sums, s.run_count, num_lookups, CHUNK=chunk, GROUP=group,
                                          BLOCK_D=block_d, num_warps=4)
    hot_row_update_kernel[(triton.cdiv(num_windows, config.hot_windows),)](
        window_sums, group_sums, s.run_count, s.run_end, *gradient_args, *update_args, *copy_args, stores.num_rows,
        num_lookups, plan.batch_size, **common, **updating, READS_COPIES=plan.reads_copies, GROUP=group,
        WINDOWS=config.hot_windows,
        BLOCK_P=8 if INTERPRETING else 32, BLOCK_L=HOT_LANES, num_warps=4)
    for launch in _row_update_launches(stores, s, config):
        _row_update_kernel[(triton.cdiv(triton.cdiv(num_lookups, launch.rows), config.tiles),)](
            s.num_runs, s.run_end, *gradient_args, *update_args, *copy_args, stores.num_rows, *launch.groups,
            num_lookups, plan.batch_size,
            **dict(common, BLOCK_D=launch.block_d), **updating, READS_COPIES=plan.reads_copies, ROWS=launch.rows,
            BLOCK_L=config.lanes,
            num_warps=config.num_warps, GROUPED=launch.grouped, TABLE_STEPS=launch.table_steps)
    if plan.reads_step and step_args.is_cuda and torch.cuda.is_current_stream_capturing():
        # The step's arguments one step on, in place, after every kernel that reads them: a graph's next
        # replay finds the next step's there, and its host-to-device copy is skipped (StepGraphs' advance).
        # Run eagerly, the arguments are a fresh copy each step: nothing to advance.
        advance_step_kernel[(1,)](step_args)
