"""What the row updates compute beside the optimizers' math (kernels/update_rows.py, the
optimizers' step-dependent terms): Adam's bias corrections on the device, the step's arguments
a CUDA graph replays, stochastic rounding. Inputs: tests/kernel_inputs.py."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from kernel_inputs import (  # noqa: F401  (poison_empty: an autouse fixture, active where imported)
    ALL_OPTIMIZERS,
    ULP,
    make_batch,
    one_table_stores,
    poison_empty,
)

from tiered_tbe.kernels.backward import backward_update
from tiered_tbe.kernels.optimizers import SGD
from tiered_tbe.kernels.optimizers.adam import bias_correction
from tiered_tbe.kernels.rows import Lookups


@triton.jit
def _bias_correction_kernel(
    corrections_ptr,  # fp32 [N]: 1 - beta ** step, written
    steps_ptr,  # int32 [N]: the steps
    beta_ptr,  # fp32 [1]: the moment's decay (loaded, as the kernels load it from the step's arguments)
    N: tl.constexpr,  # how many steps
):
    steps = tl.load(steps_ptr + tl.arange(0, N))
    tl.store(corrections_ptr + tl.arange(0, N), bias_correction(tl.load(beta_ptr), steps))


@pytest.mark.parametrize("beta", [0.999, 0.9999, 0.9, 0.5, 0.1])
def test_bias_correction_on_the_device_matches_float64(beta, device):
    """Adam's ``1 - beta ** step`` as the kernels compute it from the step (by squaring, in fp64):
    float64's rounded to fp32, at every step from 1 to 2**31 - 1 (the step wraps at 31 bits)."""
    _check_bias_correction(beta, device)


@pytest.mark.gpu
@pytest.mark.parametrize("beta", [0.999, 0.9])
def test_bias_correction_compiled_matches_float64(beta, device):
    """The test above, compiled (the GPU suite runs gpu-marked tests only)."""
    _check_bias_correction(beta, device)


def _check_bias_correction(beta: float, device: torch.device) -> None:
    steps = [1, 2, 3, 4, 5, 7, 10, 100, 999, 1000, 1001, 4097, 65_535, 1 << 20, (1 << 31) - 1]
    steps += [0] * (triton.next_power_of_2(len(steps)) - len(steps))
    corrections = torch.full((len(steps),), float("nan"), device=device)
    _bias_correction_kernel[(1,)](corrections, torch.tensor(steps, dtype=torch.int32, device=device),
                                  torch.tensor([beta], dtype=torch.float32, device=device), N=len(steps))
    beta32 = float(torch.tensor(beta, dtype=torch.float32))  # the kernel's beta, and the moments'
    expected = torch.tensor([1.0 - beta32**step for step in steps], dtype=torch.float64)
    got = corrections.double().cpu()
    assert got[0] == torch.tensor(1.0 - beta32, dtype=torch.float32).double(), "step 1: exactly 1 - beta"
    assert torch.allclose(got, expected, rtol=1.2e-7, atol=0), (got - expected) / expected.clamp_min(1e-30)


