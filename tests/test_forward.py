"""The pooled forward (kernels/forward.py) and the per-sample-weight gradient
(kernels/per_sample_weights.py) against the float64 references, and how rows are addressed
(kernels/rows.py, kernels/addressing.py). Inputs: tests/kernel_inputs.py."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import (  # noqa: F401  (poison_empty: an autouse fixture, active where imported)
    ALL_OPTIMIZERS,
    DTYPES,
    ULP,
    UNPOISONED_EMPTY,
    make_batch,
    make_stores,
    one_table_stores,
    poison_empty,
)

from tiered_tbe.base import descriptors
from tiered_tbe.base.descriptors import descriptor_row
from tiered_tbe.base.graphs import StepGraphs, padded_size
from tiered_tbe.kernels import forward as forward_module
from tiered_tbe.kernels.addressing import bag_length_class
from tiered_tbe.kernels.backward import backward_update
from tiered_tbe.kernels.forward import ForwardTile, pooled_forward
from tiered_tbe.kernels.optimizers import SGD
from tiered_tbe.kernels.per_sample_weights import per_sample_weights_grad
from tiered_tbe.kernels.reference import (
    reference_backward_update,
    reference_forward,
    reference_per_sample_weights_grad,
)
from tiered_tbe.kernels.rows import Lookups, no_cache


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


# Features looking up tables (RowStores.feature_table_map): two of table 0, three of table 2 out of order.
SHARED_MAP = (2, 0, 1, 2, 3, 0, 2)


@pytest.mark.parametrize("pooling", ["sum", "mean", "none"])
def test_features_sharing_a_table_pool_their_own_bags(pooling, device):
    """Each feature's bags in its own columns (or rows, pooling none), rows read from the table it
    names; slots beside backing rows, per-sample weights."""
    dims = (8, 8, 8, 8) if pooling == "none" else (3, 17, 33, 1)
    stores, lookups, slot_of_index = make_batch(dims=dims, weighted=True, feature_table_map=SHARED_MAP,
                                                batch_size=6, device=device)
    assert stores.num_features == 7 and stores.shares_tables
    assert stores.output_offsets == (0, 33, 36, 53, 86, 87, 90) if pooling != "none" else True
    output = pooled_forward(stores, lookups, slot_of_index, pooling)
    assert output.shape == ((lookups.batch_size, 123) if pooling != "none" else (lookups.num_lookups, 8))
    torch.testing.assert_close(output.double(), reference_forward(stores, lookups, slot_of_index, pooling),
                               rtol=1e-5, atol=1e-5)
    grad_output = torch.randn(output.shape, device=device)
    torch.testing.assert_close(
        per_sample_weights_grad(grad_output, stores, lookups, slot_of_index, pooling).double(),
        reference_per_sample_weights_grad(grad_output, stores, lookups, slot_of_index, pooling), rtol=1e-5, atol=1e-5)


def test_features_sharing_a_table_share_its_descriptor_rows(device):
    """A descriptor row per feature: a table's features have its addresses, strides, dim and
    global row offset, and each its own output column; offsets of the wrong count name F."""
    stores, lookups, _ = make_batch(feature_table_map=SHARED_MAP, device=device)
    for f, t in enumerate(SHARED_MAP):
        row = descriptor_row(stores.descriptor, f)
        assert row["weights_address"] == stores.table_weights[t].data_ptr()
        assert row["row_offset"] == stores.row_offsets[t] and row["dim"] == stores.dims[t]
        assert row["output_offset"] == stores.output_offsets[f] == sum(stores.dims[u] for u in SHARED_MAP[:f])
    with pytest.raises(ValueError, match=r"F\*B\+1 = 15 entries \(7 features\)"):
        pooled_forward(stores, lookups._replace(offsets=lookups.offsets[:14], batch_size=2), None, "sum")
    with pytest.raises(ValueError, match="feature_table_map must name tables"):
        stores.replace(feature_table_map=(0, 4))


@pytest.mark.parametrize("pooling", ["sum", "mean", "none"])
def test_every_forward_tile_matches_reference(pooling, device):
    """Each tile shape the GPU autotuner may pick (the interpreter runs a single one otherwise):
    bags shorter and longer than a step, more bags than a tile, weighted lookups, slots beside
    backing rows. Of the tiles with more bags for narrow columns, the widest of each shape (those
    of 16 bags and more hold all 9 bags of a feature: their narrower siblings run the same way)."""
    stores, lookups, slot_of_index = make_batch(batch_size=9, max_bag=11, weighted=True, device=device)
    expected = reference_forward(stores, lookups, slot_of_index, pooling)
    tuned = {ForwardTile(*shape) for shapes in (*forward_module._SHAPES_BY_CLASS.values(),
                                                forward_module._LONG_BAG_SHAPES) for shape in shapes}
    widest = {tile._replace(bags=tile.bags * forward_module.MAX_WIDER_BAGS) for tile in tuned}
    assert tuned | widest <= set(forward_module.FORWARD_TILES)
    for tile in sorted(tuned | widest):
        output = pooled_forward(stores, lookups, slot_of_index, pooling, tile=tile)
        torch.testing.assert_close(output.double(), expected, rtol=1e-5, atol=1e-5, msg=lambda m, t=tile: f"{t}: {m}")


@pytest.mark.parametrize("pooling", ["sum", "mean", "none"])
def test_forward_through_step_graphs_reads_and_writes_each_calls_own_tensors(pooling, device):
    """Through a StepGraphs (the module's) the kernel reads the addresses of its batch's tensors and
    output from one small tensor, so that a CUDA graph of the launch serves every batch of a shape (on
    the GPU: captured on the second call, replayed from the third), bags of other lengths included
    when pooled (pooling none: of the same padded size). Every call's output equals the direct
    launch's bit for bit, each kept alive while later calls run: a replay reads its own call's
    lookups and writes its own output."""
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
        # Pooling none's key holds its output's padded size (padded_size): the same for both, or not.
        same_key = (bag_length_class(shorter, num_bags) == bag_length_class(batches[0].num_lookups, num_bags)
                    and (pooling != "none" or padded_size(shorter) == padded_size(batches[0].num_lookups)))
        assert graphs.captures == 1 and graphs.replays == (4 if same_key else 3)


@pytest.mark.gpu
@pytest.mark.parametrize("pooling", ["sum", "mean", "none"])
def test_graphed_forward_replays_each_calls_tensors_on_the_gpu(pooling):
    """The test above where its graphs are captured and replayed (the GPU suite runs gpu-marked tests)."""
    test_forward_through_step_graphs_reads_and_writes_each_calls_own_tensors(pooling, torch.device("cuda"))


def test_forward_tile_override_replaces_the_autotuner(monkeypatch, device):
    """TIERED_TBE_FORWARD_TILE (tuning sweeps: bench_fbgemm --forward-tiles) runs its tile, bypassing
    the autotuner, with the same result (in each launch: one per column group)."""
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
    assert len(stores.column_groups) == 3
    assert launched == [dict(BLOCK_B=4, BLOCK_L=1, num_warps=2, GROUPS=1, STAGES=1)] * 3
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
            start = stores.output_offsets[table]
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


def test_row_stores_describe_each_table_in_one_descriptor(device):
    """The kernels' one int64 descriptor (base/descriptors.py): per table, the addresses of row 0
    of its weights and state, their strides, its rows, dim, global row offset, output column and
    its own number (the feature); a table without state has address, stride and width 0; a row is one 128-byte line."""
    stores, _, _ = make_batch(optimizer=ALL_OPTIMIZERS["adam"], device=device)
    assert stores.descriptor.dtype == torch.int64 and stores.descriptor.shape == (stores.num_tables, 16)
    assert stores.descriptor.device == stores.cache_weights.device
    row_offset = column = 0
    for t, (weights, state) in enumerate(zip(stores.table_weights, stores.table_state)):
        assert descriptor_row(stores.descriptor, t) == dict(
            weights_address=weights.data_ptr(), weights_stride=weights.stride(0), state_address=state.data_ptr(),
            state_stride=state.stride(0), state_width=state.shape[1], row_offset=row_offset,
            num_rows=weights.shape[0], dim=weights.shape[1], output_offset=column, feature=t)
        row_offset, column = row_offset + weights.shape[0], column + weights.shape[1]
    assert not stores.descriptor[:, len(descriptors.COLUMN_NAMES):].any()
    no_state = make_batch(optimizer=ALL_OPTIMIZERS["sgd"], device=device)[0]
    assert not no_state.descriptor[:, [descriptors.STATE_ADDRESS, descriptors.STATE_STRIDE,
                                       descriptors.STATE_WIDTH]].any()


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
    far_stores = one_table_stores(store.view(-1, dim))
    compact_stores = one_table_stores(compact.view(-1, dim))
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
