"""Adagrad, element-wise (FBGEMM ``EXACT_ADAGRAD``): an fp32 accumulator per element.

With ``g`` the row's gradient summed over the batch::

    s += g * g
    w -= lr * g / (sqrt(s) + eps)

State: ``momentum1`` (width ``dim``), starting at ``initial_accumulator_value``.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .base import FusedOptimizer, check_non_negative


@triton.jit
def _load_state(state_rows, columns, row_mask, mask, dims):
    return tl.load(state_rows[:, None] + columns[None, :], mask=mask, other=0.0)


@triton.jit
def _update(weights, grad, state, mask, dims, hyper, step):
    learning_rate, eps = hyper[0], hyper[1]
    accumulated = state + grad * grad
    return weights - learning_rate * grad / (tl.sqrt_rn(accumulated) + eps), accumulated


@triton.jit
def _store_state(state_rows, state, columns, row_mask, mask, dims):
    tl.store(state_rows[:, None] + columns[None, :], state, mask=mask)


@dataclass(frozen=True)
class Adagrad(FusedOptimizer):
    lr: float = 0.01
    eps: float = 1e-8
    initial_accumulator_value: float = 0.0

    name = "adagrad"
    TRITON = (_load_state, _update, _store_state)

    def __post_init__(self):
        check_non_negative(self, "lr", "eps", "initial_accumulator_value")

    def state_columns(self, dim):
        return (("momentum1", dim),)

    def initial_state(self):
        return float(self.initial_accumulator_value)

    def kernel_hyper(self):
        return (float(self.lr), float(self.eps))

    def reference_update(self, weights, grad, state, step):
        state = state + grad * grad
        return weights - self.lr * grad / (state.sqrt() + self.eps), state