@pytest.mark.parametrize("name", list(ALL_OPTIMIZERS))
@pytest.mark.parametrize("stochastic_rounding", [False, True])
def test_a_steps_arguments_change_only_in_the_step_the_graph_advances(name, stochastic_rounding, device):
    """What a backward hands its graph for consecutive steps: the same bytes, or, where the kernels
    read the step (Adam-type optimizers, stochastic rounding), bytes that differ only in it and
    that ``advance`` predicts from the previous step's, so a replay never copies them."""
    optimizer = ALL_OPTIMIZERS[name]
    dtype = torch.float16 if stochastic_rounding else torch.float32
    stores, lookups, slot_of_index = make_batch(dtype=dtype, optimizer=optimizer, device=device)
    grad_output = torch.randn(lookups.batch_size, stores.total_dim, device=device)
    handed = []

    class RecordingGraphs:
        def run(self, key, inputs, enqueue, device, advance=None):
            handed.append((inputs[6].numpy().tobytes(), advance))

    for step in (7, 8, 9):
        backward_update(grad_output, stores, lookups, slot_of_index, "sum", optimizer, step,
                        stochastic_rounding=stochastic_rounding, seed=3, graphs=RecordingGraphs())
    (first, advance), (second, _), (third, _) = handed
    if optimizer.USES_STEP or stochastic_rounding:
        assert first != second and advance is not None
        assert advance(first) == second and advance(second) == third
    else:
        assert first == second == third and advance is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_stochastic_rounding_is_unbiased(dtype, device):
    """Each element lands on a neighbour of the exact value, and their mean is the exact value.

    SGD with lr=1 on 3 groups of rows: w=1 moved up by 0.3 ulp, w=-1 moved down by 0.7 ulp (so
    the magnitude rounds up with probability 0.7), and for fp16 w=0 moved by 0.3 of the subnormal
    spacing 2^-24. Each element is an independent draw, so the fraction rounded away from zero
    must lie within 5 standard deviations of the exact fraction.
    """
    rows_per_group, dim = 8, 256
    spacing = ULP[dtype]
    starts = [1.0, -1.0, 0.0]
    steps = [0.3 * spacing, -0.7 * spacing, 0.3 * 2.0**-24 if dtype == torch.float16 else 0.3 * spacing]
    num_rows = 3 * rows_per_group
    weights = torch.tensor(starts, device=device).repeat_interleave(rows_per_group)[:, None].expand(-1, dim).to(dtype)
    indices = torch.arange(num_rows, device=device)
    lookups = Lookups(indices, torch.arange(num_rows + 1, device=device), num_rows)
    grad_output = -torch.tensor(steps, device=device).repeat_interleave(rows_per_group)[:, None].expand(-1, dim)
    grad_output = grad_output.contiguous()
    exact = (torch.tensor(starts, device=device).float() + torch.tensor(steps, device=device).float()).double()

    runs = []
    for seed, step in ((11, 1), (12, 1), (11, 2), (11, 1)):
        stores = one_table_stores(weights.clone())
        backward_update(grad_output, stores, lookups, None, "sum", SGD(lr=1.0), stochastic_rounding=True, seed=seed,
                        step=step)
        runs.append(stores.table_weights[0].reshape(3, -1).double().cpu())
    assert not torch.equal(runs[0], runs[1]), "two seeds gave the same roundings"
    assert not torch.equal(runs[0], runs[2]), "two steps gave the same roundings"
    assert torch.equal(runs[0], runs[3]), "the same seed and step gave different roundings"
    runs = runs[:3]

    for group in range(3):
        values = torch.cat([run[group] for run in runs])
        exact_value = float(exact[group])
        below, above = _neighbours(exact_value, dtype)
        assert set(values.unique().tolist()) <= {below, above}, (group, values.unique(), below, above)
        probability_above = (exact_value - below) / (above - below)
        observed = (values == above).double().mean().item()
        sigma = math.sqrt(probability_above * (1 - probability_above) / values.numel())
        assert abs(observed - probability_above) < 5 * sigma, (group, observed, probability_above)
        assert abs(values.mean().item() - exact_value) < 5 * sigma * (above - below)


def _neighbours(value: float, dtype: torch.dtype) -> tuple[float, float]:
    """The two values of ``dtype`` (fp16 or bf16) just below and just above ``value``."""
    nearest_bits = torch.tensor([value], dtype=torch.float64).to(dtype).view(torch.int16)
    candidates = torch.cat([nearest_bits - 1, nearest_bits, nearest_bits + 1]).view(dtype).double()
    assert not (candidates == value).any(), "the exact value must not be representable"
    return candidates[candidates < value].max().item(), candidates[candidates > value].min().item()
