"""The backward's row updates launch once per column group of the tables (kernels/run_groups.py,
``RowStores.table_groups``): each group walks its own tables' runs with a column tile of its width.
The plan of where each table's runs lie equals a plain-torch one; the updates equal the float64
reference and one launch over every run (``TIERED_TBE_BACKWARD_ONE_LAUNCH=1``: bit for bit where an element's
update reads its own column only), for
groups whose tables are not adjacent, tables looked up by several features, tables without lookups
and rows looked up hundreds of times. Training through the module: tests/test_column_groups_training.py."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import (  # noqa: F401  (poison_empty: an autouse fixture)
    ALL_OPTIMIZERS,
    STEP,
    assert_stores_close,
    assert_stores_equal,
    make_batch,
    poison_empty,
)
from test_column_groups import MIXED_DIMS, MIXED_FEATURES, MIXED_ROWS

from tiered_tbe.kernels import backward as backward_module
from tiered_tbe.kernels.backward import backward_update, sort_lookups
from tiered_tbe.kernels.reference import reference_backward_update
from tiered_tbe.kernels.rows import Lookups
from tiered_tbe.kernels.run_groups import plan_run_groups

BENCH_DIMS = (8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def test_tables_are_grouped_by_column_class(device):
    """The benchmark's dims fall in six groups of adjacent tables; interleaved dims give groups of tables
    apart from one another, ascending within a group; one class of dims gives no groups."""
    stores = make_batch(dims=BENCH_DIMS, num_rows=(3,) * 12, device=device)[0]
    groups = stores.table_groups
    assert groups.block_ds == (8, 16, 32, 64, 128, 256) and groups.ends == (1, 2, 4, 6, 8, 12)
    assert groups.tables.tolist() == list(range(12))
    assert groups.row_starts.tolist() == [3 * t for t in range(13)]

    stores = make_batch(dims=MIXED_DIMS, num_rows=MIXED_ROWS, device=device)[0]
    groups = stores.table_groups
    tables = groups.tables.tolist()
    begin = 0
    for block_d, end in zip(groups.block_ds, groups.ends):
        members = tables[begin:end]
        assert members == sorted(members) and max(MIXED_DIMS[t] for t in members) <= block_d
        assert all(MIXED_DIMS[t] > block_d // 2 or block_d == 8 for t in members)
        begin = end
    assert sorted(tables) == list(range(len(MIXED_DIMS))) and list(groups.block_ds) == sorted(groups.block_ds)
    assert make_batch(dims=(5, 7, 8, 3), num_rows=(2, 2, 2, 2), device=device)[0].table_groups is None
    assert make_batch(dims=(128, 100, 65), num_rows=(2, 2, 2), device=device)[0].table_groups is None


@pytest.mark.parametrize("seed", range(3))
def test_plan_places_each_tables_runs(seed, device):
    """Grouped run v of the entry j holding it (runs_end[j-1] <= v < runs_end[j]) is run v + run_shift[j],
    and the runs of entry j are exactly the runs of its table (a plain-torch count of the sorted rows):
    tables looked up by several features, tables with no lookup at all, tables of one row."""
    torch.manual_seed(seed)
    stores, lookups, _ = make_batch(dims=MIXED_DIMS, num_rows=MIXED_ROWS, batch_size=2 + seed, max_bag=3,
                                    feature_table_map=MIXED_FEATURES[: 8 + 4 * seed], device=device)
    s = sort_lookups(stores, lookups)
    runs_end, run_shift = plan_run_groups(stores.table_groups, s.sorted_rows, s.run_count, s.num_runs)

    unique_rows = torch.unique_consecutive(s.sorted_rows.long())
    assert int(s.num_runs[0]) == unique_rows.numel()
    table_of_run = torch.bucketize(unique_rows, torch.tensor(stores.row_offsets, device=device), right=True) - 1
    counts = [int((table_of_run == t).sum()) for t in stores.table_groups.tables.tolist()]
    assert 0 in counts  # some tables have no lookup in this batch
    assert runs_end.tolist() == torch.tensor(counts).cumsum(0).tolist()
    grouped_start = 0
    for j, t in enumerate(stores.table_groups.tables.tolist()):
        runs_of_table = torch.nonzero(table_of_run == t).flatten().tolist()
        shifted = [v + int(run_shift[j]) for v in range(grouped_start, int(runs_end[j]))]
        assert shifted == runs_of_table, f"entry {j} (table {t})"
        grouped_start = int(runs_end[j])


def _update_both_ways(monkeypatch, stores, lookups, slot_of_index, pooling, optimizer, grad_output):
    """The stores after one backward per column group, and after one launch over every run."""
    grouped = stores.clone()
    backward_update(grad_output, grouped, lookups, slot_of_index, pooling, optimizer, STEP)
    with monkeypatch.context() as m:
        m.setenv("TIERED_TBE_BACKWARD_ONE_LAUNCH", "1")
        one_launch = stores.clone()
        backward_update(grad_output, one_launch, lookups, slot_of_index, pooling, optimizer, STEP)
    return grouped, one_launch


def _assert_same_update(grouped, one_launch, name):
    """Bit for bit where the optimizer's update of an element reads that element's column only; within
    rounding where it sums over the row's columns (row-wise state: a tile of the group's width sums in
    another order than one of the widest dim's on the GPU)."""
    if name in ("sgd", "adam"):
        assert_stores_equal(grouped, one_launch)
    else:
        assert_stores_close(grouped, one_launch, torch.float32)


