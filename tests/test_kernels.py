"""Triton kernels (kernels/forward.py, kernels/backward.py) against the float64 references.

Every check draws fresh random inputs: several tables with different dims (1, 3, 17, 33) and
tiers, tables of one row, empty bags, rows repeated in a bag and across bags, per-sample weights,
rows in a small slot cache beside rows read from backing stores. Outputs the kernels allocate
start as NaN (``poison_empty``), so an element no program writes shows up. In CPU simulation
the Triton interpreter runs everything: sizes stay small.
"""

from __future__ import annotations

import math

import pytest
import torch

from tiered_tbe.kernels import backward as backward_module
from tiered_tbe.kernels import forward as forward_module
from tiered_tbe.kernels.backward import backward_update, per_sample_weights_grad
from tiered_tbe.kernels.forward import pooled_forward
from tiered_tbe.kernels.reference import (
    reference_backward_update,
    reference_forward,
    reference_per_sample_weights_grad,
)
from tiered_tbe.kernels.rows import TIER_DEVICE, TIER_HOST, TIER_MANAGED, Lookups, RowStores, state_width_of
from tiered_tbe.optimizers import OptimizerKind

SGD, ADAGRAD, ADAM = OptimizerKind.SGD, OptimizerKind.ROWWISE_ADAGRAD, OptimizerKind.ADAM
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# One unit in the last place at 1.0 of each weights dtype: the tolerance of a row rounded once.
ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
UNPOISONED_EMPTY = torch.empty  # for buffers the test itself must leave untouched


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    """Make the kernels' ``torch.empty`` outputs NaN, so elements no program writes are caught."""
    original = torch.empty

    def empty_filled_with_nan(*args, **kwargs):
        tensor = original(*args, **kwargs)
        if tensor.is_floating_point():
            tensor.fill_(math.nan)
        return tensor

    monkeypatch.setattr(forward_module.torch, "empty", empty_filled_with_nan)
    assert backward_module.torch.empty is empty_filled_with_nan


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def make_stores(dims, num_rows, tiers, dtype, optimizer_kind, num_slots, device) -> RowStores:
    """Random rows (and positive optimizer state) for tables of ``dims`` x ``num_rows`` in ``tiers``."""
    weight_sizes = {TIER_DEVICE: 0, TIER_HOST: 0, TIER_MANAGED: 0}
    state_sizes = dict(weight_sizes)
    weight_offsets, state_offsets, output_offsets = [], [], []
    for dim, rows, tier in zip(dims, num_rows, tiers):
        weight_offsets.append(weight_sizes[tier])
        state_offsets.append(state_sizes[tier])
        output_offsets.append(sum(output_offsets[-1:]) + (dims[len(output_offsets) - 1] if output_offsets else 0))
        weight_sizes[tier] += rows * dim
        state_sizes[tier] += rows * state_width_of(optimizer_kind, dim)

    def weights(size):
        return torch.randn(size, device=device).to(dtype)

    def state(size):  # Adagrad sums and Adam's v must be >= 0; m may be anything, positive is fine
        return torch.rand(size, device=device) * 0.1

    max_dim = max(dims)
    cache_state_width = max(1, state_width_of(optimizer_kind, max_dim))
    return RowStores(
        device_weights=weights(weight_sizes[TIER_DEVICE]),
        host_weights=weights(weight_sizes[TIER_HOST]),
        managed_weights=weights(weight_sizes[TIER_MANAGED]),
        device_state=state(state_sizes[TIER_DEVICE]),
        host_state=state(state_sizes[TIER_HOST]),
        managed_state=state(state_sizes[TIER_MANAGED]),
        table_tier=torch.tensor(tiers, dtype=torch.int32, device=device),
        table_weight_offset=torch.tensor(weight_offsets, dtype=torch.int64, device=device),
        table_state_offset=torch.tensor(state_offsets, dtype=torch.int64, device=device),
        table_dim=torch.tensor(dims, dtype=torch.int32, device=device),
        table_output_offset=torch.tensor(output_offsets, dtype=torch.int32, device=device),
        cache_weights=torch.randn(num_slots, max_dim, device=device).to(dtype),
        cache_state=torch.rand(num_slots, cache_state_width, device=device) * 0.1,
        max_dim=max_dim,
        total_dim=sum(dims),
    )


