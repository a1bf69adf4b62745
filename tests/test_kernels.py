"""Triton kernels (kernels/forward.py, kernels/backward.py) against the float64 references.

Every check draws fresh random inputs: several tables with different dims (1, 3, 17, 33), tables
of one row, empty bags, rows repeated in a bag and across bags, per-sample weights, rows in a
small slot cache beside rows read from backing stores. Outputs the kernels allocate start as
NaN (``poison_empty``), so an element no program writes shows up. In CPU simulation the Triton
interpreter runs everything: sizes stay small.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from tiered_tbe.base.graphs import StepGraphs
from tiered_tbe.kernels import backward as backward_module
from tiered_tbe.kernels import forward as forward_module
from tiered_tbe.kernels.addressing import bag_length_class
from tiered_tbe.kernels.backward import BackwardConfig, backward_update, sort_lookups
from tiered_tbe.kernels.forward import pooled_forward
from tiered_tbe.kernels.linearize import linearize, linearize_tile
from tiered_tbe.kernels.optimizers import LAMB, OPTIMIZERS, SGD, Adagrad, Adam, PartialRowwiseAdam, RowwiseAdagrad
from tiered_tbe.kernels.optimizers.adam import bias_correction
from tiered_tbe.kernels.per_sample_weights import per_sample_weights_grad
from tiered_tbe.kernels.reference import (
    reference_backward_update,
    reference_forward,
    reference_per_sample_weights_grad,
)
from tiered_tbe.kernels.rows import Lookups, RowStores, no_cache

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# One unit in the last place at 1.0 of each weights dtype: the tolerance of a row rounded once.
ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
UNPOISONED_EMPTY = torch.empty  # for buffers the test itself must leave untouched
# Every registered optimizer with hyper-parameters that make each term matter.
ALL_OPTIMIZERS = {
    "sgd": SGD(lr=0.05),
    "rowwise_adagrad": RowwiseAdagrad(lr=0.05, eps=1e-3),
    "adagrad": Adagrad(lr=0.05, eps=1e-3),
    "adam": Adam(lr=0.05, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.01),
    "partial_rowwise_adam": PartialRowwiseAdam(lr=0.05, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.01),
    "lamb": LAMB(lr=0.05, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.01),
}
assert set(ALL_OPTIMIZERS) == set(OPTIMIZERS), "a registered optimizer has no kernel test"
STEP = 3


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


def make_stores(dims, num_rows, dtype, optimizer, num_slots, device) -> RowStores:
    """Random rows (and positive optimizer state) for tables of ``dims`` x ``num_rows``.

    The tables live in one flat buffer each for weights and state, as the module lays them
    out, so the kernels' per-table addresses point into shared allocations."""
    weights_flat = torch.randn(sum(r * d for r, d in zip(num_rows, dims)), device=device).to(dtype)
    widths = [optimizer.state_width(d) if optimizer is not None else 0 for d in dims]
    # Adagrad sums and second moments must be >= 0; first moments may be anything, positive is fine.
    state_flat = torch.rand(sum(r * w for r, w in zip(num_rows, widths)), device=device) * 0.1
    weights, states, w_at, s_at = [], [], 0, 0
    for rows, dim, width in zip(num_rows, dims, widths):
        weights.append(weights_flat[w_at : w_at + rows * dim].view(rows, dim))
        states.append(state_flat[s_at : s_at + rows * width].view(rows, width) if width else None)
        w_at, s_at = w_at + rows * dim, s_at + rows * width
    cache_width = max(1, max(widths))
    cache_weights = torch.randn(num_slots, max(dims), device=device).to(dtype)
    cache_state = torch.rand(num_slots, cache_width, device=device) * 0.1
    return RowStores(tuple(weights), tuple(states), cache_weights, cache_state)


