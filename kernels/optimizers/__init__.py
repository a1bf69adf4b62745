"""The optimizers fused into the backward: one module each, one registry line each.

Each step, the gradients of every lookup of a row are summed first (repeated rows in a batch,
in one bag or across bags), then the row and its state are updated once, in fp32 (fp16 / bf16
weights rounded once, to nearest or stochastically). A row's state lives beside it: in its
table's backing store, and in the slot cache with the row while the row is cached. The
contract an optimizer module fulfils is in :mod:`.base`; the math is in each module.
"""

from .adagrad import Adagrad
from .adam import Adam
from .base import FusedOptimizer
from .lamb import LAMB
from .partial_rowwise_adam import PartialRowwiseAdam
from .rowwise_adagrad import RowwiseAdagrad
from .sgd import SGD

# The registry: name (CLI choices, configs) -> class. Adding an optimizer adds one line here.
OPTIMIZERS: dict[str, type[FusedOptimizer]] = {
    cls.name: cls for cls in (SGD, RowwiseAdagrad, Adagrad, Adam, PartialRowwiseAdam, LAMB)
}


def optimizer_named(name: str, **hyper_parameters) -> FusedOptimizer:
    """``optimizer_named("adam", lr=1e-3)`` -> ``Adam(lr=1e-3)``; ValueError naming the choices."""
    try:
        cls = OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {name!r}") from None
    return cls(**hyper_parameters)


__all__ = ["OPTIMIZERS", "FusedOptimizer", "optimizer_named", "Adagrad", "Adam", "LAMB", "PartialRowwiseAdam",
           "RowwiseAdagrad", "SGD"]
