"""Adam (FBGEMM ``ADAM``): per-element fp32 moments ``m`` and ``v``.

With ``g`` the row's gradient summed over the batch and ``k`` the module's optimizer step
(1-based, counting this one)::

    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    w -= lr * ((m / (1 - b1^k)) / (sqrt(v / (1 - b2^k)) + eps) + weight_decay * w)

State: ``exp_avg`` (``m``, width ``dim``) then ``exp_avg_sq`` (``v``, width ``dim``). As in
FBGEMM, a row's moments change only at the steps that look it up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .base import FusedOptimizer, bias_corrections


@triton.jit
def load_moments(state_rows, columns, row_mask, mask, dims):
    """Per-element moments ``m`` then ``v`` of each row (Adam, LAMB)."""
    pointers = state_rows[:, None] + columns[None, :]
    first = tl.load(pointers, mask=mask, other=0.0)
    second = tl.load(pointers + dims[:, None], mask=mask, other=0.0)
    return first, second


@triton.jit
def adam_step(weights, grad, state, hyper):
    """``(step, (m, v))``: the new moments and the step ``w`` moves along (before ``lr``; Adam, LAMB)."""
    eps, beta1, beta2, weight_decay = hyper[1], hyper[2], hyper[3], hyper[4]
    correction1, correction2 = hyper[5], hyper[6]
    first = beta1 * state[0] + (1.0 - beta1) * grad
    second = beta2 * state[1] + (1.0 - beta2) * grad * grad
    step = (first / correction1) / (tl.sqrt_rn(second / correction2) + eps) + weight_decay * weights
    return step, (first, second)


@triton.jit
def _update(weights, grad, state, mask, dims, hyper):
    step, moments = adam_step(weights, grad, state, hyper)
    return weights - hyper[0] * step, moments


@triton.jit
def store_moments(state_rows, state, columns, row_mask, mask, dims):
    pointers = state_rows[:, None] + columns[None, :]
    tl.store(pointers, state[0], mask=mask)
    tl.store(pointers + dims[:, None], state[1], mask=mask)


@dataclass(frozen=True)
class Adam(FusedOptimizer):
    lr: float = 0.001
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    name = "adam"
    TRITON = (load_moments, _update, store_moments)

    def state_columns(self, dim):
        return (("exp_avg", dim), ("exp_avg_sq", dim))

    def kernel_hyper(self, step):
        return adam_kernel_hyper(self, step)

    def reference_update(self, weights, grad, state, step):
        step_size, moments = adam_step_reference(self, weights, grad, state, step)
        return weights - self.lr * step_size, moments


def adam_kernel_hyper(optimizer, step: int) -> tuple[float, ...]:
    """``(lr, eps, beta1, beta2, weight_decay, 1 - beta1^step, 1 - beta2^step)``: the bundle of
    the Adam-type optimizers (Adam, PartialRowwiseAdam, LAMB)."""
    beta1, beta2 = (float(b) for b in optimizer.betas)
    return (float(optimizer.lr), float(optimizer.eps), beta1, beta2, float(optimizer.weight_decay),
            *bias_corrections(beta1, beta2, step))


def adam_step_reference(optimizer, weights, grad, state, step):
    """Plain torch, the same as :func:`adam_step`: ``(step, [m | v])`` of ``weights [R, dim]``, ``grad``
    and ``state [R, 2 * dim]`` at 1-based ``step``, for an optimizer with Adam's fields (Adam, LAMB)."""
    beta1, beta2 = optimizer.betas
    correction1, correction2 = bias_corrections(beta1, beta2, step)
    dim = weights.shape[1]
    first = beta1 * state[:, :dim] + (1 - beta1) * grad
    second = beta2 * state[:, dim:] + (1 - beta2) * grad * grad
    step_size = (first / correction1) / ((second / correction2).sqrt() + optimizer.eps)
    return step_size + optimizer.weight_decay * weights, torch.cat([first, second], dim=1)
