"""The compute kernel TorchRec's lookups build for one group of a rank's shards: one ``TieredEmbeddingBags``.

``TieredBatchedFusedEmbeddingBag`` stands where TorchRec's ``BatchedFusedEmbeddingBag`` (FBGEMM's
TBE) stands: a ``BaseBatchedEmbeddingBag`` (the shards' layout, ``state_dict`` as sharded
tensors, weight initialisation) and a ``FusedOptimizerModule`` (``model.fused_optimizer``). Its
``emb_module`` is the :class:`~tiered_tbe.TieredEmbeddingBags`, which answers the calls TorchRec
makes of FBGEMM's module (``prefetch``, ``split_embedding_weights``, ``get_optimizer_state``,
learning rate, ``flush``, ``reset_cache_states``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.batched_embedding_kernel import (
    BaseBatchedEmbedding,
    BaseBatchedEmbeddingBag,
    EmbeddingFusedOptimizer,
)
from torchrec.distributed.composable.table_batched_embedding_slice import TableBatchedEmbeddingSlice
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingType
from torchrec.optim.fused import EmptyFusedOptimizer, FusedOptimizer, FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tiered_tbe.base.graphs import to_device
from tiered_tbe.module import TieredEmbeddingBags
from tiered_tbe.specs import TableSpec
from tiered_tbe.torchrec.fused_params import module_arguments, placement_of, pooling_of


def table_specs(config: GroupedEmbeddingConfig) -> list[TableSpec]:
    """One TableSpec per shard of the group: its local rows and columns, placed by its compute kernel.
    Shards of one table on one rank (column-wise) are named ``<table>``, ``<table>#1``, ..."""
    seen: dict[str, int] = {}
    specs = []
    for table in config.embedding_tables:
        count = seen.get(table.name, 0)
        seen[table.name] = count + 1
        specs.append(TableSpec(table.local_rows, table.local_cols, name=table.name if count == 0 else
                               f"{table.name}#{count}", placement=placement_of(table.compute_kernel)))
    return specs


