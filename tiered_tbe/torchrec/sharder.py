"""``TieredEmbeddingBagCollectionSharder`` and ``TieredEmbeddingCollectionSharder``: TorchRec's
``EmbeddingBagCollectionSharder`` and ``EmbeddingCollectionSharder``, our kernels.

A user keeps their ``EmbeddingBagCollection``, planner and plan, and passes this sharder to
``DistributedModelParallel``. The plan's compute kernel places each table (``fused`` in HBM,
``fused_uvm`` in managed memory, ``fused_uvm_caching`` behind the slot cache at the plan's
``cache_load_factor``); the kernel names stay TorchRec's, so the planner's memory estimates,
the prefetch pipeline's triggering, ``model.fused_optimizer`` and sharded checkpoints work as
with FBGEMM. ``fused_params``: :mod:`tiered_tbe.torchrec.fused_params`.
"""

from __future__ import annotations

from typing import Any

import torch
from torchrec.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
    replace_placement_with_meta_device,
)
from torchrec.distributed.types import ShardingType

from tiered_tbe.module import TieredEmbeddingBags
from tiered_tbe.torchrec.fused_params import PLACEMENT_OF_KERNEL
from tiered_tbe.torchrec.sharding import TIERED_SEQUENCE_SHARDINGS, TIERED_SHARDINGS, TieredCwPooledEmbeddingSharding

SHARDING_TYPES = [ShardingType.TABLE_WISE.value, ShardingType.ROW_WISE.value, ShardingType.COLUMN_WISE.value,
                  ShardingType.TABLE_ROW_WISE.value]
SEQUENCE_SHARDING_TYPES = list(TIERED_SEQUENCE_SHARDINGS)  # an EmbeddingCollection's: TorchRec has no table-row-wise
COMPUTE_KERNELS = [EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.FUSED_UVM.value,
                   EmbeddingComputeKernel.FUSED_UVM_CACHING.value]


class _TieredShardedModule:
    """What both sharded collections add to TorchRec's: loading a state dict flushes every tiered
    module first (the backing stores then hold every update) and drops their cached rows after (the
    stores hold what was loaded)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_load_state_dict_pre_hook(_flush_before_load)
        self.register_load_state_dict_post_hook(_drop_cached_rows_after_load)

    def tiered_modules(self) -> list[TieredEmbeddingBags]:
        """This rank's TieredEmbeddingBags, one per group of shards."""
        return [kernel.emb_module for lookup in self._lookups for kernel in getattr(lookup, "_emb_modules", [])
                if isinstance(kernel.emb_module, TieredEmbeddingBags)]


class TieredShardedEmbeddingBagCollection(_TieredShardedModule, ShardedEmbeddingBagCollection):
    """TorchRec's sharded EmbeddingBagCollection whose shardings build tiered-tbe lookups."""

    @classmethod
    def create_embedding_bag_sharding(cls, sharding_infos, env, device: torch.device | None = None,
                                      permute_embeddings: bool = False, qcomm_codecs_registry=None):
        sharding_type = sharding_infos[0].param_sharding.sharding_type
        if sharding_type not in TIERED_SHARDINGS:
            raise ValueError(f"sharding type {sharding_type!r}: tiered-tbe shards {sorted(TIERED_SHARDINGS)}")
        if device is not None and device.type == "meta":
            replace_placement_with_meta_device(sharding_infos)
        kwargs: dict[str, Any] = dict(qcomm_codecs_registry=qcomm_codecs_registry)
        if TIERED_SHARDINGS[sharding_type] is TieredCwPooledEmbeddingSharding:
            kwargs["permute_embeddings"] = permute_embeddings
        return TIERED_SHARDINGS[sharding_type](sharding_infos, env, device, **kwargs)


def _flush_before_load(module: _TieredShardedModule, *args) -> None:
    for tiered in module.tiered_modules():
        tiered.flush()


def _drop_cached_rows_after_load(module: _TieredShardedModule, incompatible_keys) -> None:
    for tiered in module.tiered_modules():
        tiered.reset_cache_states(write_back=False)


class TieredEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """A drop-in for TorchRec's ``EmbeddingBagCollectionSharder`` running tiered-tbe's kernels.

    Args: TorchRec's: ``fused_params`` (FBGEMM's names and ours, see
    :mod:`tiered_tbe.torchrec.fused_params`), ``qcomm_codecs_registry``, ... Offers table-wise,
    row-wise, column-wise and table-row-wise sharding with the ``fused``, ``fused_uvm`` and
    ``fused_uvm_caching`` kernels on any device (the CPU in simulation mode too).
    """

    def shard(self, module, params, env, device: torch.device | None = None, module_fqn: str | None = None):
        _check_plan(params, SHARDING_TYPES)
        return TieredShardedEmbeddingBagCollection(
            module=module, table_name_to_parameter_sharding=params, env=env, fused_params=self.fused_params,
            device=device, qcomm_codecs_registry=self.qcomm_codecs_registry, module_fqn=module_fqn,
            sharded_module_order_overwrite=self._sharded_module_order_overwrite)

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(SHARDING_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return list(COMPUTE_KERNELS)

    @property
    def sharded_module_type(self) -> type[TieredShardedEmbeddingBagCollection]:
        return TieredShardedEmbeddingBagCollection


def _check_plan(params: dict, sharding_types: list[str]) -> None:
    """A clear error naming the table for a compute kernel or sharding type we do not run."""
    for table, sharding in params.items():
        if sharding.compute_kernel not in PLACEMENT_OF_KERNEL:
            raise ValueError(f"table {table!r}: compute kernel {sharding.compute_kernel!r} is not one of "
                             f"tiered-tbe's {COMPUTE_KERNELS}")
        if sharding.sharding_type not in sharding_types:
            raise ValueError(f"table {table!r}: sharding type {sharding.sharding_type!r} is not one of "
                             f"tiered-tbe's {sharding_types}")


# ------------------------------------------------------------------ EmbeddingCollection (sequence embeddings)
class TieredShardedEmbeddingCollection(_TieredShardedModule, ShardedEmbeddingCollection):
    """TorchRec's sharded EmbeddingCollection whose shardings build tiered-tbe lookups (a row per lookup)."""

    @classmethod
    def create_embedding_sharding(cls, sharding_type: str, sharding_infos, env, device: torch.device | None = None,
                                  qcomm_codecs_registry=None):
        if sharding_type not in TIERED_SEQUENCE_SHARDINGS:
            raise ValueError(f"sharding type {sharding_type!r}: tiered-tbe shards an EmbeddingCollection "
                             f"{SEQUENCE_SHARDING_TYPES}")
        return TIERED_SEQUENCE_SHARDINGS[sharding_type](sharding_infos=sharding_infos, env=env, device=device,
                                                        qcomm_codecs_registry=qcomm_codecs_registry)


class TieredEmbeddingCollectionSharder(EmbeddingCollectionSharder):
    """A drop-in for TorchRec's ``EmbeddingCollectionSharder`` (sequence embeddings: a row per lookup)
    running tiered-tbe's kernels. Args: TorchRec's (``fused_params`` as for
    :class:`TieredEmbeddingBagCollectionSharder`). Offers table-wise, row-wise and column-wise sharding
    (TorchRec's for an EmbeddingCollection) with the ``fused``, ``fused_uvm`` and ``fused_uvm_caching`` kernels."""

    def shard(self, module, params, env, device: torch.device | None = None, module_fqn: str | None = None):
        _check_plan(params, SEQUENCE_SHARDING_TYPES)
        return TieredShardedEmbeddingCollection(module, params, env, self.fused_params, device,
                                                qcomm_codecs_registry=self.qcomm_codecs_registry,
                                                use_index_dedup=self._use_index_dedup, module_fqn=module_fqn)

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(SEQUENCE_SHARDING_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return list(COMPUTE_KERNELS)

    @property
    def sharded_module_type(self) -> type[TieredShardedEmbeddingCollection]:
        return TieredShardedEmbeddingCollection
