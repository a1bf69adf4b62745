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

from .adam import adam_kernel_hyper, load_moments, store_moments
from .base import FusedOptimizer, bias_corrections


@triton.jit
def _update(weights, grad, state, mask, dims, hyper):
    learning_rate, eps, beta1, beta2, weight_decay = hyper[0], hyper[1], hyper[2], hyper[3], hyper[4]
    correction1, correction2 = hyper[5], hyper[6]
    first = beta1 * state[0] + (1.0 - beta1) * grad
    second = beta2 * state[1] + (1.0 - beta2) * grad * grad
    step = (first / correction1) / (tl.sqrt_rn(second / correction2) + eps) + weight_decay * weights
    step = tl.where(mask, step, 0.0)
    weight_norm = tl.sqrt_rn(tl.sum(weights * weights, axis=1))
    step_norm = tl.sqrt_rn(tl.sum(step * step, axis=1))
    trust_ratio = tl.where(step_norm > 0.0, weight_norm / tl.maximum(step_norm, 1e-30), 0.0)
    return weights - (learning_rate * trust_ratio)[:, None] * step, (first, second)


@dataclass(frozen=True)
class LAMB(FusedOptimizer):
    lr: float = 0.001
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    name = "lamb"
    TRITON = (load_moments, _update, store_moments)  # Adam's moments, Adam's layout

    def state_columns(self, dim):
        return (("exp_avg", dim), ("exp_avg_sq", dim))

    def kernel_hyper(self, step):
        return adam_kernel_hyper(self, step)

    def reference_update(self, weights, grad, state, step):
        beta1, beta2 = self.betas
        correction1, correction2 = bias_corrections(beta1, beta2, step)
        dim = weights.shape[1]
        first = beta1 * state[:, :dim] + (1 - beta1) * grad
        second = beta2 * state[:, dim:] + (1 - beta2) * grad * grad
        step_size = (first / correction1) / ((second / correction2).sqrt() + self.eps) + self.weight_decay * weights
        weight_norm = weights.norm(dim=1, keepdim=True)
        step_norm = step_size.norm(dim=1, keepdim=True)
        trust_ratio = torch.where(step_norm > 0, weight_norm / step_norm, torch.zeros_like(step_norm))
        return weights - self.lr * trust_ratio * step_size, torch.cat([first, second], dim=1)