def make_batch(dims=(3, 17, 33, 1), num_rows=(7, 1, 40, 5), batch_size=5, max_bag=6, dtype=torch.float32,
               optimizer=None, weighted=False, num_slots=8, index_dtype=torch.int64, device="cpu"):
    """``(stores, lookups, slot_of_index)``: a random batch over random tables.

    Every fourth bag is empty; half the lookups hit one of a table's first three rows, so rows
    repeat within bags and across bags. Up to ``num_slots`` of the rows used sit in the slot cache,
    where their (newer) copy differs from the backing store's.
    """
    num_tables = len(dims)
    stores = make_stores(dims, num_rows, dtype, optimizer, num_slots, device)
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
    global_rows = stores.table_row_offset[table_of_index] + indices
    per_sample_weights = torch.rand(num_lookups, device=device) + 0.5 if weighted else None
    lookups = Lookups(indices.to(index_dtype), offsets.to(index_dtype), batch_size, per_sample_weights)

    used_rows = torch.unique(global_rows)
    cached_rows = used_rows[torch.randperm(used_rows.numel(), device=device)[: min(num_slots, used_rows.numel() // 2)]]
    slot_of_row = torch.full((sum(num_rows),), -1, dtype=torch.int32, device=device)
    slot_of_row[cached_rows] = torch.randperm(num_slots, device=device)[: cached_rows.numel()].int()
    slot_of_index = slot_of_row[global_rows]
    return stores, lookups, slot_of_index


def assert_stores_close(actual: RowStores, expected: RowStores, dtype: torch.dtype) -> None:
    """Every weight (rounded once in ``dtype``) and state value of the two stores agree."""
    rtol = 2 * ULP[dtype] if dtype != torch.float32 else 1e-5
    pairs = [(f"table {t} weights", a, e) for t, (a, e) in enumerate(zip(actual.table_weights, expected.table_weights))]
    pairs.append(("cache_weights", actual.cache_weights, expected.cache_weights))
    for name, a, e in pairs:
        torch.testing.assert_close(a.float().cpu(), e.float().cpu(), rtol=rtol, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    states = [(f"table {t} state", a, e) for t, (a, e) in enumerate(zip(actual.table_state, expected.table_state))
              if a is not None]
    for name, a, e in states + [("cache_state", actual.cache_state, expected.cache_state)]:
        torch.testing.assert_close(a.cpu(), e.cpu(), rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


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


@pytest.mark.parametrize("pooling", ["sum", "mean", "none"])
def test_every_forward_tile_matches_reference(pooling, device):
    """Each tile shape the GPU autotuner may pick (the interpreter runs a single one otherwise):
    bags shorter and longer than a step, more bags than a tile, weighted lookups, slots beside
    backing rows."""
    stores, lookups, slot_of_index = make_batch(batch_size=9, max_bag=11, weighted=True, device=device)
    expected = reference_forward(stores, lookups, slot_of_index, pooling)
    for tile in forward_module.FORWARD_TILES:
        output = pooled_forward(stores, lookups, slot_of_index, pooling, tile=tile)
        torch.testing.assert_close(output.double(), expected, rtol=1e-5, atol=1e-5, msg=lambda m, t=tile: f"{t}: {m}")


@pytest.mark.parametrize("pooling", ["sum", "mean", "none"])
def test_forward_through_step_graphs_reads_and_writes_each_calls_own_tensors(pooling, device):
    """Through a StepGraphs (the module's) the kernel reads the addresses of its batch's tensors and
    output from one small tensor, so that a CUDA graph of the launch serves every batch of a shape (on
    the GPU: captured on the second call, replayed from the third), bags of other lengths included
    when pooled. Every call's output equals the direct launch's bit for bit, each kept alive while
    later calls run: a replay reads its own call's lookups and writes its own output."""
    num_rows = (7, 1, 40, 5)
    stores, lookups, slot_of_index = make_batch(num_rows=num_rows, weighted=True, device=device)
    # Batches of one shape (the key of a graph): the same bags, the lookups' rows and weights redrawn.
    bags = torch.repeat_interleave(torch.arange(lookups.offsets.numel() - 1, device=device), lookups.offsets.diff())
    rows_of_index = torch.tensor(num_rows, device=device)[bags // lookups.batch_size]
    batches = [lookups._replace(indices=(lookups.indices + shift) % rows_of_index,
                                per_sample_weights=torch.rand(lookups.num_lookups, device=device) + 0.5)
               for shift in range(4)]
    # Fewer lookups in the same bags: a pooled forward's graph serves it too.
    shorter = batches[0].num_lookups - 5
    batches.append(batches[1]._replace(indices=batches[1].indices[:shorter],
                                       offsets=batches[1].offsets.clamp(max=shorter),
                                       per_sample_weights=batches[1].per_sample_weights[:shorter]))
    slots = [slot_of_index[:batch.num_lookups] for batch in batches]
    graphs = StepGraphs()
    outputs = [pooled_forward(stores, batch, slot, pooling, graphs=graphs) for batch, slot in zip(batches, slots)]
    for batch, slot, output in zip(batches, slots, outputs):
        assert torch.equal(output, pooled_forward(stores, batch, slot, pooling))
        torch.testing.assert_close(output.double(), reference_forward(stores, batch, slot, pooling),
                                   rtol=1e-5, atol=1e-5)
    if graphs.enabled:
        num_bags = batches[0].offsets.numel() - 1
        same_key = pooling != "none" and (bag_length_class(shorter, num_bags)
                                          == bag_length_class(batches[0].num_lookups, num_bags))
        assert graphs.captures == 1 and graphs.replays == (4 if same_key else 3)


@pytest.mark.gpu
@pytest.mark.parametrize("pooling", ["sum", "mean", "none"])
def test_graphed_forward_replays_each_calls_tensors_on_the_gpu(pooling):
    """The test above where its graphs are captured and replayed (the GPU suite runs gpu-marked tests)."""
    test_forward_through_step_graphs_reads_and_writes_each_calls_own_tensors(pooling, torch.device("cuda"))


def test_forward_tile_override_replaces_the_autotuner(monkeypatch, device):
    """TIERED_TBE_FORWARD_TILE (tuning sweeps: bench_fbgemm --forward-tiles) runs its tile, bypassing
    the autotuner, with the same result."""
    stores, lookups, slot_of_index = make_batch(device=device)
    launched = []
    tuned = forward_module._pooled_forward_kernel

    class Recorder:
        def __getitem__(self, grid):
            raise AssertionError("the autotuner ran despite the override")

        class fn:  # noqa: N801  (stands in for the autotuner's JITFunction attribute)
            def __class_getitem__(cls, grid):
                def launch(*args, **kwargs):
                    launched.append({k: kwargs[k] for k in ("BLOCK_B", "BLOCK_L", "num_warps", "GROUPS", "STAGES")})
                    return tuned.fn[grid](*args, **kwargs)
                return launch

    monkeypatch.setattr(forward_module, "_pooled_forward_kernel", Recorder())
    monkeypatch.setenv("TIERED_TBE_FORWARD_TILE", "4,1,2")
    output = pooled_forward(stores, lookups, slot_of_index, "sum")
    assert launched == [dict(BLOCK_B=4, BLOCK_L=1, num_warps=2, GROUPS=1, STAGES=1)]
    torch.testing.assert_close(output.double(), reference_forward(stores, lookups, slot_of_index, "sum"),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bag_size", [1, 3, 8])
def test_pooled_forward_fixed_bag_sizes_and_int32_inputs(bag_size, device):
    """Bags of one lookup (many bags a tile), and longer fixed bags; int32 indices and offsets
    are read as they are."""
    dims, num_rows, batch_size = (8, 5), (30, 2), 7
    stores = make_stores(dims, num_rows, torch.float32, None, 0, device)
    stores = stores.replace(**dict(zip(("cache_weights", "cache_state"), no_cache(torch.float32, device))))
    num_lookups = len(dims) * batch_size * bag_size
    tables = torch.arange(len(dims), device=device).repeat_interleave(batch_size * bag_size)
    indices = (torch.rand(num_lookups, device=device) * torch.tensor(num_rows, device=device)[tables]).int()
    offsets = torch.arange(0, num_lookups + 1, bag_size, device=device, dtype=torch.int32)
    lookups = Lookups(indices, offsets, batch_size)

    for pooling in ("sum", "mean"):
        output = pooled_forward(stores, lookups, None, pooling)
        torch.testing.assert_close(output.double(), reference_forward(stores, lookups, None, pooling),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_pooled_forward_none_gives_each_lookups_row(weighted, device):
    stores, lookups, slot_of_index = make_batch(dims=(17, 17), num_rows=(1, 30), weighted=weighted, device=device)

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
            assert torch.all(output[sample, start : start + stores.dims[table]] == 0)


def test_pooled_forward_without_lookups(device):
    """N = 0: sum and mean outputs are all zeros, and no kernel reads an index."""
    stores, lookups, slot_of_index = make_batch(max_bag=0, device=device)
    assert lookups.num_lookups == 0
    output = pooled_forward(stores, lookups, slot_of_index, "mean")
    assert torch.all(output == 0)
    assert pooled_forward(stores, lookups, slot_of_index, "none").shape == (0, stores.max_dim)


def test_pooled_forward_without_cache(device):
    stores, lookups, _ = make_batch(num_slots=0, device=device)
    stores = stores.replace(**dict(zip(("cache_weights", "cache_state"), no_cache(torch.float32, device))))

    output = pooled_forward(stores, lookups, None, "sum")

    torch.testing.assert_close(output.double(), reference_forward(stores, lookups, None, "sum"), rtol=1e-5, atol=1e-5)


def test_row_stores_reject_mixed_dtypes_and_bad_pooling(device):
    stores, lookups, slot_of_index = make_batch(device=device)
    with pytest.raises(TypeError, match="share one dtype"):
        stores.replace(table_weights=(stores.table_weights[0].half(), *stores.table_weights[1:]))
    with pytest.raises(ValueError, match="pooling"):
        pooled_forward(stores, lookups, slot_of_index, "max")


def _one_table_stores(weights: torch.Tensor) -> RowStores:
    """RowStores of one table (SGD: no state, no cache) whose rows are ``weights`` [rows, dim]."""
    return RowStores((weights,), (None,), *no_cache(weights.dtype, weights.device))


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
    far_stores = _one_table_stores(store.view(-1, dim))
    compact_stores = _one_table_stores(compact.view(-1, dim))
    offsets = torch.tensor([0, 2, 4], device=device)
    far_lookups = Lookups(torch.tensor([far_row, far_row + 7, 5, far_row], device=device), offsets, 2)
    compact_lookups = Lookups(torch.tensor([0, 1, 2, 0], device=device), offsets, 2)

    output = pooled_forward(far_stores, far_lookups, None, "sum")
    torch.testing.assert_close(output.double(), reference_forward(compact_stores, compact_lookups, None, "sum"))

    grad_output = torch.randn(2, dim, device=device)
    reference_backward_update(grad_output, compact_stores, compact_lookups, None, "sum", SGD(lr=0.5))
    backward_update(grad_output, far_stores, far_lookups, None, "sum", SGD(lr=0.5))
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
    stores, lookups, slot_of_index = make_batch(dims=(9, 9, 9), num_rows=(4, 1, 12), weighted=True, device=device)
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


@pytest.mark.parametrize("name", sorted(ALL_OPTIMIZERS))
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_backward_update_matches_reference(pooling, name, device):
    optimizer = ALL_OPTIMIZERS[name]
    stores, lookups, slot_of_index = make_batch(optimizer=optimizer, weighted=pooling == "sum", device=device)
    grad_output = torch.randn(lookups.batch_size, stores.total_dim, device=device)
    expected = stores.clone()

    reference_backward_update(grad_output, expected, lookups, slot_of_index, pooling, optimizer, STEP)
    backward_update(grad_output, stores, lookups, slot_of_index, pooling, optimizer, STEP)

    assert_stores_close(stores, expected, torch.float32)


@pytest.mark.parametrize("lanes", [1, 4])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_backward_row_update_lanes(pooling, lanes, device):
    """The row-update kernel walks each run one lookup a step (lanes=1, a 2-D tile, each next bag
    loaded ahead) or several (a [rows, lanes, columns] tile summed over its lanes): both match the
    reference, with per-sample weights, slots and runs longer than a step."""
    optimizer = ALL_OPTIMIZERS["rowwise_adagrad"]
    # A table of 400 rows and 12 bags a table: runs of one lookup (the uniform rows) beside long
    # runs (the hot rows); with make_batch's default sizes ~5% of batches had no tile of single lookups.
    stores, lookups, slot_of_index = make_batch(num_rows=(7, 1, 400, 5), batch_size=12, optimizer=optimizer,
                                                weighted=pooling == "sum", device=device)
    grad_output = torch.randn(lookups.batch_size, stores.total_dim, device=device)
    expected = stores.clone()
    sorted_lookups = sort_lookups(stores, lookups)
    ends = sorted_lookups.run_end[: int(sorted_lookups.num_runs)].long()
    run_lengths = ends - torch.cat([ends.new_zeros(1), ends[:-1]])
    longest_of_tile = torch.nn.functional.pad(run_lengths, (0, run_lengths.numel() % 2)).view(-1, 2).amax(1)
    assert (longest_of_tile == 1).any() and (longest_of_tile > lanes).any(), \
        "the batch must have tiles of single lookups (walked one lane) and runs longer than a step"

    reference_backward_update(grad_output, expected, lookups, slot_of_index, pooling, optimizer, STEP)
    # A chunk wider than every run: all rows go through the row-update kernel.
    backward_update(grad_output, stores, lookups, slot_of_index, pooling, optimizer, STEP,
                    config=BackwardConfig(rows=2, lanes=lanes, num_warps=4, chunk=1024),
                    sorted_lookups=sorted_lookups)

    assert_stores_close(stores, expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad", "adam"])
def test_backward_update_low_precision_weights(name, dtype, device):
    optimizer = ALL_OPTIMIZERS[name]
    stores, lookups, slot_of_index = make_batch(dtype=dtype, optimizer=optimizer, weighted=True, device=device)
    grad_output = torch.randn(lookups.batch_size, stores.total_dim, device=device)
    expected = stores.clone()

    reference_backward_update(grad_output, expected, lookups, slot_of_index, "sum", optimizer, STEP)
    backward_update(grad_output, stores, lookups, slot_of_index, "sum", optimizer, STEP)

    assert_stores_close(stores, expected, dtype)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_reference_sgd_step_is_the_autograd_gradient(pooling, device):
    """The reference itself, checked once: its SGD step is -lr times autograd's gradient of every row."""
    stores, lookups, slot_of_index = make_batch(dtype=torch.float64, weighted=True, device=device)
    leaves = [w.clone().requires_grad_() for w in stores.table_weights]
    cache_leaf = stores.cache_weights.clone().requires_grad_()
    output = reference_forward(stores.replace(table_weights=tuple(leaves), cache_weights=cache_leaf), lookups,
                               slot_of_index, pooling)
    grad_output = torch.randn(lookups.batch_size, stores.total_dim, device=device, dtype=torch.float64)
    (output * grad_output).sum().backward()

    reference_backward_update(grad_output, stores, lookups, slot_of_index, pooling, SGD(lr=0.25))

    for actual, leaf in zip((*stores.table_weights, stores.cache_weights), (*leaves, cache_leaf)):
        torch.testing.assert_close(actual, leaf.detach() - 0.25 * leaf.grad)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_backward_update_pooling_none(name, device):
    optimizer = ALL_OPTIMIZERS[name]
    stores, lookups, slot_of_index = make_batch(dims=(33, 33), num_rows=(20, 2), optimizer=optimizer,
                                                weighted=True, device=device)
    grad_output = torch.randn(lookups.num_lookups, 33, device=device)
    expected = stores.clone()

    reference_backward_update(grad_output, expected, lookups, slot_of_index, "none", optimizer, STEP)
    backward_update(grad_output, stores, lookups, slot_of_index, "none", optimizer, STEP)

    assert_stores_close(stores, expected, torch.float32)


CHUNK = 8  # the hot-row tests' window (a power of two)


def _segments_batch(lengths, dim, device, optimizer):
    """One table with a row per entry of ``lengths``, looked up that many times each (lookups
    shuffled, in bags of up to 3), some rows cached."""
    num_rows = len(lengths)
    stores = make_stores([dim], [num_rows], torch.float32, optimizer, 4, device)
    indices = torch.repeat_interleave(torch.arange(num_rows, device=device), torch.tensor(lengths, device=device))
    indices = indices[torch.randperm(indices.numel(), device=device)]
    bag_lengths = torch.randint(0, 4, (indices.numel(),), device=device)
    bag_lengths = bag_lengths[: int(torch.searchsorted(bag_lengths.cumsum(0), indices.numel())) + 1]
    bag_lengths[-1] = indices.numel() - bag_lengths[:-1].sum()
    offsets = torch.zeros(bag_lengths.numel() + 1, dtype=torch.int64, device=device)
    offsets[1:] = bag_lengths.cumsum(0)
    slot_of_row = torch.full((num_rows,), -1, dtype=torch.int32, device=device)
    slot_of_row[torch.randperm(num_rows, device=device)[:3]] = torch.arange(3, dtype=torch.int32, device=device)
    return stores, Lookups(indices, offsets, bag_lengths.numel()), slot_of_row[indices]


@pytest.mark.parametrize("tile", [(2, 2), (128, 1), (16, 8), (4, 32)])
def test_linearize_every_tile_matches_torch(tile, device):
    """Each lookup's global row and bag, for the tiles linearize_tile picks (one lane a bag up to
    a warp a bag), over bags of 0 to 70 lookups (several steps of 32 lanes) and int32 indices."""
    stores, lookups, _ = make_batch(batch_size=9, max_bag=70, index_dtype=torch.int32, device=device)
    lengths = lookups.offsets[1:] - lookups.offsets[:-1]
    bags = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths.long())
    expected_rows = stores.table_row_offset[bags // lookups.batch_size] + lookups.indices.long()
    for key_dtype in (torch.int32, torch.int64):
        result = linearize(stores, lookups, key_dtype=key_dtype, tile=tile)
        assert result.global_rows.dtype == key_dtype and result.bag_of_index.dtype == torch.int32
        assert torch.equal(result.global_rows.long(), expected_rows)
        assert torch.equal(result.bag_of_index.long(), bags)


def test_linearize_tile_follows_the_mean_bag_length():
    assert linearize_tile(65536 * 26, 65536 * 26) == (128, 1)  # Criteo: one lookup a bag
    assert linearize_tile(65536 * 32, 65536) == (4, 32)  # bags of 32: a warp a bag
    assert linearize_tile(65536 * 300, 65536) == (4, 32)  # longer bags loop over 32 lanes
    assert linearize_tile(10, 4) == (64, 2)
    assert linearize_tile(0, 0) == (128, 1)


def test_sort_lookups_from_a_sort_made_already(device):
    """Given the stable sort of the batch's rows (the cache's prefetch makes one), the grouping is
    the one it makes itself; a sort of another size is refused."""
    stores, lookups, _ = make_batch(batch_size=7, max_bag=9, device=device)
    lookups = linearize(stores, lookups, key_dtype=torch.int32)
    own = sort_lookups(stores, lookups)
    sorted_rows, order = torch.sort(lookups.global_rows, stable=True)
    given = sort_lookups(stores, lookups, (sorted_rows, order.to(torch.int32)))
    for name, expected, got in zip(own._fields, own, given):
        assert torch.equal(expected, got), name
    with pytest.raises(ValueError, match="presorted needs"):
        sort_lookups(stores, lookups, (own.sorted_rows[1:], own.order[1:]))


def test_sort_lookups_carrying_the_bags_groups_as_with_positions(device):
    """need_order=False (the sort carries each lookup's bag, no gather) groups the lookups as the
    sort by position does, in every field but the positions it does not make."""
    stores, lookups, _ = make_batch(batch_size=9, max_bag=12, device=device)
    lookups = linearize(stores, lookups, key_dtype=torch.int32)
    with_order = sort_lookups(stores, lookups)
    without = sort_lookups(stores, lookups, need_order=False)
    assert without.order is None
    for name, expected, got in zip(with_order._fields, with_order, without):
        if name != "order":
            assert torch.equal(expected, got), name


def test_sort_lookups_matches_torch(device):
    """Sorted rows, bags by sorted position, run counts and run ends (N past the last run: the
    kernels read those as empty runs) against plain torch, with memory just freed full of garbage
    so that an entry the kernels forget to write shows."""
    lengths = [1, 5, 2, 40, 1, 1, 3, 17]
    stores, lookups, _ = _segments_batch(lengths, 4, device, None)
    num_lookups = lookups.num_lookups
    for _ in range(3):  # garbage where the caching allocator will hand out the next int32 buffers
        torch.full((4 * num_lookups + 8,), -7, dtype=torch.int32, device=device)
    sorted_lookups = sort_lookups(stores, lookups)
    rows = lookups.indices.long()  # one table: global row = row
    expected_rows, expected_order = torch.sort(rows, stable=True)
    assert torch.equal(sorted_lookups.sorted_rows.long(), expected_rows)
    assert sorted_lookups.order.dtype == torch.int32
    assert torch.equal(sorted_lookups.order.long(), expected_order)
    bag_of_index = torch.repeat_interleave(torch.arange(lookups.batch_size, device=device),
                                           lookups.offsets.diff())
    assert torch.equal(sorted_lookups.sorted_bags.long(), bag_of_index[expected_order])
    _, counts = torch.unique_consecutive(expected_rows, return_counts=True)
    assert int(sorted_lookups.num_runs) == counts.numel()
    starts = torch.ones(num_lookups, dtype=torch.long, device=device)
    starts[1:] = (expected_rows[1:] != expected_rows[:-1]).long()
    assert torch.equal(sorted_lookups.run_count.long(), starts.cumsum(0))
    expected_end = torch.full((num_lookups,), num_lookups, dtype=torch.long, device=device)
    expected_end[: counts.numel()] = counts.cumsum(0)
    assert torch.equal(sorted_lookups.run_end.long(), expected_end)


@pytest.mark.parametrize("name, hot_shape", [("rowwise_adagrad", (4, 2, 4)), ("adam", (4, 2, 4)),
                                             ("rowwise_adagrad", (1, 1, 1)), ("adam", (8, 16, 2))])
def test_hot_rows_at_every_segment_length_around_the_split(name, hot_shape, device):
    """Rows looked up 1, 2, CHUNK - 1 .. CHUNK + 1, 2 CHUNK - 2 .. 2 CHUNK (where runs start holding
    a whole window of sorted positions and go to the hot kernels), 5 CHUNK + 3 times, and over
    3 HOT_GROUP windows (where whole groups of windows are summed first); with the hot kernels
    looking at one window a program and at more windows than a run holds
    (``hot_shape``: BackwardConfig's hot_windows, sum_windows, sum_warps)."""
    optimizer = ALL_OPTIMIZERS[name]
    c = CHUNK
    lengths = [1, 2, c - 1, c, c + 1, 2 * c - 2, 2 * c - 1, 2 * c, 5 * c + 3, 1, 2 * c - 1,
               3 * backward_module.HOT_GROUP * c + 5]
    stores, lookups, slot_of_index = _segments_batch(lengths, 12, device, optimizer)
    hot_windows, sum_windows, sum_warps = hot_shape
    config = BackwardConfig(rows=2, lanes=2, num_warps=4, chunk=c, hot_windows=hot_windows, sum_windows=sum_windows,
                            sum_warps=sum_warps)
    sorted_lookups = sort_lookups(stores, lookups)
    ends = sorted_lookups.run_end[: int(sorted_lookups.num_runs)].long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    hot = ((starts + c - 1) // c + 1) * c <= ends
    assert hot.any() and (~hot).any(), "the batch must use both the hot and the row-update kernels"
    grad_output = torch.randn(lookups.batch_size, 12, device=device)
    expected = stores.clone()

    reference_backward_update(grad_output, expected, lookups, slot_of_index, "mean", optimizer, STEP)
    backward_update(grad_output, stores, lookups, slot_of_index, "mean", optimizer, STEP, config=config,
                    sorted_lookups=sorted_lookups)

    assert_stores_close(stores, expected, torch.float32)


def test_one_row_looked_up_100k_times(device):
    """A table of one row, 100,000 lookups in 1000 bags of 100: one hot run of many windows."""
    num_lookups, bags = 100_000, 1000
    stores = make_stores([16], [1], torch.float32, ALL_OPTIMIZERS["rowwise_adagrad"], 0, device)
    stores = stores.replace(**dict(zip(("cache_weights", "cache_state"), no_cache(torch.float32, device))))
    lookups = Lookups(torch.zeros(num_lookups, dtype=torch.int64, device=device),
                      torch.arange(0, num_lookups + 1, num_lookups // bags, device=device), bags,
                      global_rows=torch.zeros(num_lookups, dtype=torch.int64, device=device),
                      bag_of_index=torch.arange(bags, dtype=torch.int32, device=device).repeat_interleave(
                          num_lookups // bags))
    grad_output = torch.randn(bags, 16, device=device)
    expected = stores.clone()
    optimizer = ALL_OPTIMIZERS["rowwise_adagrad"]

    reference_backward_update(grad_output, expected, lookups, None, "sum", optimizer, STEP)
    # Wide tiles keep the interpreter's program count low (it runs programs one after another).
    backward_update(grad_output, stores, lookups, None, "sum", optimizer, STEP,
                    config=BackwardConfig(rows=4096, lanes=1, num_warps=4, chunk=1024))

    assert_stores_close(stores, expected, torch.float32)


def test_backward_update_leaves_backing_rows_of_cached_lookups(device):
    """A cached row is updated in its slot only; its (older) backing copy stays as it was."""
    optimizer = ALL_OPTIMIZERS["rowwise_adagrad"]
    stores, lookups, slot_of_index = make_batch(dims=(8,), num_rows=(6,), num_slots=3, optimizer=optimizer,
                                                device=device)
    cached_rows = torch.unique(lookups.indices[slot_of_index >= 0])
    assert cached_rows.numel() > 0
    before = stores.table_weights[0][cached_rows].clone()
    state_before = stores.table_state[0][cached_rows].clone()
    grad_output = torch.randn(lookups.batch_size, 8, device=device)

    backward_update(grad_output, stores, lookups, slot_of_index, "sum", optimizer)

    assert torch.equal(stores.table_weights[0][cached_rows], before)
    assert torch.equal(stores.table_state[0][cached_rows], state_before)


def test_empty_batch_changes_nothing(device):
    stores, lookups, slot_of_index = make_batch(max_bag=0, optimizer=ALL_OPTIMIZERS["adam"], device=device)
    untouched = stores.clone()
    backward_update(torch.randn(lookups.batch_size, stores.total_dim, device=device), stores, lookups,
                    slot_of_index, "sum", ALL_OPTIMIZERS["adam"])
    for actual, before in zip((*stores.table_weights, stores.cache_weights), (*untouched.table_weights,
                                                                           untouched.cache_weights)):
        assert torch.equal(actual, before)


def test_backward_update_rejects_bad_arguments(device):
    stores, lookups, slot_of_index = make_batch(device=device)
    grad_output = torch.randn(lookups.batch_size, stores.total_dim, device=device)
    sgd = SGD(lr=1.0)
    with pytest.raises(ValueError, match="shape"):
        backward_update(grad_output[:, 1:], stores, lookups, slot_of_index, "sum", sgd)
    with pytest.raises(ValueError, match="power of two"):
        backward_update(grad_output, stores, lookups, slot_of_index, "sum", sgd,
                        config=BackwardConfig(2, 2, 4, 3))
    with pytest.raises(TypeError, match="slot_of_index"):
        backward_update(grad_output, stores, lookups, slot_of_index.long(), "sum", sgd)
    with pytest.raises(TypeError, match="FusedOptimizer"):
        backward_update(grad_output, stores, lookups, slot_of_index, "sum", "sgd")
    with pytest.raises(ValueError, match="1-based"):
        backward_update(grad_output, stores, lookups, slot_of_index, "sum", sgd, step=0)


@pytest.mark.parametrize("name, first_step", [("adagrad", 1), ("adam", 1), ("partial_rowwise_adam", 1), ("lamb", 1),
                                              ("adam", 70_001)])
def test_new_optimizers_over_many_steps(name, first_step, device):
    """Ten steps of the same batch shape with fresh gradients: the kernels track the reference
    (state carried from step to step, bias corrections by step, computed by the kernels from the
    step: at 70,001 over 17 of its bits)."""
    optimizer = ALL_OPTIMIZERS[name]
    stores, lookups, slot_of_index = make_batch(dims=(5, 12), num_rows=(9, 3), optimizer=optimizer,
                                                weighted=True, device=device)
    expected = stores.clone()
    for step in range(first_step, first_step + 10):
        grad_output = torch.randn(lookups.batch_size, stores.total_dim, device=device)
        reference_backward_update(grad_output, expected, lookups, slot_of_index, "sum", optimizer, step)
        backward_update(grad_output, stores, lookups, slot_of_index, "sum", optimizer, step)
    assert_stores_close(stores, expected, torch.float32)


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
        stores = _one_table_stores(weights.clone())
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


# ---------------------------------------------------------------------------------------------
# GPU only
# ---------------------------------------------------------------------------------------------


def _zipf_batch(num_rows, dim, batch_size, bag_size, device, dtype=torch.float32, optimizer=None):
    """One table, fixed-size bags, rows drawn from a Zipf(1.05)-like law: hot rows with
    thousands of lookups (many windows) beside rows seen once."""
    stores = make_stores([dim], [num_rows], dtype, optimizer, 0, device)
    stores = stores.replace(**dict(zip(("cache_weights", "cache_state"), no_cache(dtype, device))))
    num_lookups = batch_size * bag_size
    ranks = torch.arange(1, num_rows + 1, device=device, dtype=torch.float64)
    cdf = torch.cumsum(ranks**-1.05, 0)
    indices = torch.searchsorted(cdf / cdf[-1], torch.rand(num_lookups, device=device, dtype=torch.float64))
    indices = torch.randperm(num_rows, device=device)[indices.clamp(max=num_rows - 1)]
    offsets = torch.arange(0, num_lookups + 1, bag_size, device=device)
    return stores, Lookups(indices, offsets, batch_size)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_two_identical_steps_are_bitwise_equal(dtype, device):
    """At a size where many programs run at once, forward and update are deterministic."""
    optimizer = RowwiseAdagrad(lr=0.01)
    stores, lookups = _zipf_batch(1_000_000, 128, 16384, 32, device, dtype, optimizer)
    counts = torch.unique(lookups.indices, return_counts=True)[1]
    assert counts.max() > 4 * backward_module.default_config(128).chunk  # hot rows take the hot kernels
    grad_output = torch.randn(lookups.batch_size, 128, device=device)

    outputs, results = [], []
    for _ in range(2):
        step_stores = stores.clone()
        outputs.append(pooled_forward(step_stores, lookups, None, "sum"))
        backward_update(grad_output, step_stores, lookups, None, "sum", optimizer, step=3, stochastic_rounding=True,
                        seed=5)
        results.append(step_stores)
    assert torch.equal(outputs[0], outputs[1])
    assert torch.equal(results[0].table_weights[0], results[1].table_weights[0])
    assert torch.equal(results[0].table_state[0], results[1].table_state[0])


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(ALL_OPTIMIZERS))
def test_large_batch_matches_reference(name, device):
    """dim 128 and long bags: the autotuned forward tiles and the default window on hot rows."""
    optimizer = ALL_OPTIMIZERS[name]
    stores, lookups = _zipf_batch(50_000, 128, 2048, 40, device, optimizer=optimizer)
    grad_output = torch.randn(lookups.batch_size, 128, device=device)
    for pooling in ("sum", "mean"):
        torch.testing.assert_close(pooled_forward(stores, lookups, None, pooling).double(),
                                   reference_forward(stores, lookups, None, pooling), rtol=1e-5, atol=1e-4)
    expected = stores.clone()
    reference_backward_update(grad_output, expected, lookups, None, "mean", optimizer, STEP)
    backward_update(grad_output, stores, lookups, None, "mean", optimizer, STEP)
    assert_stores_close(stores, expected, torch.float32)


@pytest.mark.gpu
def test_tables_in_pinned_host_memory(device):
    """Tables read and updated in place in pinned host memory, beside device tables and cached rows."""
    optimizer = ALL_OPTIMIZERS["adam"]
    stores, lookups, slot_of_index = make_batch(optimizer=optimizer, weighted=True, device=device)
    pinned = stores.replace(table_weights=tuple(w.cpu().pin_memory() if t % 2 else w
                                                for t, w in enumerate(stores.table_weights)),
                            table_state=tuple(s.cpu().pin_memory() if t % 2 and s is not None else s
                                              for t, s in enumerate(stores.table_state)))
    assert pinned.table_weights[1].is_pinned()
    grad_output = torch.randn(lookups.batch_size, stores.total_dim, device=device)

    output = pooled_forward(pinned, lookups, slot_of_index, "sum")
    torch.testing.assert_close(output.double(), reference_forward(pinned, lookups, slot_of_index, "sum"),
                               rtol=1e-5, atol=1e-5)
    expected = pinned.clone()
    reference_backward_update(grad_output, expected, lookups, slot_of_index, "sum", optimizer, STEP)
    backward_update(grad_output, pinned, lookups, slot_of_index, "sum", optimizer, STEP)
    torch.cuda.synchronize()
    assert_stores_close(pinned, expected, torch.float32)
