"""Row-wise Adagrad (FBGEMM ``EXACT_ROWWISE_ADAGRAD``): one fp32 accumulator ``s`` per row.

With ``g`` the row's gradient summed over the batch (``dim`` values)::

    s += mean(g * g)
    w -= lr * g / (sqrt(s) + eps)

State: ``momentum1`` (width 1), starting at ``initial_accumulator_value``.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .base import FusedOptimizer, check_non_negative


@triton.jit
def _load_state(state_rows, columns, row_mask, mask, dims):
    return tl.load(state_rows, mask=row_mask, other=0.0)  # [R]


@triton.jit
def _update(weights, grad, state, mask, dims, hyper, step):
    learning_rate, eps = hyper[0], hyper[1]
    accumulated = state + tl.sum(grad * grad, axis=1) / tl.maximum(dims, 1).to(tl.float32)
    multiplier = learning_rate / (tl.sqrt_rn(accumulated) + eps)
    return weights - multiplier[:, None] * grad, accumulated


@triton.jit
def _store_state(state_rows, state, columns, row_mask, mask, dims):
    tl.store(state_rows, state, mask=row_mask)


@dataclass(frozen=True)
class RowwiseAdagrad(FusedOptimizer):
    lr: float = 0.01
    eps: float = 1e-8
    initial_accumulator_value: float = 0.0

    name = "rowwise_adagrad"
    TRITON = (_load_state, _update, _store_state)

    def __post_init__(self):
        check_non_negative(self, "lr", "eps", "initial_accumulator_value")

    def state_columns(self, dim):
        return (("momentum1", 1),)

    def initial_state(self):
        return float(self.initial_accumulator_value)

    def kernel_hyper(self):
        return (float(self.lr), float(self.eps))

    def reference_update(self, weights, grad, state, step):
        state = state + (grad * grad).mean(dim=1, keepdim=True)
        return weights - self.lr * grad / (state.sqrt() + self.eps), state