class TieredEmbeddingFusedOptimizer(EmbeddingFusedOptimizer):
    """TorchRec's fused optimizer of one kernel (``EmbeddingFusedOptimizer``), over a TieredEmbeddingBags.

    The optimizer state lives beside each row, in the slot cache too: reading ``state`` (what
    ``state_dict`` and ``load_state_dict`` do) flushes the cache first, so it holds every update;
    after a load wrote the backing stores, the cached copies are dropped.

    A sharded tensor wants contiguous shards, and a row's state is one stretch of memory (Adam's
    ``exp_avg`` and ``exp_avg_sq`` of a row side by side), so ``exp_avg`` of a table is a strided
    view. For such states each read of ``state`` builds the sharded tensors over fresh contiguous
    copies (none is kept between reads: a read costs a copy of the optimizer's states, for the
    time the caller holds them), and ``post_load_state_dict`` writes the copies of the last read,
    which a load filled, back into the rows.
    """

    def __init__(self, config: GroupedEmbeddingConfig, emb_module: TieredEmbeddingBags,
                 pg: dist.ProcessGroup | None = None, **kwargs):
        self._tiered_module = emb_module
        self._interleaved = False  # the base class builds its state with this False
        self._copied: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows' view, copy) of the last read
        self._table_names = [table.name for table in config.embedding_tables]
        states = kwargs.get("all_optimizer_states") or (
            emb_module.get_optimizer_state() if emb_module.optimizer is not None else [])
        interleaved = any(not view.is_contiguous() for state in states for view in state.values())
        self._rebuild = (config, pg, dict(kwargs))
        if interleaved:  # no state at construction (nothing copied): each read builds it
            kwargs["all_optimizer_states"] = [{} for _ in states]
        super().__init__(config, emb_module, pg, **kwargs)
        self._interleaved = interleaved

    def _contiguous_copies(self, states: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """``states`` with each strided view copied to a contiguous tensor (only the tables this optimizer
        keeps: one of them when it was made for one table)."""
        only = self._rebuild[2].get("create_for_table")
        self._copied, copies = [], []
        for name, state in zip(self._table_names, states):
            copies.append({})
            if only is not None and name != only:
                continue
            for key, view in state.items():
                copies[-1][key] = view if view.is_contiguous() else view.contiguous()
                if copies[-1][key] is not view:
                    self._copied.append((view, copies[-1][key]))
        return copies

    @property
    def state(self):
        self._tiered_module.flush()
        if not self._interleaved:
            return self._tiered_state
        config, pg, kwargs = self._rebuild
        fresh = EmbeddingFusedOptimizer(config, self._tiered_module, pg, **dict(
            kwargs, all_optimizer_states=self._contiguous_copies(self._tiered_module.get_optimizer_state())))
        # TorchRec re-keys a kernel's params under its module ("embedding_bags.<table>.weight").
        fresh_by_key = {key: fresh.state[param] for key, param in fresh.params.items()}
        return {param: next(state for fresh_key, state in fresh_by_key.items()
                            if key == fresh_key or key.endswith("." + fresh_key))
                for key, param in self.params.items()}

    @state.setter
    def state(self, value) -> None:
        self._tiered_state = value

    def post_load_state_dict(self) -> None:
        super().post_load_state_dict()
        for view, copy in self._copied:
            view.copy_(copy)
        self._copied = []
        self._tiered_module.reset_cache_states(write_back=False)  # the stores hold what was loaded


class _TieredKernel:
    """What a pooled and a sequence kernel share: one ``TieredEmbeddingBags`` for a group of shards
    (``fused``, ``fused_uvm``, ``fused_uvm_caching``), its fused optimizer, and the calls TorchRec
    makes of a fused kernel (``emb_module``, ``fused_optimizer``, ``flush``, ``purge``, the shards as
    parameters). The TorchRec base class (``BaseBatchedEmbeddingBag`` or ``BaseBatchedEmbedding``)
    comes after it and has laid the group out (``_feature_table_map``, ``_config``, ...)."""

    def _build_module(self, config: GroupedEmbeddingConfig, pg: dist.ProcessGroup | None,
                      device: torch.device | None, pooling: str) -> None:
        specs = table_specs(config)
        arguments = module_arguments(config.fused_params, config.data_type,
                                     cached=any(s.placement.is_cached for s in specs))
        kwargs = arguments.as_kwargs()
        if self._feature_table_map != list(range(len(specs))):  # several features look up one table
            kwargs["feature_table_map"] = list(self._feature_table_map)
        self._emb_module = TieredEmbeddingBags(specs, pooling=pooling, device=device, **kwargs)
        self._optim = TieredEmbeddingFusedOptimizer(config, self._emb_module, pg)
        self.init_parameters()

    @property
    def emb_module(self) -> TieredEmbeddingBags:
        return self._emb_module

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        return self._optim

    def flush(self) -> None:
        self._emb_module.flush()

    def purge(self) -> None:
        self._emb_module.reset_cache_states()

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """None: fused tables are neither parameters nor buffers of the dense model (TorchRec's convention)."""
        yield from ()

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """Each shard's weights as a parameter updated by the fused optimizer (no dense optimizer takes it)."""
        for name, tensor in self.named_split_embedding_weights(prefix, recurse, remove_duplicate):
            param = nn.Parameter(tensor)
            param._in_backward_optimizers = [EmptyFusedOptimizer()]
            yield name, param

    @property
    def _param_per_table(self) -> dict[str, TableBatchedEmbeddingSlice]:
        """Each table's shards on this rank as one parameter (TorchRec registers it as
        ``embedding_bags.<table>.weight``), with a fused optimizer of that table alone."""
        weights = self._emb_module.split_embedding_weights()
        states = self._emb_module.get_optimizer_state() if self._emb_module.optimizer is not None else []
        result = {}
        for table in self._config.embedding_tables:
            if table.name in result:
                continue
            shards = [w for w, other in zip(weights, self._config.embedding_tables) if other.name == table.name]
            data, start = _contiguous_span(shards)
            weight = TableBatchedEmbeddingSlice(data=data, start_offset=start, end_offset=start + sum(
                s.numel() for s in shards), num_embeddings=-1, embedding_dim=shards[0].shape[1])
            weight._in_backward_optimizers = [TieredEmbeddingFusedOptimizer(
                self._config, self._emb_module, self._pg, create_for_table=table.name, param_weight_for_table=weight,
                embedding_weights_by_table=weights, all_optimizer_states=states)]
            result[table.name] = weight
        return result

    @_param_per_table.setter
    def _param_per_table(self, value) -> None:  # BaseBatchedEmbeddingBag assigns an empty dict
        pass



class TieredBatchedFusedEmbeddingBag(_TieredKernel, BaseBatchedEmbeddingBag[torch.Tensor], FusedOptimizerModule):
    """The pooled kernel (an ``EmbeddingBagCollection``'s), where TorchRec builds its ``BatchedFusedEmbeddingBag``.

    Args are TorchRec's: ``config`` (the group: its shards, data type, pooling, fused_params),
    ``pg``, ``device``, ``sharding_type`` (row-wise shardings pool by sum; TorchRec divides for mean).
    """

    def __init__(self, config: GroupedEmbeddingConfig, pg: dist.ProcessGroup | None = None,
                 device: torch.device | None = None, sharding_type: ShardingType | None = None, env=None):
        super().__init__(config, pg, device, sharding_type)
        self._build_module(config, pg, device, pooling_of(self._pooling))

    def forward(self, features: KeyedJaggedTensor, vbe_output: torch.Tensor | None = None,
                vbe_output_offsets: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled ``[B, sum of local dims]``, or (variable batch) FBGEMM's flat VBE layout; with
        ``vbe_output`` (a lookup of several kernels) written into it at ``vbe_output_offsets``."""
        weights = features.weights_or_none()
        if weights is not None and not torch.is_floating_point(weights):
            weights = None
        batch_sizes = features.stride_per_key_per_rank() if features.variable_stride_per_key() else None
        # values() and offsets() as they are: the prefetch saw these same tensors (no dtype copies).
        pooled = self._emb_module(features.values(), features.offsets(), per_sample_weights=weights,
                                  batch_size_per_feature_per_rank=batch_sizes)
        if vbe_output is None:
            return pooled
        return _PlaceInVariableBatchOutput.apply(vbe_output, pooled, _positions_in_output(
            vbe_output_offsets, batch_sizes, [self._local_cols[t] for t in self._feature_table_map]))


class TieredBatchedFusedEmbedding(_TieredKernel, BaseBatchedEmbedding[torch.Tensor], FusedOptimizerModule):
    """The sequence kernel (an ``EmbeddingCollection``'s: a row per lookup, no pooling), where TorchRec
    builds its ``BatchedFusedEmbedding``. Args are TorchRec's (``config``, ``pg``, ``device``); the
    group's tables share one dim, as an ``EmbeddingCollection``'s do."""

    def __init__(self, config: GroupedEmbeddingConfig, pg: dist.ProcessGroup | None = None,
                 device: torch.device | None = None, env=None):
        super().__init__(config, pg, device)
        self._build_module(config, pg, device, "none")

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """``[lookups, dim]``: each lookup's row, in the order of ``features.values()``."""
        return self._emb_module(features.values(), features.offsets())


def _contiguous_span(shards: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """A flat tensor and the offset in it where ``shards`` (rows of one table, in order) start, when
    they follow each other in memory (they do in a tier buffer); else the first shard alone."""
    first = shards[0]
    element = first.element_size()
    follows = all(b.data_ptr() == a.data_ptr() + a.numel() * element and a.is_contiguous() and b.is_contiguous()
                  for a, b in zip(shards, shards[1:]))
    if not follows:
        if len(shards) > 1 or not first.is_contiguous():
            raise ValueError("the shards of one table must be contiguous rows of one buffer (state_layout='separate')")
    flat = first.reshape(-1) if len(shards) == 1 else first.as_strided(
        (sum(s.numel() for s in shards),), (1,), first.storage_offset())
    return flat, 0


def _positions_in_output(vbe_output_offsets: torch.Tensor, batch_sizes: list[list[int]],
                         feature_dims: list[int]) -> torch.Tensor:
    """int64 [our output size]: where each element of this kernel's VBE output goes in the lookup's
    shared one. Ours is rank by rank; rank ``r``'s part starts at ``vbe_output_offsets[r][0]`` there."""
    device = vbe_output_offsets.device
    sizes = [sum(per_rank[r] * d for per_rank, d in zip(batch_sizes, feature_dims)) for r in range(len(batch_sizes[0]))]
    total = sum(sizes)
    ours_start = [0]
    for size in sizes[:-1]:
        ours_start.append(ours_start[-1] + size)
    small = to_device([torch.tensor([sizes, ours_start], dtype=torch.int64)], device)[0]
    destination = torch.repeat_interleave(vbe_output_offsets.reshape(len(sizes), -1)[:, 0].long(), small[0],
                                          output_size=total)
    return destination + torch.arange(total, device=device) - torch.repeat_interleave(small[1], small[0],
                                                                                      output_size=total)


class _PlaceInVariableBatchOutput(torch.autograd.Function):
    """Write this kernel's VBE output into the lookup's shared one (in place, as FBGEMM's kernels do);
    the gradient of ours is gathered back, the shared one's passes through (other kernels read only
    their own places)."""

    @staticmethod
    def forward(ctx, shared: torch.Tensor, ours: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(positions)
        shared.index_copy_(0, positions, ours.to(shared.dtype))
        ctx.mark_dirty(shared)
        return shared

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (positions,) = ctx.saved_tensors
        return grad, grad.index_select(0, positions).float(), None
