"""``TieredEmbeddingBags``: the nn.Module users train with."""

from __future__ import annotations

from collections import deque

import torch
from torch import nn

from tiered_tbe import validation
from tiered_tbe.backends import backend_named
from tiered_tbe.base import streams
from tiered_tbe.base.codes import INT32_MAX
from tiered_tbe.base.graphs import PADDED_GRAPHS, StepGraphs, padded_size
from tiered_tbe.base.mode import default_device
from tiered_tbe.base.padded_inputs import padded_input
from tiered_tbe.batch import CopyRows, DeferredUnlocks, PreparedBatch
from tiered_tbe.cache.mover import default_mover
from tiered_tbe.cache.slot_cache import SlotCache
from tiered_tbe.fbgemm_access import FbgemmAccess
from tiered_tbe.function import TieredEmbeddingBagsFunction
from tiered_tbe.kernels.linearize import linearize
from tiered_tbe.kernels.rows import Lookups, no_cache
from tiered_tbe.memory import check_memory, device_free_bytes, plan_cache
from tiered_tbe.optimizers import FusedOptimizer
from tiered_tbe.prefetch_queue import PrefetchQueue
from tiered_tbe.specs import CacheConfig, TableSpec
from tiered_tbe.storage import lay_out, resolve_state_layout
from tiered_tbe.table_state import TableState
from tiered_tbe.variable_batch import VariableBatch, fixed_batch_offsets

