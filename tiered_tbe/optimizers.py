"""Optimizers fused into the backward pass; their math matches FBGEMM's on the same inputs.

Each step, the gradients of every lookup of a row are summed first (repeated rows in a batch,
in one bag or across bags), then the row is updated once. With ``g`` that summed gradient
(a row of ``embedding_dim`` values, fp32) and ``w`` the row:

- :class:`SGD` (FBGEMM ``EXACT_SGD``): ``w -= lr * g``.
- :class:`RowwiseAdagrad` (``EXACT_ROWWISE_ADAGRAD``), one fp32 accumulator ``s`` per row:
  ``s += mean(g * g)``; ``w -= lr * g / (sqrt(s) + eps)``.
- :class:`Adam` (``ADAM``), per-element fp32 moments ``m``, ``v``, step ``k`` = number of
  optimizer steps taken by the module so far, counting this one:
  ``m = b1 m + (1 - b1) g``; ``v = b2 v + (1 - b2) g^2``;
  ``w -= lr * ((m / (1 - b1^k)) / (sqrt(v / (1 - b2^k)) + eps) + weight_decay * w)``.

Weights stored in fp16 / bf16 are updated in fp32 and rounded once (to nearest, or
stochastically with ``stochastic_rounding=True`` on the module).

Optimizer state lives beside its rows: in the backing store of the table, and in the slot
cache with the row while the row is cached (written back with it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class OptimizerKind(enum.IntEnum):
    """Codes the kernels branch on (a constexpr)."""

    NONE = 0
    SGD = 1
    ROWWISE_ADAGRAD = 2
    ADAM = 3


@dataclass(frozen=True)
class SGD:
    lr: float = 0.01

    kind = OptimizerKind.SGD

    def state_width(self, embedding_dim: int) -> int:
        """fp32 state values kept per row."""
        return 0


@dataclass(frozen=True)
class RowwiseAdagrad:
    lr: float = 0.01
    eps: float = 1e-8
    initial_accumulator_value: float = 0.0

    kind = OptimizerKind.ROWWISE_ADAGRAD

    def state_width(self, embedding_dim: int) -> int:
        return 1


@dataclass(frozen=True)
class Adam:
    lr: float = 0.001
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    kind = OptimizerKind.ADAM

    def state_width(self, embedding_dim: int) -> int:
        """``m`` then ``v``, ``embedding_dim`` values each."""
        return 2 * embedding_dim


Optimizer = SGD | RowwiseAdagrad | Adam

# The registry: an optimizer's name (CLI choices, configs) -> its class. Each class takes its
# hyper-parameters as keyword arguments, every one with a default.
OPTIMIZERS: dict[str, type] = {"sgd": SGD, "rowwise_adagrad": RowwiseAdagrad, "adam": Adam}


def optimizer_named(name: str, **hyper_parameters):
    """``optimizer_named("adam", lr=1e-3)`` -> ``Adam(lr=1e-3)``; ValueError naming the choices."""
    try:
        cls = OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {name!r}") from None
    return cls(**hyper_parameters)
