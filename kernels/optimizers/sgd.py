"""SGD (FBGEMM ``EXACT_SGD``): ``w -= lr * g``, with ``g`` the row's gradient summed over the batch.

No state.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .base import FusedOptimizer, check_non_negative


@triton.jit
def _load_state(state_rows, columns, row_mask, mask, dims):
    return tl.zeros([1], dtype=tl.float32)  # no state: a placeholder the update passes through


@triton.jit
def _update(weights, grad, state, mask, dims, hyper, step):
    learning_rate = hyper[0]
    return weights - learning_rate * grad, state


@triton.jit
def _store_state(state_rows, state, columns, row_mask, mask, dims):
    return


@dataclass(frozen=True)
class SGD(FusedOptimizer):
    lr: float = 0.01

    name = "sgd"
    TRITON = (_load_state, _update, _store_state)

    def __post_init__(self):
        check_non_negative(self, "lr")

    def kernel_hyper(self):
        return (float(self.lr),)

    def reference_update(self, weights, grad, state, step):
        return weights - self.lr * grad, state