_WEIGHTS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class TieredEmbeddingBags(PrefetchQueue, TableState, FbgemmAccess, nn.Module):
    """Pooled embedding lookups over tables in HBM, host memory, managed memory or a GPU cache.

    Args:
        tables: one :class:`TableSpec` per table (name, rows, dim, placement).
        feature_table_map: FBGEMM's: ``feature_table_map[f]`` is the table feature ``f`` looks up,
            for ``F`` features in the order of the batch's bags (several features may look up one
            table, e.g. ``[0, 0, 1]``: the user's and the item's history in one id table; every
            table needs a feature). Default: feature ``t`` is table ``t``. A row has one identity
            whichever feature names it: its gradients from every feature of a batch are summed
            before its one fused update, and the cache holds it once. ``state_dict`` stays per table.
        pooling: ``"sum"``, ``"mean"`` or ``"none"`` (all tables must share one dim).
        optimizer: a fused optimizer of :mod:`tiered_tbe.optimizers` (``SGD``, ``RowwiseAdagrad``,
            ``Adagrad``, ``Adam``, ``PartialRowwiseAdam``, ``LAMB``; applied once per unique row per
            step in the backward) or None (tables frozen).
        weights_dtype: float32, float16 or bfloat16 storage; arithmetic is fp32.
        device: where kernels run; defaults to cuda when present, else cpu (simulation).
        cache: :class:`CacheConfig` of the slot cache shared by the ``*_CACHED`` tables.
        bounds_check: ``"raise"`` (validate every batch: a bad one raises, naming table, position and
            value; one host sync per forward), ``"warn"`` (as FBGEMM's default ``WARNING``: offsets
            clamped into order and an index outside its table replaced by row 0, on the device, with
            no host sync; :meth:`bounds_check_repairs` counts them) or ``"off"`` (no check: an index
            outside its table reads another table's row, or memory outside every table).
        stochastic_rounding: round fp16/bf16 updates stochastically instead of to nearest.
        seed: seeds the weight initialisation and stochastic rounding.
        backend: ``"triton"`` (the kernels) or ``"torch"`` (their plain-torch reference; see
            :mod:`tiered_tbe.backends`).
        nan_check: ``"off"`` (default) or ``"raise"``: before each fused update, check that the
            gradient of the output and the per-sample weights are finite; NaN or inf refuses the
            update (every row stays as it was, the batch's locks are released) with a ValueError
            naming the tensor, the position and the table. Costs a pass over the gradient and one
            host sync per backward. Off, a NaN reaches the rows it touches.
        state_layout: where each row's optimizer state lives outside the slot cache: ``"separate"``
            (a state buffer beside the weights buffer, in the same memory, as FBGEMM's TBE),
            ``"device"`` (the state buffers of host and managed tables in device memory: a row the
            cache moves crosses the bus without its state), ``"with_rows"`` (right after the row's
            weights, rows padded to 16 bytes, as FBGEMM's SSD TBE offloads optimizer state) or
            ``"auto"`` (default): ``"device"`` for a row-wise state (row-wise Adagrad's one float a
            row) that takes at most a quarter of the free device memory, unless the staged mover
            reads it; ``"separate"`` otherwise. The same training in every layout, bit for bit
            (``tiered_tbe/storage.py``); ``self.state_layout`` is the one chosen.
        cuda_graphs: on a GPU, replay each batch shape's forward and backward (and the cache's prefetch, with
            the zero-copy mover) as one CUDA graph (captured on the shape's second batch, without
            waiting for the device; bit-identical to running its launches one by one;
            ``base/graphs.py``). ``TIERED_TBE_CUDA_GRAPHS=0`` turns it off too.

    Forward: ``indices`` (int32/int64 [N]) and ``offsets`` (int32/int64 [F*B+1]) in FBGEMM's
    TBE layout, feature-major (``F`` = the features, the tables by default; bag ``f * B + b`` is
    sample ``b`` of feature ``f``; ``indices`` are rows of the feature's table), optional
    ``per_sample_weights`` (float [N]). Returns fp32 ``[B, sum over features of their tables'
    dims]``, the features' columns side by side in order (``pooling="none"``: ``[N, dim]``).

    Example (two features of one table, then a second table)::

        emb = TieredEmbeddingBags([TableSpec(1000, 16, name="ids"), TableSpec(50, 8, name="country")],
                                  feature_table_map=[0, 0, 1], optimizer=SGD(lr=0.1))
        # B = 2: bags [f0 b0, f0 b1, f1 b0, f1 b1, f2 b0, f2 b1]
        out = emb(torch.tensor([3, 4, 3, 7, 999, 1]), torch.tensor([0, 1, 2, 3, 5, 5, 6]))  # [2, 16 + 16 + 8]
    With ``batch_size_per_feature_per_rank`` (``[F][R]`` ints: TorchRec's variable batch size per feature,
    "VBE") ``offsets`` has ``sum(batch sizes) + 1`` entries, each feature's bags rank by rank, and the
    output is FBGEMM's flat VBE layout, rank by rank, then feature by feature (:mod:`tiered_tbe.variable_batch`).

    FBGEMM's accessors (``split_embedding_weights``, ``get_optimizer_state``, the learning rate and
    the other hyper-parameters, the optimizer step, ``reset_cache_states``) are in
    :class:`~tiered_tbe.fbgemm_access.FbgemmAccess`.
    """

    def __init__(
        self,
        tables: list[TableSpec],
        pooling: str = "sum",
        optimizer: FusedOptimizer | None = None,
        weights_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        cache: CacheConfig | None = None,
        bounds_check: str = "raise",
        stochastic_rounding: bool = False,
        seed: int = 0,
        backend: str = "triton",
        nan_check: str = "off",
        cuda_graphs: bool = True,
        state_layout: str = "auto",
        feature_table_map: list[int] | None = None,
    ):
        super().__init__()
        if not tables:
            raise ValueError("TieredEmbeddingBags needs at least one TableSpec")
        if pooling not in ("sum", "mean", "none"):
            raise ValueError(f"pooling must be 'sum', 'mean' or 'none', got {pooling!r}")
        if pooling == "none" and len({s.embedding_dim for s in tables}) > 1:
            dims = {s.name or f"table_{t}": s.embedding_dim for t, s in enumerate(tables)}
            raise ValueError(f"pooling='none' needs one embedding_dim for all tables, got {dims}")
        if weights_dtype not in _WEIGHTS_DTYPES:
            raise ValueError(f"weights_dtype must be one of {_WEIGHTS_DTYPES}, got {weights_dtype}")
        if bounds_check not in validation.BOUNDS_CHECKS:
            raise ValueError(f"bounds_check must be one of {validation.BOUNDS_CHECKS}, got {bounds_check!r}")
        if nan_check not in validation.NAN_CHECKS:
            raise ValueError(f"nan_check must be one of {validation.NAN_CHECKS}, got {nan_check!r}")
        names = [s.name or f"table_{t}" for t, s in enumerate(tables)]
        if len(set(names)) != len(names):
            raise ValueError(f"table names must be unique, got {names}")
        features = _check_feature_table_map(feature_table_map, names)
        if optimizer is not None and not isinstance(optimizer, FusedOptimizer):
            raise TypeError(f"optimizer must be one of tiered_tbe.optimizers (e.g. RowwiseAdagrad(lr=0.01)), got "
                            f"{type(optimizer).__name__}")
        self.backend = backend_named(backend)
        self.tables = list(tables)
        self.table_names = names
        self.feature_table_map = features  # the table of each feature
        # None where each feature is its table: validation then speaks of tables only, as it always did.
        self._features_if_shared = None if features == list(range(len(tables))) else features
        self.pooling = pooling
        self.optimizer = optimizer
        self.weights_dtype = weights_dtype
        self.device = torch.device(device) if device is not None else default_device()
        self.bounds_check = bounds_check
        # Indices and offsets bounds_check="warn" repaired so far, counted on the device (no sync).
        self._bounds_repairs = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.nan_check = nan_check
        # Stochastic rounding changes fp16 / bf16 updates only (fp32 ones are exact): asked of the plain-torch
        # backend, which rounds to nearest, it is refused here rather than at the first backward.
        self.stochastic_rounding = bool(stochastic_rounding) and weights_dtype != torch.float32
        if self.stochastic_rounding and not self.backend.rounds_stochastically:
            raise ValueError(f"backend={backend!r} rounds to nearest only: use backend='triton' for stochastic "
                             f"rounding of {str(weights_dtype).removeprefix('torch.')} weights, or "
                             f"stochastic_rounding=False")
        self.seed = seed
        self.optimizer_step = 0
        # CUDA graphs of the forward and the backward, per batch shape (the triton backend only). The
        # forward is one launch, but Triton's launch path took 2-3 times the host time of a replay:
        # its kernels (0.11 ms at big Zipf) ended before its host part did (results/measurements.jsonl, 2026-12-03).
        # Batches whose size changes every step are padded to a few shapes (kernels/grouping.pads_batches): as
        # many graphs as the prefetch keeps. A model of one batch shape captures one; a backward graph holds
        # its padded size's sort buffers and window sums, a forward graph nothing.
        graphs_enabled = None if cuda_graphs else False  # None: on where a GPU runs the compiled kernels
        self._forward_graphs, self._backward_graphs = (
            (StepGraphs(PADDED_GRAPHS, enabled=graphs_enabled), StepGraphs(PADDED_GRAPHS, enabled=graphs_enabled))
            if self.backend.name == "triton" else (None, None))
        # ... and of a lookahead hint's rows (rows_for_hint, kernels/hint_rows.py: the reference's ~30 torch
        # ops took 2.6-4 ms of host time a batch enqueued one by one on the H200 machine), padded the same way.
        self._hint_graphs = StepGraphs(PADDED_GRAPHS, enabled=graphs_enabled)

        state_width = [optimizer.state_width(s.embedding_dim) if optimizer else 0 for s in tables]
        cached = [t for t, s in enumerate(tables) if s.placement.is_cached]
        if cache is not None and not cached:
            raise ValueError("cache= was given but no table has a *_CACHED placement")
        plan = plan_cache(tables, state_width, weights_dtype, cache or CacheConfig()) if cached else None
        mover = (plan.config.mover or default_mover(tables[t].placement for t in cached)) if plan else None
        self.state_layout = resolve_state_layout(
            state_layout, optimizer is not None and optimizer.state_is_row_wise(),
            tables, state_width, mover, device_free_bytes(self.device) if self.device.type == "cuda" else None)
        check_memory(tables, state_width, weights_dtype, self.state_layout, self.device, plan)  # before allocating
        generator = torch.Generator(device=self.device).manual_seed(seed)
        initial_state = optimizer.initial_state() if optimizer is not None else 0.0
        self.storage = lay_out(tables, state_width, weights_dtype, self.device, generator, initial_state,
                               self.state_layout)

        # The prefetch then sorts every lookup by its row, as the backward would (_apply_update).
        self._every_table_cached = len(cached) == len(tables)
        self.cache: SlotCache | None = None
        self._copy_rows: CopyRows | None = None
        if plan is not None:
            config = plan.config
            self.cache = SlotCache(
                tables=self.storage.cached_tables(),
                num_slots=plan.num_slots,
                associativity=config.associativity,
                policy=config.policy,
                lfu_decay_interval=config.lfu_decay_interval,
                row_width=plan.row_width,
                state_width=plan.state_width,
                weights_dtype=weights_dtype,
                device=self.device,
                mover=mover,
                mover_threads=config.mover_threads,
                staging_rows=config.staging_rows,
                cuda_graphs=cuda_graphs,
            )
            cache_weights, cache_state = self.cache.weights, self.cache.state
            # Where a training forward copies the rows it reads in place, for its backward.
            self._copy_rows = CopyRows(torch.empty(plan.copy_rows, cache_weights.shape[1], dtype=weights_dtype,
                                                   device=self.device), self.cache) if plan.copy_rows else None
        else:
            cache_weights, cache_state = no_cache(weights_dtype, self.device)
        self.row_stores = self.storage.row_stores(cache_weights, cache_state, features)
        # Per feature: the rows of its table and the global row of the table's row 0.
        self._num_rows_of_feature = torch.tensor(
            [tables[t].num_embeddings for t in features], dtype=torch.int64, device=self.device
        )
        self._row_offset = torch.tensor([self.storage.row_offset[t] for t in features], dtype=torch.int64,
                                        device=self.device)
        self._prefetched: deque[tuple[torch.Tensor, torch.Tensor, PreparedBatch]] = deque()
        self._deferred_unlocks = DeferredUnlocks()  # of the batches prefetched with defer_unlock
        # An empty leaf that requires grad, so autograd calls backward (the fused update).
        self._grad_anchor = torch.empty(0, device=self.device, requires_grad=True)

    # ---------------------------------------------------------------- batches
    def _prepare(self, indices: torch.Tensor, offsets: torch.Tensor, ahead: bool = False) -> PreparedBatch:
        """Validate, linearize and prefetch one batch (steps 1-3 of a training step).

        ``ahead``: the batch is prefetched before its forward; the verdict of the value checks
        is read at that forward (see :mod:`tiered_tbe.validation`), so nothing here waits for
        the GPU. Until then the batch only moves rows into the cache (no value changes).
        """
        batch_size = validation.check_static(self.tables, indices, offsets, self.device, self._features_if_shared)
        value_check = None
        if self.bounds_check == "off":
            if self.cache is None:
                # Nothing to check or prefetch: the kernels read int32 or int64 indices and offsets as
                # they come, and the backward linearizes the batch itself. No kernel runs here.
                return PreparedBatch(Lookups(indices, offsets, batch_size), None, None)
            # The cache needs each lookup's global row: one linearize launch (kernels/linearize.py)
            # instead of a searchsorted over the offsets and five elementwise ops. Unchecked, as
            # bounds_check="off" says: an index outside its table names another table's row. int32
            # rows where they fit: the backward sorts them as they are, and every copy is half the bytes.
            key_dtype = torch.int32 if self.row_stores.num_rows <= INT32_MAX else torch.int64
            lookups = linearize(self.row_stores, Lookups(indices, offsets, batch_size), key_dtype=key_dtype)
        else:
            indices = indices.long()
            offsets = offsets.long()
            if self.bounds_check == "warn":  # repaired on the device (FBGEMM's WARNING): nothing to wait for
                offsets, offset_repairs = validation.repair_offsets(offsets, indices.numel())
            bag_of_index = self._bag_of_index(indices, offsets)
            feature_of_index = self._feature_of_index(bag_of_index, batch_size)
            if self.bounds_check == "warn":
                indices, index_repairs = validation.repair_indices(indices, feature_of_index,
                                                                   self._num_rows_of_feature)
                self._bounds_repairs += offset_repairs + index_repairs  # read by bounds_check_repairs()
            else:
                value_check = validation.start_value_check(
                    self.tables, indices, offsets, feature_of_index, self._num_rows_of_feature, batch_size,
                    self._features_if_shared
                )
                if not ahead:
                    value_check.raise_if_bad()  # before any lock: bad input changes nothing
                    value_check = None
            # A batch prefetched ahead may be malformed (its verdict is read at its forward): each lookup's
            # feature is clamped into range above, so nothing here indexes out of bounds; an index outside its
            # table names another table's row or none (the cache leaves rows outside its tables alone), and
            # the prefetch only moves rows into the cache. The forward raises before any value changes.
            global_rows = self._row_offset[feature_of_index] + indices
            lookups = Lookups(indices, offsets, batch_size, global_rows=global_rows, bag_of_index=bag_of_index)
            if self.cache is None:
                return PreparedBatch(lookups, None, None, value_check=value_check)
        # Batches finished since the last prefetch free their slots first (in the prefetch's graph).
        cache_batch = self._prefetch_unlocking_deferred(lookups.global_rows)
        return PreparedBatch(lookups, cache_batch.slot_of_index, self.cache, cache_batch, value_check=value_check)

    def bounds_check_repairs(self) -> int:
        """How many indices and offsets ``bounds_check="warn"`` has repaired since the module was
        made (0 with the other modes). Reading it is a host sync."""
        return int(self._bounds_repairs.item())

    def _bag_of_index(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """int32 [N]: the bag (f*B + b) of each lookup; empty bags are skipped by searchsorted."""
        positions = torch.arange(indices.numel(), device=self.device)
        return torch.searchsorted(offsets, positions, right=True, out_int32=True) - 1

    def _feature_of_index(self, bag_of_index: torch.Tensor, batch_size: int) -> torch.Tensor:
        """[N], the dtype of ``bag_of_index``: the feature of each lookup, clamped into ``[0, F)``: with malformed
        offsets (``offsets[0] > 0``, ``offsets[-1] < N``, decreasing) a lookup's bag can fall outside the batch."""
        return (bag_of_index // max(batch_size, 1)).clamp_(0, len(self.feature_table_map) - 1)

    @streams.on_own_device
    def rows_for_hint(self, indices: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The distinct global rows of a batch not yet validated, for :meth:`hint_upcoming`.

        Returns ``(rows, count)``: ``rows`` int64 [``padded_size(N)``] holds the batch's ``count``
        distinct global rows in ascending order, then ``INT64_MAX`` padding (rows a hint ignores);
        ``count`` is an int64 device scalar (read it when convenient: nothing here waits for
        the GPU). ``rows[:count]`` is the same hint, shorter. Out-of-range indices are clamped
        into their tables and lookups outside every bag are left out: that can only make a hint
        less exact, never a result wrong (values are checked at the batch's prefetch)."""
        batch_size = max(validation.check_static(self.tables, indices, offsets, self.device,
                                                 self._features_if_shared), 1)
        # Shaped by the padded lookup count and the feature count only, so that batches whose bag
        # lengths and batch size change every step replay a few graphs: eager, a ragged batch's hint
        # cost its prefetch ~5 ms of host time on the H200 machine (docs/performance.md).
        indices = padded_input(indices, padded_size(indices.numel()), 0)  # padding lies past the last bag: left out
        feature_starts = offsets[::batch_size]  # [F + 1]: where each feature's lookups start, then the end

        def enqueue(tensors):
            indices, feature_starts = (t.contiguous() for t in tensors)  # (offsets[::B] is strided; a graph's are not)
            return self.backend.hint_rows(indices, feature_starts, self._num_rows_of_feature, self._row_offset,
                                          self.row_stores.num_rows)

        return self._hint_graphs.run("hint rows", (indices, feature_starts), enqueue, self.device)

    @streams.on_own_device
    def prefetch(self, indices: torch.Tensor, offsets: torch.Tensor, forward_stream: torch.cuda.Stream | None = None,
                 batch_size_per_feature_per_rank: list[list[int]] | None = None, *, defer_unlock: bool = False) -> None:
        """Fill the cache for a batch ahead of its forward (FBGEMM's and TorchRec's signature).

        Batches queue in order: the next forward called with these same ``indices`` and
        ``offsets`` tensors (or views of the same ``indices`` memory with as many offsets: TorchRec
        splits its KeyedJaggedTensor anew for the forward) uses this prefetch instead of
        prefetching itself. ``batch_size_per_feature_per_rank``: a variable-batch input (see the
        class docstring); give the forward the same.

        ``forward_stream``: the prefetch runs on the current stream for a forward on that one
        (TorchRec's prefetch pipeline). The forward waits for the prefetch by an event, and the
        batch's unlock is deferred, as with ``defer_unlock``. A forward of a batch prefetched
        later releases such batches still queued before it (their pipeline was stopped early).

        ``defer_unlock``: the batch's unlock waits for the next prefetch (which runs it first, on
        its own stream) instead of running where the batch's backward runs. A pipeline that
        prefetches on a side stream asks for it, so that unlocks and prefetches never run side by
        side and backwards need not wait for prefetches (see :class:`PreparedBatch`).
        """
        layout = self._variable_batch(batch_size_per_feature_per_rank)
        batch = self._prepare(indices, fixed_batch_offsets(offsets, layout), ahead=True)
        if self.device.type == "cuda":
            batch.ready = streams.record(torch.cuda.Event(), self.device)
        if defer_unlock or forward_stream is not None:
            batch.deferred = self._deferred_unlocks
        batch.for_forward_stream = forward_stream is not None
        self._prefetched.append((indices, offsets, batch))

    def _variable_batch(self, batch_size_per_feature_per_rank) -> VariableBatch | None:
        """The layout of a variable-batch input, or None for a fixed batch."""
        if batch_size_per_feature_per_rank is None:
            return None
        if self.pooling == "none":
            raise ValueError("batch_size_per_feature_per_rank needs pooled outputs (pooling 'sum' or 'mean'), "
                             "as FBGEMM's variable batch size")
        return VariableBatch(batch_size_per_feature_per_rank,
                             [self.tables[t].embedding_dim for t in self.feature_table_map], self.device)

    @streams.on_own_device
    def forward(self, indices: torch.Tensor, offsets: torch.Tensor, per_sample_weights=None,
                batch_size_per_feature_per_rank: list[list[int]] | None = None) -> torch.Tensor:
        layout = self._variable_batch(batch_size_per_feature_per_rank)
        if layout is not None:
            layout.check_offsets(offsets)
        if per_sample_weights is not None:
            # Checked before the batch is prefetched: a bad call locks nothing, and a batch prefetched
            # for these tensors goes with it, as one whose value check fails at its forward does.
            try:
                if layout is None:
                    validation.check_static(self.tables, indices, offsets, self.device, self._features_if_shared)
                validation.check_per_sample_weights(per_sample_weights, indices.numel(), self.device)
            except ValueError:
                self.drop_prefetched(indices, offsets)
                raise
        batch = self._take_prefetched(indices, offsets)
        batch = batch or self._prepare(indices, fixed_batch_offsets(offsets, layout))
        kernel_offsets = offsets.numel() if layout is None else len(layout.feature_dims) * layout.batch_size + 1
        if batch.lookups.offsets.numel() != kernel_offsets:  # prefetched with other batch sizes, or none
            batch.release()
            raise ValueError("forward and the prefetch of its batch got different batch_size_per_feature_per_rank: "
                             "give both the same (None for a fixed batch)")
        pooled = self._pooled_forward(batch, per_sample_weights)
        return pooled if layout is None else layout.gather_output(pooled)

    def _pooled_forward(self, batch: PreparedBatch, per_sample_weights) -> torch.Tensor:
        """The kernels' forward of a prepared batch (an autograd node when a backward will come)."""
        if per_sample_weights is not None:
            batch.lookups = batch.lookups._replace(per_sample_weights=per_sample_weights.detach())
        grad_enabled = torch.is_grad_enabled()
        psw_needs_grad = grad_enabled and per_sample_weights is not None and per_sample_weights.requires_grad
        if not grad_enabled or (self.optimizer is None and not psw_needs_grad):
            # No backward will come (evaluation, frozen tables): release the locks now.
            try:
                return self.backend.forward(self.row_stores, batch.lookups, batch.slot_of_index, self.pooling,
                                            graphs=self._forward_graphs)
            finally:
                batch.release()
        try:
            return TieredEmbeddingBagsFunction.apply(
                self, batch, self._grad_anchor, per_sample_weights if psw_needs_grad else None
            )
        except BaseException:
            batch.release()  # no backward will come for a forward that failed
            raise

    # ---------------------------------------------------------------- backward
    def _apply_update(self, grad_output: torch.Tensor, batch: PreparedBatch) -> None:
        optimizer = self.optimizer
        slot_of_index = batch.slot_of_index
        copies = self._copy_rows.for_backward(batch) if self._copy_rows is not None else None
        if optimizer is not None:
            self.optimizer_step += 1
            # With every table cached the prefetch's stable sort of the lookups has the backward's
            # keys (the rows): the backward groups the lookups from it instead of sorting again.
            cache_batch = batch.cache_batch
            presorted = (cache_batch.sorted_rows, cache_batch.order) \
                if self._every_table_cached and cache_batch is not None else None
            # The batch's unlock (or dirty marks) runs in the update's graph: one replay, not two.
            release = batch.release_launches(updated=True)
            self.backend.backward_update(grad_output, self.row_stores, batch.lookups, slot_of_index, self.pooling,
                                         optimizer, self.optimizer_step, stochastic_rounding=self.stochastic_rounding,
                                         seed=self.seed, graphs=self._backward_graphs, presorted=presorted,
                                         then=release, copies=copies)
            batch.release(updated=True, launched=release is not None)
        else:
            batch.release()

    def extra_repr(self) -> str:
        lines = [f"pooling={self.pooling!r}, optimizer={self.optimizer}, weights_dtype={self.weights_dtype}"]
        if self._features_if_shared is not None:
            lines.append(f"feature_table_map={self.feature_table_map}")
        for name, spec in zip(self.table_names, self.tables):
            lines.append(f"{name}: {spec.num_embeddings} x {spec.embedding_dim}, {spec.placement.value}")
        return "\n".join(lines)


def _check_feature_table_map(feature_table_map, table_names: list[str]) -> list[int]:
    """The table of each feature (default: feature t is table t); ValueError naming the entry or table
    that is wrong. Every table needs a feature, as in FBGEMM's TBE."""
    num_tables = len(table_names)
    if feature_table_map is None:
        return list(range(num_tables))
    features = list(feature_table_map)
    if not features:
        raise ValueError("feature_table_map is empty: give the table of each feature, e.g. [0, 0, 1]")
    for f, t in enumerate(features):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < num_tables:
            raise ValueError(f"feature_table_map[{f}] = {t!r} names no table: the module has {num_tables} tables "
                             f"(0..{num_tables - 1})")
    unused = [t for t in range(num_tables) if t not in features]
    if unused:
        raise ValueError(f"table {unused[0]} ({table_names[unused[0]]!r}) has no feature in feature_table_map "
                         f"{features}: every table needs one")
    return features
