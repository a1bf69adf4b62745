"""tiered-tbe inside TorchRec: a sharder for ``DistributedModelParallel``.

::

    from tiered_tbe.torchrec import TieredEmbeddingBagCollectionSharder
    sharder = TieredEmbeddingBagCollectionSharder(fused_params={
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05})
    model = DistributedModelParallel(model, plan=plan, sharders=[sharder])

The only package of tiered-tbe that imports torchrec (``import tiered_tbe`` does not).
"""

from tiered_tbe.torchrec.kernel import TieredBatchedFusedEmbeddingBag
from tiered_tbe.torchrec.sharder import TieredEmbeddingBagCollectionSharder, TieredShardedEmbeddingBagCollection

__all__ = ["TieredEmbeddingBagCollectionSharder", "TieredShardedEmbeddingBagCollection",
           "TieredBatchedFusedEmbeddingBag"]
