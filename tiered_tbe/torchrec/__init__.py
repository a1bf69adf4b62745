"""tiered-tbe inside TorchRec: a sharder for ``DistributedModelParallel``.

::

    from tiered_tbe.torchrec import TieredEmbeddingBagCollectionSharder
    sharder = TieredEmbeddingBagCollectionSharder(fused_params={
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05})
    model = DistributedModelParallel(model, plan=plan, sharders=[sharder])

``TieredEmbeddingCollectionSharder`` does the same for an ``EmbeddingCollection`` (a row per lookup).

The only package of tiered-tbe that imports torchrec (``import tiered_tbe`` does not); its public
names load torchrec on first use, so ``tiered-tbe train`` reads its ``--torchrec`` flags without it.
"""

import importlib

_PUBLIC = {
    "TieredEmbeddingBagCollectionSharder": "tiered_tbe.torchrec.sharder",
    "TieredShardedEmbeddingBagCollection": "tiered_tbe.torchrec.sharder",
    "TieredBatchedFusedEmbeddingBag": "tiered_tbe.torchrec.kernel",
    "TieredEmbeddingCollectionSharder": "tiered_tbe.torchrec.sharder",
    "TieredShardedEmbeddingCollection": "tiered_tbe.torchrec.sharder",
    "TieredBatchedFusedEmbedding": "tiered_tbe.torchrec.kernel",
}

__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tiered_tbe.torchrec' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
