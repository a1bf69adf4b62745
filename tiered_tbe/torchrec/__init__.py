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

import torch

_PUBLIC = {
    "TieredEmbeddingBagCollectionSharder": "tiered_tbe.torchrec.sharder",
    "TieredShardedEmbeddingBagCollection": "tiered_tbe.torchrec.sharder",
    "TieredBatchedFusedEmbeddingBag": "tiered_tbe.torchrec.kernel",
    "TieredEmbeddingCollectionSharder": "tiered_tbe.torchrec.sharder",
    "TieredShardedEmbeddingCollection": "tiered_tbe.torchrec.sharder",
    "TieredBatchedFusedEmbedding": "tiered_tbe.torchrec.kernel",
}

__all__ = list(_PUBLIC)


def require_torchrec() -> None:
    """Import TorchRec and FBGEMM_GPU, or raise ``ImportError`` saying what to install.

    An FBGEMM_GPU release built for another torch is installed but fails to load (``OSError``, an
    undefined symbol of torch's); both cases name the torch to pair with.
    """
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401
    except (ImportError, OSError) as error:
        raise ImportError(
            f"tiered_tbe.torchrec needs TorchRec and an FBGEMM_GPU release built for torch {torch.__version__} "
            "(pip install 'tiered-tbe[torchrec]'; which releases pair with which torch: docs/TORCHREC.md, "
            f"Install): {type(error).__name__}: {error}") from error


def __getattr__(name: str):
    if name in _PUBLIC:
        require_torchrec()
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tiered_tbe.torchrec' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
