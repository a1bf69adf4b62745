"""LAMB (FBGEMM ``LAMB``): Adam's moments, with the step scaled per row by a trust ratio.

With ``g`` the row's gradient summed over the batch and ``k`` the 1-based optimizer step::

    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    r = (m / (1 - b1^k)) / (sqrt(v / (1 - b2^k)) + eps) + weight_decay * w
    w -= lr * (||w|| / ||r||) * r          (norms over the row; a zero ||r|| moves nothing)

State: ``exp_avg`` (``m``, width ``dim``) then ``exp_avg_sq`` (``v``, width ``dim``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .adam import adam_kernel_hyper, adam_step, adam_step_reference, check_adam_fields, load_moments, store_moments
from .base import FusedOptimizer


@triton.jit
def _update(weights, grad, state, mask, dims, hyper, step):
    direction, moments = adam_step(weights, grad, state, hyper, step)
    direction = tl.where(mask, direction, 0.0)
    weight_norm = tl.sqrt_rn(tl.sum(weights * weights, axis=1))
    direction_norm = tl.sqrt_rn(tl.sum(direction * direction, axis=1))
    trust_ratio = tl.where(direction_norm > 0.0, weight_norm / tl.maximum(direction_norm, 1e-30), 0.0)
    return weights - (hyper[0] * trust_ratio)[:, None] * direction, moments


@dataclass(frozen=True)
class LAMB(FusedOptimizer):
    lr: float = 0.001
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    name = "lamb"
    TRITON = (load_moments, _update, store_moments)  # Adam's moments, Adam's layout
    USES_STEP = True  # the bias corrections, computed in the update from the step

    def __post_init__(self):
        check_adam_fields(self)

    def state_columns(self, dim):
        return (("exp_avg", dim), ("exp_avg_sq", dim))

    def kernel_hyper(self):
        return adam_kernel_hyper(self)

    def reference_update(self, weights, grad, state, step):
        step_size, moments = adam_step_reference(self, weights, grad, state, step)
        weight_norm = weights.norm(dim=1, keepdim=True)
        step_norm = step_size.norm(dim=1, keepdim=True)
        trust_ratio = torch.where(step_norm > 0, weight_norm / step_norm, torch.zeros_like(step_norm))
        return weights - self.lr * trust_ratio * step_size, moments
