"""The optimizers fused into the backward pass, as users name them: see :mod:`tiered_tbe.kernels.optimizers`
(one module per optimizer: math, Triton update, torch reference, state layout; one registry)."""

from tiered_tbe.kernels.optimizers import (
    LAMB,
    OPTIMIZERS,
    SGD,
    Adagrad,
    Adam,
    FusedOptimizer,
    PartialRowwiseAdam,
    RowwiseAdagrad,
    optimizer_named,
)

Optimizer = FusedOptimizer

__all__ = ["OPTIMIZERS", "Optimizer", "FusedOptimizer", "optimizer_named", "SGD", "RowwiseAdagrad", "Adagrad", "Adam",
           "PartialRowwiseAdam", "LAMB"]
