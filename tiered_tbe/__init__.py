"""tiered-tbe: table-batched embedding bags for tables larger than GPU memory.

Importing the package only picks the kernel mode (:mod:`tiered_tbe.base.mode`, before triton or
numba load); the public names below load on first use, so ``import tiered_tbe.kernels`` or
``import tiered_tbe.cache`` does not load the module, the pipeline or the optimizers.
"""

import importlib

# First: picks the kernel mode. (``X as X``: re-exported, public.)
from tiered_tbe.base.mode import SIMULATION as SIMULATION
from tiered_tbe.base.mode import default_device as default_device
from tiered_tbe.base.mode import describe_mode as describe_mode

# Public name -> module that defines it (loaded on first access, PEP 562). The optimizers are
# public too: every class of the registry ``tiered_tbe.optimizers.OPTIMIZERS``, under its class
# name (``from tiered_tbe import LAMB``), read from the registry on first access.
_PUBLIC = {
    "CacheStats": "tiered_tbe.cache.stats",
    "TieredEmbeddingBags": "tiered_tbe.module",
    "PrefetchPipeline": "tiered_tbe.pipeline",
    "CacheConfig": "tiered_tbe.specs",
    "Placement": "tiered_tbe.specs",
    "TableSpec": "tiered_tbe.specs",
}
_EAGER = ["SIMULATION", "default_device", "describe_mode"]


def _optimizers() -> dict[str, type]:
    """The registered optimizers by class name."""
    from tiered_tbe.optimizers import OPTIMIZERS

    return {cls.__name__: cls for cls in OPTIMIZERS.values()}


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    elif name == "__all__":  # ``from tiered_tbe import *`` reads it: the optimizers load then
        value = [*_EAGER, *_PUBLIC, *_optimizers()]
    # Class names only: ``from tiered_tbe import records`` asks here first for a submodule, which must
    # not load the optimizers (and Triton with them).
    elif name[:1].isupper() and name in (optimizers := _optimizers()):
        value = optimizers[name]
    else:
        raise AttributeError(f"module 'tiered_tbe' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(__getattr__("__all__"))
