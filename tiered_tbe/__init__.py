"""tiered-tbe: table-batched embedding bags for tables larger than GPU memory.

Importing the package only picks the kernel mode (:mod:`tiered_tbe.base.mode`, before triton or
numba load); the public names below load on first use, so ``import tiered_tbe.kernels`` or
``import tiered_tbe.cache`` does not load the module, the pipeline or the optimizers.
"""

import importlib

from tiered_tbe.base.mode import SIMULATION, default_device, describe_mode  # first: picks the kernel mode

# Public name -> module that defines it (loaded on first access, PEP 562).
_PUBLIC = {
    "CacheStats": "tiered_tbe.cache.stats",
    "TieredEmbeddingBags": "tiered_tbe.module",
    "PrefetchPipeline": "tiered_tbe.pipeline",
    "CacheConfig": "tiered_tbe.specs",
    "Placement": "tiered_tbe.specs",
    "TableSpec": "tiered_tbe.specs",
    "SGD": "tiered_tbe.optimizers",
    "Adam": "tiered_tbe.optimizers",
    "RowwiseAdagrad": "tiered_tbe.optimizers",
}

__all__ = ["SIMULATION", "default_device", "describe_mode", *_PUBLIC]


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tiered_tbe' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
