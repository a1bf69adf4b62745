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

from .base import FusedOptimizer, bias_corrections, check_betas, check_non_negative


@triton.jit
def load_moments(state_rows, columns, row_mask, mask, dims):
    """Per-element moments ``m`` then ``v`` of each row (Adam, LAMB)."""
    pointers = state_rows[:, None] + columns[None, :]
    first = tl.load(pointers, mask=mask, other=0.0)
    second = tl.load(pointers + dims[:, None], mask=mask, other=0.0)
    return first, second


@triton.jit
def bias_correction(beta, step):
    """fp32 ``1 - beta ** step``: Adam's bias correction at the int32 1-based ``step``.

    Computed on the device from the step the kernels read (FBGEMM's kernels compute ``powf`` there
    too), so a step's hyper-parameters stay the same from step to step and a graph's replay copies
    nothing. By squaring over the step's 31 bits in fp64 (a scalar a program: a few dozen fp64
    operations): squaring in fp32 compounds its roundings (~1e-5 relative at step 1000, measured
    in the interpreter), fp64's stay far below fp32's last bit. ``tl.exp2`` / ``tl.log2`` would
    be approximations on the GPU, and libdevice's ``pow`` does not run in the interpreter.
    """
    power = beta.to(tl.float64) * 0.0 + 1.0  # beta ** (the bits of step taken so far)
    base = beta.to(tl.float64)  # beta ** (2 ** bit)
    for bit in tl.static_range(31):
        power = tl.where(((step >> bit) & 1) != 0, power * base, power)
        base = base * base
    return (1.0 - power).to(tl.float32)


@triton.jit
def adam_step(weights, grad, state, hyper, step):
    """``(direction, (m, v))``: the direction ``w`` moves along (before ``lr``) and the new moments,
    at the int32 1-based ``step`` (Adam, LAMB)."""
    eps, beta1, beta2, weight_decay = hyper[1], hyper[2], hyper[3], hyper[4]
    correction1, correction2 = bias_correction(beta1, step), bias_correction(beta2, step)
    first = beta1 * state[0] + (1.0 - beta1) * grad
    second = beta2 * state[1] + (1.0 - beta2) * grad * grad
    direction = (first / correction1) / (tl.sqrt_rn(second / correction2) + eps) + weight_decay * weights
    return direction, (first, second)


@triton.jit
def _update(weights, grad, state, mask, dims, hyper, step):
    direction, moments = adam_step(weights, grad, state, hyper, step)
    return weights - hyper[0] * direction, moments


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
    USES_STEP = True  # the bias corrections, computed in the update from the step

    def __post_init__(self):
        check_adam_fields(self)

    def state_columns(self, dim):
        return (("exp_avg", dim), ("exp_avg_sq", dim))

    def kernel_hyper(self):
        return adam_kernel_hyper(self)

    def reference_update(self, weights, grad, state, step):
        step_size, moments = adam_step_reference(self, weights, grad, state, step)
        return weights - self.lr * step_size, moments


def check_adam_fields(optimizer) -> None:
    """The hyper-parameters of the Adam-type optimizers (Adam, PartialRowwiseAdam, LAMB): ``lr``,
    ``eps`` and ``weight_decay`` finite and ``>= 0``, ``betas`` a pair in ``[0, 1)``."""
    check_non_negative(optimizer, "lr", "eps", "weight_decay")
    check_betas(optimizer)


def adam_kernel_hyper(optimizer) -> tuple[float, ...]:
    """``(lr, eps, beta1, beta2, weight_decay)``: the bundle of the Adam-type optimizers (Adam,
    PartialRowwiseAdam, LAMB); their bias corrections are computed in the kernel from the step."""
    beta1, beta2 = (float(b) for b in optimizer.betas)
    return (float(optimizer.lr), float(optimizer.eps), beta1, beta2, float(optimizer.weight_decay))


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