@pytest.mark.parametrize("name, pooling", [("sgd", "sum"), ("rowwise_adagrad", "sum"), ("rowwise_adagrad", "mean"),
                                           ("adam", "none"), ("partial_rowwise_adam", "mean")])
def test_grouped_updates_equal_reference_and_one_launch(name, pooling, monkeypatch, device):
    """Mixed dims 1 to 300 (column tiles 8 to 512), tables shared by features, cached and uncached rows,
    per-sample weights: the reference's update, and the one launch's (_assert_same_update)."""
    optimizer = ALL_OPTIMIZERS[name]
    stores, lookups, slot_of_index = make_batch(dims=MIXED_DIMS, num_rows=MIXED_ROWS, batch_size=3, max_bag=4,
                                                optimizer=optimizer, weighted=pooling != "mean",
                                                feature_table_map=MIXED_FEATURES, device=device)
    rows = lookups.batch_size if pooling != "none" else lookups.num_lookups
    grad_output = torch.randn(rows, stores.total_dim if pooling != "none" else stores.max_dim, device=device)
    expected = stores.clone()
    reference_backward_update(grad_output, expected, lookups, slot_of_index, pooling, optimizer, STEP)
    grouped, one_launch = _update_both_ways(monkeypatch, stores, lookups, slot_of_index, pooling, optimizer,
                                            grad_output)
    assert_stores_close(grouped, expected, torch.float32)
    _assert_same_update(grouped, one_launch, name)


def test_hot_rows_of_narrow_tables(monkeypatch, device):
    """A dim-8 table's one row looked up 240 times beside rows of a dim-200 table (hot runs stay the hot
    kernels', at the widest tile; the rest go per group): the reference, and the one launch's."""
    optimizer = ALL_OPTIMIZERS["rowwise_adagrad"]
    stores, _, _ = make_batch(dims=(8, 200, 8), num_rows=(1, 50, 9), optimizer=optimizer, device=device)
    batch_size = 6
    lengths = torch.tensor([40] * batch_size + [3] * batch_size + [2] * batch_size, device=device)
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    generator = torch.Generator(device=device).manual_seed(1)
    indices = torch.cat([torch.zeros(240, dtype=torch.int64, device=device),
                         torch.randint(0, 50, (18,), generator=generator, device=device),
                         torch.randint(0, 9, (12,), generator=generator, device=device)])
    lookups = Lookups(indices, offsets, batch_size, torch.rand(indices.numel(), device=device) + 0.5)
    grad_output = torch.randn(batch_size, stores.total_dim, device=device)
    expected = stores.clone()
    reference_backward_update(grad_output, expected, lookups, None, "sum", optimizer, STEP)
    grouped, one_launch = _update_both_ways(monkeypatch, stores, lookups, None, "sum", optimizer, grad_output)
    assert_stores_close(grouped, expected, torch.float32)
    _assert_same_update(grouped, one_launch, "rowwise_adagrad")


class _RowUpdateRecorder:
    """Stands in for the row-update kernel: records each launch's column tile, runs a tile and grouping."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((kwargs["BLOCK_D"], kwargs["ROWS"], kwargs["GROUPED"]))
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.parametrize("dims, expected", [
    (BENCH_DIMS, None),  # filled below: a launch per group
    ((128, 100, 65), [(128, 2, False)]),  # one class: one launch over every run
])
def test_a_launch_per_group(dims, expected, monkeypatch, device):
    """One row-update launch per column group, each tile as many runs as fit the widest tile's columns
    (at most 16); with one class of dims, one launch; TIERED_TBE_BACKWARD_ONE_LAUNCH=1: one launch."""
    optimizer = ALL_OPTIMIZERS["sgd"]
    stores, lookups, slot_of_index = make_batch(dims=dims, num_rows=(4,) * len(dims), optimizer=optimizer,
                                                device=device)
    grad_output = torch.randn(lookups.batch_size, stores.total_dim, device=device)
    recorder = _RowUpdateRecorder(backward_module._row_update_kernel)
    monkeypatch.setattr(backward_module, "_row_update_kernel", recorder)
    config = backward_module.BackwardConfig(rows=1 if stores.block_d == 256 else 2, lanes=1, num_warps=2, chunk=4)
    backward_update(grad_output, stores, lookups, slot_of_index, "sum", optimizer, STEP, config=config)
    if expected is None:
        expected = [(8, 16, True), (16, 16, True), (32, 8, True), (64, 4, True), (128, 2, True), (256, 1, True)]
    assert recorder.launches == expected
    recorder.launches.clear()
    monkeypatch.setenv("TIERED_TBE_BACKWARD_ONE_LAUNCH", "1")
    backward_update(grad_output, stores, lookups, slot_of_index, "sum", optimizer, STEP, config=config)
    assert recorder.launches == [(stores.block_d, config.rows, False)]
