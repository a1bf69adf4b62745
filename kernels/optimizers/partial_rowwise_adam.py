"""Partial row-wise Adam (FBGEMM ``PARTIAL_ROWWISE_ADAM``): a per-element first moment ``m`` and
one row-wise second moment ``v`` per row.

With ``g`` the row's gradient summed over the batch and ``k`` the 1-based optimizer step::

    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * mean(g * g)
    w -= lr * ((m / (1 - b1^k)) / (sqrt(v / (1 - b2^k)) + eps) + weight_decay * w)

State: ``exp_avg`` (``m``, width ``dim``) then ``exp_avg_sq`` (``v``, width 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .adam import adam_kernel_hyper, bias_correction, check_adam_fields
from .base import FusedOptimizer, bias_corrections


@triton.jit
def _load_state(state_rows, columns, row_mask, mask, dims):
    first = tl.load(state_rows[:, None] + columns[None, :], mask=mask, other=0.0)
    second = tl.load(state_rows + dims, mask=row_mask, other=0.0)  # [R]
    return first, second


@triton.jit
def _update(weights, grad, state, mask, dims, hyper, step):
    learning_rate, eps, beta1, beta2, weight_decay = hyper[0], hyper[1], hyper[2], hyper[3], hyper[4]
    correction1, correction2 = bias_correction(beta1, step), bias_correction(beta2, step)
    first = beta1 * state[0] + (1.0 - beta1) * grad
    second = beta2 * state[1] + (1.0 - beta2) * (tl.sum(grad * grad, axis=1) / tl.maximum(dims, 1).to(tl.float32))
    denominator = tl.sqrt_rn(second / correction2) + eps
    direction = (first / correction1) / denominator[:, None] + weight_decay * weights
    return weights - learning_rate * direction, (first, second)


@triton.jit
def _store_state(state_rows, state, columns, row_mask, mask, dims):
    tl.store(state_rows[:, None] + columns[None, :], state[0], mask=mask)
    tl.store(state_rows + dims, state[1], mask=row_mask)


@dataclass(frozen=True)
class PartialRowwiseAdam(FusedOptimizer):
    lr: float = 0.001
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    name = "partial_rowwise_adam"
    TRITON = (_load_state, _update, _store_state)
    USES_STEP = True  # the bias corrections, computed in the update from the step

    def __post_init__(self):
        check_adam_fields(self)

    def state_columns(self, dim):
        return (("exp_avg", dim), ("exp_avg_sq", 1))

    def kernel_hyper(self):
        return adam_kernel_hyper(self)

    def reference_update(self, weights, grad, state, step):
        beta1, beta2 = self.betas
        correction1, correction2 = bias_corrections(beta1, beta2, step)
        dim = weights.shape[1]
        first = beta1 * state[:, :dim] + (1 - beta1) * grad
        second = beta2 * state[:, dim:] + (1 - beta2) * (grad * grad).mean(dim=1, keepdim=True)
        step_size = (first / correction1) / ((second / correction2).sqrt() + self.eps) + self.weight_decay * weights
        return weights - self.lr * step_size, torch.cat([first, second], dim=1)
