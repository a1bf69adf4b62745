"""The backward with the fused optimizers (kernels/backward.py, kernels/hot_rows.py) against the
float64 reference: every optimizer, pooling, weights dtype, run length around the hot-row split,
cached and uncached rows. Inputs: tests/kernel_inputs.py."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import (  # noqa: F401  (poison_empty: an autouse fixture, active where imported)
    ALL_OPTIMIZERS,
    CHUNK,
    STEP,
    assert_stores_close,
    make_batch,
    make_stores,
    poison_empty,
    segments_batch,
    zipf_batch,
)

from tiered_tbe.kernels import backward as backward_module
from tiered_tbe.kernels.backward import BackwardConfig, backward_update, sort_lookups
from tiered_tbe.kernels.forward import pooled_forward
from tiered_tbe.kernels.optimizers import SGD, RowwiseAdagrad
from tiered_tbe.kernels.reference import (
    reference_backward_update,
    reference_forward,
)
from tiered_tbe.kernels.rows import Lookups, no_cache


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


@pytest.mark.parametrize("name", sorted(ALL_OPTIMIZERS))
def test_features_sharing_a_table_update_each_row_once(name, device):
    """Two features of table 0 and three of table 2 (out of order): a row's lookups from several
    features are one run, their gradients (each from its own feature's columns) summed before one
    update. Small windows put the shared rows through the hot-row kernels too, and the row-update
    kernel walks them one lane and two lanes a step."""
    optimizer = ALL_OPTIMIZERS[name]
    feature_table_map = (2, 0, 1, 2, 3, 0, 2)
    for lanes, pooling in ((1, "sum"), (2, "mean")):
        stores, lookups, slot_of_index = make_batch(optimizer=optimizer, weighted=pooling == "sum", batch_size=6,
                                                    max_bag=8, feature_table_map=feature_table_map, device=device)
        bags = torch.repeat_interleave(torch.arange(lookups.offsets.numel() - 1, device=device),
                                       lookups.offsets.diff())
        features = bags // lookups.batch_size
        table_rows = torch.tensor(feature_table_map, device=device)[features] * 1000 + lookups.indices
        shared = [row for row in table_rows.unique() if features[table_rows == row].unique().numel() > 1]
        assert shared, "no row is looked up by two features"
        grad_output = torch.randn(lookups.batch_size, stores.total_dim, device=device)
        expected = stores.clone()
        reference_backward_update(grad_output, expected, lookups, slot_of_index, pooling, optimizer, STEP)
        backward_update(grad_output, stores, lookups, slot_of_index, pooling, optimizer, STEP,
                        config=BackwardConfig(rows=2, lanes=lanes, num_warps=4, chunk=4))
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


@pytest.mark.parametrize("feature_table_map", [None, (2, 0, 1, 2, 3, 0, 2)], ids=["a_feature_a_table", "shared"])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_reference_sgd_step_is_the_autograd_gradient(pooling, feature_table_map, device):
    """The reference itself, checked once: its SGD step is -lr times autograd's gradient of every row
    (with features sharing tables: the sum over the features naming a row)."""
    stores, lookups, slot_of_index = make_batch(dtype=torch.float64, weighted=True, device=device,
                                                feature_table_map=feature_table_map)
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
    stores, lookups, slot_of_index = segments_batch(lengths, 12, device, optimizer)
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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_two_identical_steps_are_bitwise_equal(dtype, device):
    """At a size where many programs run at once, forward and update are deterministic."""
    optimizer = RowwiseAdagrad(lr=0.01)
    stores, lookups = zipf_batch(1_000_000, 128, 16384, 32, device, dtype, optimizer)
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
    stores, lookups = zipf_batch(50_000, 128, 2048, 40, device, optimizer=optimizer)
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
