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

Adding an optimizer: a module here and one line in ``OPTIMIZERS`` (``__init__.py``).
"""

from __future__ import annotations

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
