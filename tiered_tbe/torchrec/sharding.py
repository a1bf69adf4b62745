"""TorchRec's shardings, pooled and sequence, with lookups that build our kernels.

Each sharding (table-wise, row-wise, column-wise, table-row-wise) is TorchRec's own: its plan, its
input distribution (the KeyedJaggedTensor all-to-all) and its output distribution are untouched.
Only ``create_lookup`` changes: it builds a :class:`TieredGroupedPooledEmbeddingsLookup`, whose
``fused`` groups (``fused``, ``fused_uvm`` and ``fused_uvm_caching`` tables: TorchRec groups the
three kernels together, the cached tables apart) run as one
:class:`~tiered_tbe.torchrec.kernel.TieredBatchedFusedEmbeddingBag` each. The sequence shardings of an
``EmbeddingCollection`` (table-wise, row-wise, column-wise: TorchRec's) build a
:class:`TieredGroupedEmbeddingsLookup`, whose ``fused`` groups run as one
:class:`~tiered_tbe.torchrec.kernel.TieredBatchedFusedEmbedding` each.
"""

from __future__ import annotations

import torch
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup, GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.sharding.cw_sequence_sharding import CwSequenceEmbeddingSharding
from torchrec.distributed.sharding.cw_sharding import CwPooledEmbeddingSharding
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.sharding.tw_sequence_sharding import TwSequenceEmbeddingSharding
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingType

from tiered_tbe.torchrec.kernel import TieredBatchedFusedEmbedding, TieredBatchedFusedEmbeddingBag


class TieredGroupedPooledEmbeddingsLookup(GroupedPooledEmbeddingsLookup):
    """TorchRec's pooled lookup; a ``fused`` group is one TieredEmbeddingBags (others: TorchRec's kernels)."""

    def _create_embedding_kernel(self, config: GroupedEmbeddingConfig, device: torch.device | None, pg,
                                 sharding_type: ShardingType | None, env=None):
        if config.compute_kernel == EmbeddingComputeKernel.FUSED:
            return TieredBatchedFusedEmbeddingBag(config=config, pg=pg, device=device, sharding_type=sharding_type)
        return super()._create_embedding_kernel(config, device, pg, sharding_type, env)


class _TieredLookup:
    """``create_lookup`` as TorchRec's pooled shardings write it, with our lookup."""

    _LOOKUP_SHARDING_TYPE: ShardingType | None = None  # what TorchRec's create_lookup passes

    def _lookup_configs(self) -> list[GroupedEmbeddingConfig]:
        return self._grouped_embedding_configs

    def create_lookup(self, device: torch.device | None = None, fused_params=None, feature_processor=None):
        return TieredGroupedPooledEmbeddingsLookup(
            grouped_configs=self._lookup_configs(), pg=self._pg, device=device if device is not None else self._device,
            feature_processor=feature_processor, sharding_type=self._LOOKUP_SHARDING_TYPE, env=self._env)


class TieredTwPooledEmbeddingSharding(_TieredLookup, TwPooledEmbeddingSharding):
    """Table-wise: each table whole on one rank."""


class TieredRwPooledEmbeddingSharding(_TieredLookup, RwPooledEmbeddingSharding):
    """Row-wise: each rank a block of every table's rows (sum pooling; TorchRec divides for mean)."""

    _LOOKUP_SHARDING_TYPE = ShardingType.ROW_WISE


class TieredCwPooledEmbeddingSharding(_TieredLookup, CwPooledEmbeddingSharding):
    """Column-wise: each rank a block of a table's columns."""


class TieredTwRwPooledEmbeddingSharding(_TieredLookup, TwRwPooledEmbeddingSharding):
    """Table-row-wise: a table's rows split over the ranks of one host."""

    _LOOKUP_SHARDING_TYPE = ShardingType.TABLE_ROW_WISE

    def _lookup_configs(self) -> list[GroupedEmbeddingConfig]:
        return self._grouped_embedding_configs_per_rank[self._rank]


TIERED_SHARDINGS = {
    ShardingType.TABLE_WISE.value: TieredTwPooledEmbeddingSharding,
    ShardingType.ROW_WISE.value: TieredRwPooledEmbeddingSharding,
    ShardingType.COLUMN_WISE.value: TieredCwPooledEmbeddingSharding,
    ShardingType.TABLE_ROW_WISE.value: TieredTwRwPooledEmbeddingSharding,
}


# ------------------------------------------------------------------ sequence (EmbeddingCollection)
class TieredGroupedEmbeddingsLookup(GroupedEmbeddingsLookup):
    """TorchRec's sequence lookup; a ``fused`` group is one TieredEmbeddingBags without pooling."""

    def _create_embedding_kernel(self, config: GroupedEmbeddingConfig, pg, device: torch.device | None, env=None):
        if config.compute_kernel == EmbeddingComputeKernel.FUSED:
            return TieredBatchedFusedEmbedding(config=config, pg=pg, device=device)
        return super()._create_embedding_kernel(config, pg, device, env)


class _TieredSequenceLookup:
    """``create_lookup`` as TorchRec's sequence shardings write it, with our lookup."""

    def create_lookup(self, device: torch.device | None = None, fused_params=None, feature_processor=None):
        if feature_processor is not None:
            raise ValueError("an EmbeddingCollection's sharding takes no feature processor")
        return TieredGroupedEmbeddingsLookup(grouped_configs=self._grouped_embedding_configs, pg=self._pg,
                                             device=device if device is not None else self._device, env=self._env)


class TieredTwSequenceEmbeddingSharding(_TieredSequenceLookup, TwSequenceEmbeddingSharding):
    """Table-wise, a row per lookup."""


class TieredRwSequenceEmbeddingSharding(_TieredSequenceLookup, RwSequenceEmbeddingSharding):
    """Row-wise, a row per lookup."""


class TieredCwSequenceEmbeddingSharding(_TieredSequenceLookup, CwSequenceEmbeddingSharding):
    """Column-wise, a row per lookup (each rank its block of the columns)."""


TIERED_SEQUENCE_SHARDINGS = {
    ShardingType.TABLE_WISE.value: TieredTwSequenceEmbeddingSharding,
    ShardingType.ROW_WISE.value: TieredRwSequenceEmbeddingSharding,
    ShardingType.COLUMN_WISE.value: TieredCwSequenceEmbeddingSharding,
}