def make_batch(
    dims=(3, 17, 33, 1),
    num_rows=(7, 1, 40, 5),
    tiers=(TIER_DEVICE, TIER_HOST, TIER_MANAGED, TIER_DEVICE),
    batch_size=5,
    max_bag=6,
    dtype=torch.float32,
    optimizer_kind=SGD,
    weighted=False,
    num_slots=8,
    device="cpu",
):
    """``(stores, lookups, slot_of_index)``: a random batch over random tables.

    Every fourth bag is empty; half the lookups hit one of a table's first three rows, so rows
    repeat within bags and across bags. Up to ``num_slots`` of the rows used sit in the slot cache,
    where their (newer) copy differs from the backing store's.
    """
    num_tables = len(dims)
    stores = make_stores(dims, num_rows, tiers, dtype, optimizer_kind, num_slots, device)
    lengths = torch.randint(0, max_bag + 1, (num_tables * batch_size,), device=device)
    lengths[::4] = 0
    offsets = torch.zeros(num_tables * batch_size + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.cumsum(lengths, 0)
    bag_of_index = torch.repeat_interleave(torch.arange(num_tables * batch_size, device=device), lengths)
    num_lookups = bag_of_index.numel()
    table_of_index = bag_of_index // batch_size
    rows_of_table = torch.tensor(num_rows, device=device)[table_of_index]
    uniform = (torch.rand(num_lookups, device=device) * rows_of_table).long()
    hot = (torch.rand(num_lookups, device=device) * rows_of_table.clamp(max=3)).long()
    indices = torch.where(torch.rand(num_lookups, device=device) < 0.5, hot, uniform)
    row_offset = torch.zeros(num_tables, dtype=torch.int64, device=device)
    row_offset[1:] = torch.cumsum(torch.tensor(num_rows, device=device), 0)[:-1]
    global_rows = row_offset[table_of_index] + indices
    per_sample_weights = torch.rand(num_lookups, device=device) + 0.5 if weighted else None
    lookups = Lookups(indices, offsets, bag_of_index, global_rows, per_sample_weights, batch_size)

    used_rows = torch.unique(global_rows)
    cached_rows = used_rows[torch.randperm(used_rows.numel(), device=device)[: min(num_slots, used_rows.numel() // 2)]]
    slot_of_row = torch.full((sum(num_rows),), -1, dtype=torch.int32, device=device)
    slot_of_row[cached_rows] = torch.randperm(num_slots, device=device)[: cached_rows.numel()].int()
    slot_of_index = slot_of_row[global_rows]
    return stores, lookups, slot_of_index


def clone_stores(stores: RowStores) -> RowStores:
    return RowStores(*(value.clone() if isinstance(value, torch.Tensor) else value for value in stores))


def assert_stores_close(actual: RowStores, expected: RowStores, dtype: torch.dtype) -> None:
    """Every weight (rounded once in ``dtype``) and state value of the two stores agree."""
    for name in ("device_weights", "host_weights", "managed_weights", "cache_weights"):
        rtol = 2 * ULP[dtype] if dtype != torch.float32 else 1e-5
        torch.testing.assert_close(getattr(actual, name).float().cpu(), getattr(expected, name).float().cpu(),
                                   rtol=rtol, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    for name in ("device_state", "host_state", "managed_state", "cache_state"):
        torch.testing.assert_close(getattr(actual, name).cpu(), getattr(expected, name).cpu(),
                                   rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_pooled_forward_matches_reference(pooling, weighted, dtype, device):
    stores, lookups, slot_of_index = make_batch(dtype=dtype, weighted=weighted, device=device)
    assert (slot_of_index >= 0).any() and (slot_of_index < 0).any()

    output = pooled_forward(stores, lookups, slot_of_index, pooling)

    assert output.dtype == torch.float32 and output.shape == (lookups.batch_size, stores.total_dim)
    expected = reference_forward(stores, lookups, slot_of_index, pooling)
    torch.testing.assert_close(output.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_pooled_forward_none_gives_each_lookups_row(weighted, device):
    stores, lookups, slot_of_index = make_batch(
        dims=(17, 17), num_rows=(1, 30), tiers=(TIER_HOST, TIER_DEVICE), weighted=weighted, device=device)

    output = pooled_forward(stores, lookups, slot_of_index, "none")

    assert output.shape == (lookups.num_lookups, 17)
    expected = reference_forward(stores, lookups, slot_of_index, "none")
    torch.testing.assert_close(output.double(), expected, rtol=1e-6, atol=1e-6)


def test_pooled_forward_empty_bags_give_zeros(device):
    stores, lookups, slot_of_index = make_batch(device=device)
    lengths = lookups.offsets[1:] - lookups.offsets[:-1]
    empty_bags = torch.nonzero(lengths == 0).flatten()
    assert empty_bags.numel() > 0

    for pooling in ("sum", "mean"):
        output = pooled_forward(stores, lookups, slot_of_index, pooling)
        for bag in empty_bags.tolist():
            table, sample = divmod(bag, lookups.batch_size)
            start = int(stores.table_output_offset[table])
            assert torch.all(output[sample, start : start + int(stores.table_dim[table])] == 0)


def test_pooled_forward_without_lookups(device):
    """N = 0: sum and mean outputs are all zeros, and no kernel reads an index."""
    stores, lookups, slot_of_index = make_batch(max_bag=0, device=device)
    assert lookups.num_lookups == 0
    output = pooled_forward(stores, lookups, slot_of_index, "mean")
    assert torch.all(output == 0)
    assert pooled_forward(stores, lookups, slot_of_index, "none").shape == (0, stores.max_dim)


def test_pooled_forward_without_cache(device):
    stores, lookups, _ = make_batch(num_slots=0, device=device)
    stores = stores._replace(cache_weights=torch.empty(0, 1, device=device),
                             cache_state=torch.empty(0, 1, device=device))
    slot_of_index = torch.full((lookups.num_lookups,), -1, dtype=torch.int32, device=device)

    output = pooled_forward(stores, lookups, slot_of_index, "sum")

    torch.testing.assert_close(output.double(), reference_forward(stores, lookups, slot_of_index, "sum"),
                               rtol=1e-5, atol=1e-5)


def test_rejects_mixed_weight_dtypes(device):
    stores, lookups, slot_of_index = make_batch(device=device)
    stores = stores._replace(host_weights=stores.host_weights.half())
    with pytest.raises(TypeError, match="share one dtype"):
        pooled_forward(stores, lookups, slot_of_index, "sum")
    with pytest.raises(ValueError, match="pooling"):
        pooled_forward(stores._replace(host_weights=stores.device_weights), lookups, slot_of_index, "max")


def _one_table_stores(weights: torch.Tensor, dim: int) -> RowStores:
    """RowStores of one DEVICE table (SGD: no state, no cache) whose rows are ``weights``."""
    device = weights.device

    def empty(dtype=weights.dtype):
        return torch.empty(0, dtype=dtype, device=device)

    return RowStores(
        weights, empty(), empty(), empty(torch.float32), empty(torch.float32), empty(torch.float32),
        table_tier=torch.tensor([TIER_DEVICE], dtype=torch.int32, device=device),
        table_weight_offset=torch.zeros(1, dtype=torch.int64, device=device),
        table_state_offset=torch.zeros(1, dtype=torch.int64, device=device),
        table_dim=torch.tensor([dim], dtype=torch.int32, device=device),
        table_output_offset=torch.zeros(1, dtype=torch.int32, device=device),
        cache_weights=torch.empty(0, 1, dtype=weights.dtype, device=device),
        cache_state=empty(torch.float32).view(0, 1), max_dim=dim, total_dim=dim)


def test_rows_past_2_to_the_32_elements(device):
    """Rows whose elements lie past 2^31 (and 2^32): int32 address arithmetic would wrap.

    The store is an 8 GiB fp16 tensor that ``torch.empty`` only reserves (on the CPU): only the
    pages of the rows written get memory. Row ``far_row`` starts at element 2^32 + 12, which int32
    arithmetic wraps to element 12, row 3, inside the store and filled with 7.0: a wrap gives
    wrong numbers rather than a crash. The same rows, renumbered 0..2 in a small store, give the
    expected results. Skipped where the system refuses to reserve the address space.
    """
    dim = 4
    far_row = 2**32 // dim + 3
    try:
        store = UNPOISONED_EMPTY(far_row * dim + 64 * dim, dtype=torch.float16, device=device)
    except (RuntimeError, MemoryError) as error:
        pytest.skip(f"cannot reserve 8 GiB of address space: {error}")
    used_rows = [far_row, far_row + 7, 5]
    compact = torch.randn(len(used_rows) * dim, device=device).half()
    store[: 64 * dim] = 7.0  # rows wrapped addresses land on; row 5 is overwritten next
    for number, row in enumerate(used_rows):
        store[row * dim : (row + 1) * dim] = compact[number * dim : (number + 1) * dim]
    far_stores, compact_stores = _one_table_stores(store, dim), _one_table_stores(compact, dim)
    rows = torch.tensor([far_row, far_row + 7, 5, far_row], device=device)
    compact_rows = torch.tensor([0, 1, 2, 0], device=device)
    bags = torch.tensor([0, 0, 1, 1], device=device)
    offsets = torch.tensor([0, 2, 4], device=device)
    far_lookups = Lookups(rows, offsets, bags, rows, None, 2)
    compact_lookups = Lookups(compact_rows, offsets, bags, compact_rows, None, 2)
    slot_of_index = torch.full((4,), -1, dtype=torch.int32, device=device)

    output = pooled_forward(far_stores, far_lookups, slot_of_index, "sum")
    torch.testing.assert_close(output.double(), reference_forward(compact_stores, compact_lookups, slot_of_index,
                                                                  "sum"))

    grad_output = torch.randn(2, dim, device=device)
    reference_backward_update(grad_output, compact_stores, compact_lookups, slot_of_index, "sum", SGD, lr=0.5)
    backward_update(grad_output, far_stores, far_lookups, slot_of_index, "sum", SGD, lr=0.5)
    for number, row in enumerate(used_rows):
        torch.testing.assert_close(store[row * dim : (row + 1) * dim].float(),
                                   compact[number * dim : (number + 1) * dim].float(),
                                   rtol=2 * ULP[torch.float16], atol=1e-5)
    assert torch.all(store[: 5 * dim] == 7.0) and torch.all(store[6 * dim : 64 * dim] == 7.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_per_sample_weights_grad_matches_reference(pooling, dtype, device):
    stores, lookups, slot_of_index = make_batch(dtype=dtype, weighted=True, device=device)
    grad_output = torch.randn(lookups.batch_size, stores.total_dim, device=device)

    result = per_sample_weights_grad(grad_output, stores, lookups, slot_of_index, pooling)

    assert result.dtype == torch.float32 and result.shape == (lookups.num_lookups,)
    expected = reference_per_sample_weights_grad(grad_output, stores, lookups, slot_of_index, pooling)
    torch.testing.assert_close(result.double(), expected, rtol=1e-5, atol=1e-5)


def test_per_sample_weights_grad_pooling_none(device):
    stores, lookups, slot_of_index = make_batch(
        dims=(9, 9, 9), num_rows=(4, 1, 12), tiers=(TIER_MANAGED, TIER_HOST, TIER_DEVICE), weighted=True,
        device=device)
    grad_output = torch.randn(lookups.num_lookups, 9, device=device)

    result = per_sample_weights_grad(grad_output, stores, lookups, slot_of_index, "none")

    expected = reference_per_sample_weights_grad(grad_output, stores, lookups, slot_of_index, "none")
    torch.testing.assert_close(result.double(), expected, rtol=1e-5, atol=1e-5)


def test_per_sample_weights_grad_is_the_autograd_gradient(device):
    """The reference itself, checked once against autograd through reference_forward."""
    stores, lookups, slot_of_index = make_batch(weighted=True, device=device)
    weights = lookups.per_sample_weights.double().requires_grad_()
    output = reference_forward(stores, lookups._replace(per_sample_weights=weights), slot_of_index, "mean")
    grad_output = torch.randn(lookups.batch_size, stores.total_dim, device=device)
    (output * grad_output).sum().backward()

    result = per_sample_weights_grad(grad_output, stores, lookups, slot_of_index, "mean")

    torch.testing.assert_close(result.double(), weights.grad, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Backward with fused optimizers
# ---------------------------------------------------------------------------------------------

HYPER_PARAMETERS = dict(lr=0.05, eps=1e-3, beta1=0.8, beta2=0.95, weight_decay=0.01, step=3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("optimizer_kind", [SGD, ADAGRAD, ADAM], ids=lambda kind: kind.name)
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_backward_update_matches_reference(pooling, optimizer_kind, dtype, device):
    stores, lookups, slot_of_index = make_batch(
        dtype=dtype, optimizer_kind=optimizer_kind, weighted=pooling == "sum", device=device)
    grad_output = torch.randn(lookups.batch_size, stores.total_dim, device=device)
    expected = clone_stores(stores)

    reference_backward_update(grad_output, expected, lookups, slot_of_index, pooling, optimizer_kind,
                              **HYPER_PARAMETERS)
    backward_update(grad_output, stores, lookups, slot_of_index, pooling, optimizer_kind, **HYPER_PARAMETERS)

    assert_stores_close(stores, expected, dtype)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_reference_sgd_step_is_the_autograd_gradient(pooling, device):
    """The reference itself, checked once: its SGD step is -lr times autograd's gradient of every row."""
    stores, lookups, slot_of_index = make_batch(dtype=torch.float64, weighted=True, device=device)
    names = ("device_weights", "host_weights", "managed_weights", "cache_weights")
    leaves = {name: getattr(stores, name).clone().requires_grad_() for name in names}
    output = reference_forward(stores._replace(**leaves), lookups, slot_of_index, pooling)
    grad_output = torch.randn(lookups.batch_size, stores.total_dim, device=device, dtype=torch.float64)
    (output * grad_output).sum().backward()

    reference_backward_update(grad_output, stores, lookups, slot_of_index, pooling, SGD, lr=0.25)

    for name in names:
        expected = leaves[name].detach() - 0.25 * leaves[name].grad
        torch.testing.assert_close(getattr(stores, name), expected, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("optimizer_kind", [SGD, ADAM], ids=lambda kind: kind.name)
def test_backward_update_pooling_none(optimizer_kind, device):
    stores, lookups, slot_of_index = make_batch(
        dims=(33, 33), num_rows=(20, 2), tiers=(TIER_MANAGED, TIER_DEVICE), optimizer_kind=optimizer_kind,
        weighted=True, device=device)
    grad_output = torch.randn(lookups.num_lookups, 33, device=device)
    expected = clone_stores(stores)

    reference_backward_update(grad_output, expected, lookups, slot_of_index, "none", optimizer_kind,
                              **HYPER_PARAMETERS)
    backward_update(grad_output, stores, lookups, slot_of_index, "none", optimizer_kind, **HYPER_PARAMETERS)

    assert_stores_close(stores, expected, torch.float32)


@pytest.mark.parametrize("chunk_size", [1, 2, 4, 8])
def test_hot_rows_split_into_chunks(chunk_size, device):
    """Rows looked up many times are summed in chunks of ``chunk_size`` lookups, then combined.

    The batch has a row with more than two full chunks and a row whose count is not a multiple
    of the chunk (lookups left after its last full chunk).
    """
    for _ in range(20):
        stores, lookups, slot_of_index = make_batch(
            dims=(5, 9), num_rows=(1, 3), tiers=(TIER_DEVICE, TIER_HOST), batch_size=12, max_bag=12,
            optimizer_kind=ADAGRAD, weighted=True, num_slots=2, device=device)
        counts = torch.unique(lookups.global_rows, return_counts=True)[1]
        if counts.max() > 2 * chunk_size and (chunk_size == 1 or (counts % chunk_size != 0).any()):
            break
    else:
        pytest.fail("no batch with long rows and a partial chunk")
    grad_output = torch.randn(lookups.batch_size, stores.total_dim, device=device)
    expected = clone_stores(stores)

    reference_backward_update(grad_output, expected, lookups, slot_of_index, "mean", ADAGRAD, lr=0.1)
    backward_update(grad_output, stores, lookups, slot_of_index, "mean", ADAGRAD, lr=0.1, chunk_size=chunk_size)

    assert_stores_close(stores, expected, torch.float32)


def test_backward_update_leaves_backing_rows_of_cached_lookups(device):
    """A cached row is updated in its slot only; its (older) backing copy stays as it was."""
    stores, lookups, slot_of_index = make_batch(
        dims=(8,), num_rows=(6,), tiers=(TIER_DEVICE,), num_slots=3, optimizer_kind=ADAGRAD, device=device)
    cached_rows = torch.unique(lookups.indices[slot_of_index >= 0])
    assert cached_rows.numel() > 0
    before = stores.device_weights.view(6, 8)[cached_rows].clone()
    state_before = stores.device_state[cached_rows].clone()
    grad_output = torch.randn(lookups.batch_size, 8, device=device)

    backward_update(grad_output, stores, lookups, slot_of_index, "sum", ADAGRAD, lr=0.1)

    assert torch.equal(stores.device_weights.view(6, 8)[cached_rows], before)
    assert torch.equal(stores.device_state[cached_rows], state_before)


def test_optimizer_none_and_empty_batch_change_nothing(device):
    stores, lookups, slot_of_index = make_batch(optimizer_kind=ADAM, device=device)
    untouched = clone_stores(stores)
    grad_output = torch.randn(lookups.batch_size, stores.total_dim, device=device)
    backward_update(grad_output, stores, lookups, slot_of_index, "sum", OptimizerKind.NONE, lr=1.0)
    empty_stores, empty_lookups, empty_slots = make_batch(max_bag=0, device=device)
    backward_update(torch.randn(empty_lookups.batch_size, empty_stores.total_dim, device=device), empty_stores,
                    empty_lookups, empty_slots, "sum", SGD, lr=1.0)
    for name in ("device_weights", "host_weights", "managed_weights", "cache_weights", "device_state"):
        assert torch.equal(getattr(stores, name), getattr(untouched, name))


def test_backward_update_rejects_bad_arguments(device):
    stores, lookups, slot_of_index = make_batch(device=device)
    grad_output = torch.randn(lookups.batch_size, stores.total_dim, device=device)
    with pytest.raises(ValueError, match="shape"):
        backward_update(grad_output[:, 1:], stores, lookups, slot_of_index, "sum", SGD, lr=1.0)
    with pytest.raises(ValueError, match="power of two"):
        backward_update(grad_output, stores, lookups, slot_of_index, "sum", SGD, lr=1.0, chunk_size=3)
    with pytest.raises(TypeError, match="slot_of_index"):
        backward_update(grad_output, stores, lookups, slot_of_index.long(), "sum", SGD, lr=1.0)


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
    stores = make_stores([dim], [num_rows], [TIER_DEVICE], dtype, SGD, 0, device)
    stores.device_weights.view(3, -1)[:] = torch.tensor(starts, device=device)[:, None].to(dtype)
    indices = torch.arange(num_rows, device=device)
    lookups = Lookups(indices, torch.arange(num_rows + 1, device=device), indices, indices, None, num_rows)
    slot_of_index = torch.full((num_rows,), -1, dtype=torch.int32, device=device)
    grad_output = -torch.tensor(steps, device=device).repeat_interleave(rows_per_group)[:, None].expand(-1, dim)
    grad_output = grad_output.contiguous()
    exact = (torch.tensor(starts, device=device).float() + torch.tensor(steps, device=device).float()).double()

    runs = []
    for seed, step in ((11, 1), (12, 1), (11, 2), (11, 1)):
        weights = stores._replace(device_weights=stores.device_weights.clone())
        backward_update(grad_output, weights, lookups, slot_of_index, "sum", SGD, lr=1.0,
                        stochastic_rounding=True, seed=seed, step=step)
        runs.append(weights.device_weights.view(3, -1).double().cpu())
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


# ---------------------------------------------------------------------------------------------
# GPU only
# ---------------------------------------------------------------------------------------------


def _zipf_batch(num_rows, dim, batch_size, bag_size, device, dtype=torch.float32, optimizer_kind=ADAGRAD):
    """One DEVICE table, fixed-size bags, rows drawn from a Zipf(1.05)-like law: hot rows with
    thousands of lookups (several chunks) beside rows seen once."""
    stores = make_stores([dim], [num_rows], [TIER_DEVICE], dtype, optimizer_kind, 0, device)
    num_lookups = batch_size * bag_size
    ranks = torch.arange(1, num_rows + 1, device=device, dtype=torch.float64)
    cdf = torch.cumsum(ranks**-1.05, 0)
    indices = torch.searchsorted(cdf / cdf[-1], torch.rand(num_lookups, device=device, dtype=torch.float64))
    indices = torch.randperm(num_rows, device=device)[indices.clamp(max=num_rows - 1)]
    offsets = torch.arange(0, num_lookups + 1, bag_size, device=device)
    bag_of_index = torch.arange(batch_size, device=device).repeat_interleave(bag_size)
    lookups = Lookups(indices, offsets, bag_of_index, indices, None, batch_size)
    return stores, lookups, torch.full((num_lookups,), -1, dtype=torch.int32, device=device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_two_identical_steps_are_bitwise_equal(dtype, device):
    """At a size where many programs run at once, forward and update are deterministic."""
    stores, lookups, slot_of_index = _zipf_batch(1_000_000, 128, 16384, 32, device, dtype)
    counts = torch.unique(lookups.global_rows, return_counts=True)[1]
    assert counts.max() > 4 * backward_module.DEFAULT_CHUNK_SIZE  # hot rows take the chunked path
    grad_output = torch.randn(lookups.batch_size, 128, device=device)

    outputs, results = [], []
    for _ in range(2):
        step_stores = clone_stores(stores)
        outputs.append(pooled_forward(step_stores, lookups, slot_of_index, "sum"))
        backward_update(grad_output, step_stores, lookups, slot_of_index, "sum", ADAGRAD, lr=0.01,
                        stochastic_rounding=True, seed=5, step=3)
        results.append(step_stores)
    assert torch.equal(outputs[0], outputs[1])
    assert torch.equal(results[0].device_weights, results[1].device_weights)
    assert torch.equal(results[0].device_state, results[1].device_state)


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer_kind", [SGD, ADAGRAD, ADAM], ids=lambda kind: kind.name)
def test_large_batch_matches_reference(optimizer_kind, device):
    """dim 128 and long bags: the autotuned forward tiles and the default chunk size on hot rows."""
    stores, lookups, slot_of_index = _zipf_batch(50_000, 128, 2048, 40, device, optimizer_kind=optimizer_kind)
    grad_output = torch.randn(lookups.batch_size, 128, device=device)
    for pooling in ("sum", "mean"):
        torch.testing.assert_close(pooled_forward(stores, lookups, slot_of_index, pooling).double(),
                                   reference_forward(stores, lookups, slot_of_index, pooling), rtol=1e-5, atol=1e-4)
    expected = clone_stores(stores)
    reference_backward_update(grad_output, expected, lookups, slot_of_index, "mean", optimizer_kind,
                              **HYPER_PARAMETERS)
    backward_update(grad_output, stores, lookups, slot_of_index, "mean", optimizer_kind, **HYPER_PARAMETERS)
    assert_stores_close(stores, expected, torch.float32)


@pytest.mark.gpu
def test_host_tier_in_pinned_memory(device):
    """HOST tables read and updated in place in pinned host memory, beside DEVICE and cached rows."""
    stores, lookups, slot_of_index = make_batch(optimizer_kind=ADAM, weighted=True, device=device)
    stores = stores._replace(host_weights=stores.host_weights.cpu().pin_memory(),
                             host_state=stores.host_state.cpu().pin_memory())
    assert stores.host_weights.is_pinned() and stores.host_weights.numel() > 0
    grad_output = torch.randn(lookups.batch_size, stores.total_dim, device=device)

    output = pooled_forward(stores, lookups, slot_of_index, "sum")
    torch.testing.assert_close(output.double(), reference_forward(stores, lookups, slot_of_index, "sum"),
                               rtol=1e-5, atol=1e-5)
    expected = clone_stores(stores)
    reference_backward_update(grad_output, expected, lookups, slot_of_index, "sum", ADAM, **HYPER_PARAMETERS)
    backward_update(grad_output, stores, lookups, slot_of_index, "sum", ADAM, **HYPER_PARAMETERS)
    torch.cuda.synchronize()
    assert_stores_close(stores, expected, torch.float32)
