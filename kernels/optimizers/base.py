"""What every fused optimizer defines: the contract between an optimizer module and the backward.

An optimizer is one module of this package holding one frozen dataclass (its hyper-parameters,
each with a default) that subclasses :class:`FusedOptimizer`, with:

- its math, in the module docstring;
- ``state_columns(dim)``: its per-row fp32 state as ``(name, width)`` pairs in layout order:
  the columns of a row's state, and the ``state_dict`` entries (``<table>.<name>``; a width-1
  entry is a 1-D tensor, as FBGEMM's row-wise ``momentum1``);
- ``initial_state()``: the value state starts at;
- ``kernel_hyper()``: the hyper-parameters the Triton update reads, one tuple of floats, the
  same at every step (terms that depend on the step, such as Adam's bias corrections, are
  computed by the update from ``step``: the step's arguments then change only in the step,
  which the backward advances on the device, so a graph's replay copies nothing);
- ``USES_STEP``: whether the update reads ``step`` (the backward passes it only then, or for
  stochastic rounding);
- ``TRITON = (load_state, update, store_state)``: three ``@triton.jit`` functions the backward
  calls on tiles of ``R`` rows (``kernels/backward.py``):

  * ``load_state(state_rows, columns, row_mask, mask, dims) -> state``: ``state_rows`` fp32
    pointers [R] to each row's state, ``columns`` int32 [BLOCK_D], ``row_mask`` bool [R],
    ``mask`` bool [R, BLOCK_D] (the row's real columns), ``dims`` int32 [R]; returns what the
    update needs (a tile, or a tuple of tiles);
  * ``update(weights, grad, state, mask, dims, hyper, step) -> (new_weights, new_state)``: fp32
    [R, BLOCK_D] rows and summed gradients (zeros outside ``mask``), ``hyper`` the tuple of
    ``kernel_hyper()``, ``step`` the int32 1-based optimizer step (read only if ``USES_STEP``);
  * ``store_state(state_rows, state, columns, row_mask, mask, dims)``.

  The backward loads every row and its state before a barrier and stores after it (threads may
  hold copies of one value): ``load_state`` must only load and ``store_state`` only store.
- ``reference_update(weights, grad, state, step) -> (weights, state)``: the same math in plain
  torch (float64 rows ``[R, dim]``, state ``[R, width]`` or ``None``), the tests' oracle.
- ``__post_init__``: checks its own hyper-parameters with :func:`check_non_negative` (and
  :func:`check_betas`), so that a value that cannot train is refused at construction, naming the
  optimizer, the field and the value, not found steps later as NaN rows.

Adding an optimizer: a module here and one line in ``OPTIMIZERS`` (``__init__.py``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class FusedOptimizer:
    """Base of the fused optimizers (see the module docstring for the contract)."""

    name: ClassVar[str]
    TRITON: ClassVar[tuple]
    USES_STEP: ClassVar[bool] = False

    def state_columns(self, dim: int) -> tuple[tuple[str, int], ...]:
        """``(state_dict name, width)`` of each part of a row's fp32 state, in layout order."""
        return ()

    def state_width(self, dim: int) -> int:
        """fp32 state values kept per row of a table of ``dim`` columns."""
        return sum(width for _, width in self.state_columns(dim))

    def state_is_row_wise(self) -> bool:
        """Whether the state kept per row does not grow with the row's dim (row-wise Adagrad's one
        float; SGD's none): small enough to keep in device memory for any table."""
        return self.state_width(1) == self.state_width(1 << 16)

    def initial_state(self) -> float:
        return 0.0

    def kernel_hyper(self) -> tuple[float, ...]:
        raise NotImplementedError

    def reference_update(self, weights: torch.Tensor, grad: torch.Tensor, state: torch.Tensor | None,
                         step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError


def bias_corrections(beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """Adam's ``(1 - beta1^step, 1 - beta2^step)`` for the 1-based ``step``."""
    return 1.0 - beta1**step, 1.0 - beta2**step


def check_non_negative(optimizer: FusedOptimizer, *fields: str) -> None:
    """``ValueError`` naming the optimizer, the field and the value unless each field is a finite
    real number ``>= 0``. Zero is allowed (``lr=0`` freezes the tables, as in ``torch.optim``)."""
    for field in fields:
        _check_number(optimizer, field, getattr(optimizer, field))


def check_betas(optimizer: FusedOptimizer) -> None:
    """``betas``: a pair of finite numbers in ``[0, 1)`` (Adam's moment decays)."""
    betas = optimizer.betas
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{type(optimizer).__name__}: betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        _check_number(optimizer, f"betas[{i}]", beta, below=1.0)


def _check_number(optimizer: FusedOptimizer, name: str, value, below: float | None = None) -> None:
    is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not is_number or not math.isfinite(value) or value < 0 or (below is not None and value >= below):
        wanted = ">= 0" if below is None else f"in [0, {below:g})"
        raise ValueError(f"{type(optimizer).__name__}: {name} must be a finite number {wanted}, got {value!r}")
