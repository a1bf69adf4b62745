"""The forward-type kernels launch once per column group (kernels/rows.py ``ColumnGroup``): features whose
dims round up to one power of two share a launch with that column tile, so a narrow table's rows are not
tiled with the widest table's columns. A model whose features all round alike keeps its one launch. The
results equal the plain-torch reference and, bit for bit, the one launch over every feature
(``TIERED_TBE_FORWARD_ONE_LAUNCH=1``); pooling none pads its output to a few sizes (``padded_size``) so that
batches whose lookup count changes every step share its graphs, and the padding changes no value.
Training through the module: tests/test_column_groups_training.py."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import make_batch, poison_empty  # noqa: F401  (poison_empty: an autouse fixture)

from tiered_tbe.base import descriptors
from tiered_tbe.base.graphs import padded_size
from tiered_tbe.kernels import forward as forward_module
from tiered_tbe.kernels.forward import pooled_forward
from tiered_tbe.kernels.per_sample_weights import per_sample_weights_grad
from tiered_tbe.kernels.reference import reference_forward, reference_per_sample_weights_grad
from tiered_tbe.kernels.rows import MIN_GROUP_COLUMNS

# Dims from 1 to 300: odd ones, powers of two and their neighbours (column tiles of 8 to 512).
MIXED_DIMS = (1, 2, 3, 5, 8, 9, 16, 17, 31, 33, 64, 65, 127, 128, 129, 255, 256, 257, 300)
MIXED_ROWS = tuple(1 + (7 * t) % 6 for t in range(len(MIXED_DIMS)))  # 1 to 6 rows: tables of one row among them
# Features looking up the tables, some tables twice, out of order (FBGEMM's feature_table_map).
MIXED_FEATURES = (18, 0, 3, 3, 7, 12, 11, 1, 2, 4, 5, 6, 8, 9, 10, 13, 14, 15, 16, 17, 12, 0)


def mixed_batch(device, weighted=True, dtype=torch.float32, batch_size=3):
    return make_batch(dims=MIXED_DIMS, num_rows=MIXED_ROWS, batch_size=batch_size, max_bag=4, dtype=dtype,
                      weighted=weighted, feature_table_map=MIXED_FEATURES, device=device)


class LaunchRecorder:
    """Stands in for a Triton kernel: records each launch (its grid's features, descriptor and
    constexprs), then runs it."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            features = (grid({"BLOCK_B": 1, "GROUPS": 1}) if callable(grid) else grid)[1]
            descriptor = next(a for a in args if isinstance(a, torch.Tensor) and a.dim() == 2
                              and a.dtype == torch.int64)
            self.launches.append(dict(features=features, descriptor=descriptor, BLOCK_D=kwargs["BLOCK_D"],
                                      GROUPED=kwargs["GROUPED"]))
            return self.kernel[grid](*args, **kwargs)
        return launch


def record_forward_launches(monkeypatch) -> LaunchRecorder:
    recorder = LaunchRecorder(forward_module._pooled_forward_kernel)
    monkeypatch.setattr(forward_module, "_pooled_forward_kernel", recorder)
    return recorder


def test_features_are_grouped_by_the_power_of_two_of_their_dim(device):
    """The benchmark's dims 8..256 fall in six groups, narrowest first; each group's descriptor is the
    stores' rows of its features, whose FEATURE column names them; dims up to MIN_GROUP_COLUMNS share one."""
    dims = (8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
    stores = make_batch(dims=dims, num_rows=(2,) * len(dims), device=device)[0]
    groups = stores.column_groups
    assert [(g.block_d, g.features) for g in groups] == [
        (8, (0,)), (16, (1,)), (32, (2, 3)), (64, (4, 5)), (128, (6, 7)), (256, (8, 9, 10, 11))]
    for group in groups:
        assert torch.equal(group.descriptor, stores.descriptor[list(group.features)])
        assert group.descriptor[:, descriptors.FEATURE].tolist() == list(group.features)

    stores = mixed_batch(device)[0]
    features_of = {g.block_d: g.features for g in stores.column_groups}
    assert sorted(f for g in stores.column_groups for f in g.features) == list(range(len(MIXED_FEATURES)))
    assert MIN_GROUP_COLUMNS == 8 and features_of[8] == tuple(  # dims 1, 2, 3, 5, 8 together
        f for f, t in enumerate(MIXED_FEATURES) if MIXED_DIMS[t] <= 8)
    assert features_of[512] == tuple(f for f, t in enumerate(MIXED_FEATURES) if MIXED_DIMS[t] > 256)
    assert list(features_of) == sorted(features_of)


@pytest.mark.parametrize("dims", [(128,) * 5, (100, 128, 65), (3, 8, 1, 5)], ids=["criteo", "one-class", "narrow"])
def test_one_dim_class_keeps_one_launch_over_every_feature(dims, monkeypatch, device):
    """Every feature in one class (Criteo's 26 tables of 128): one launch over every feature, with the
    stores' descriptor and column tile, the feature read as the program's row (GROUPED off): the
    kernel compiled as before the groups (tools/compile_kernels.py compiles both)."""
    stores, lookups, slots = make_batch(dims=dims, num_rows=(4,) * len(dims), weighted=True, device=device)
    recorder = record_forward_launches(monkeypatch)
    output = pooled_forward(stores, lookups, slots, "sum")
    assert len(stores.column_groups) == 1 and len(recorder.launches) == 1
    launch = recorder.launches[0]
    assert launch["descriptor"] is stores.descriptor and launch["BLOCK_D"] == stores.block_d
    assert launch["features"] == len(dims) and launch["GROUPED"] is False
    torch.testing.assert_close(output.double(), reference_forward(stores, lookups, slots, "sum"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_mixed_dims_launch_per_group_and_equal_one_launch_bitwise(pooling, weighted, dtype, monkeypatch, device):
    """Dims 1..300, features sharing tables, empty bags, tables of one row, slots beside backing rows:
    a launch per group, each at its column tile, equal to the reference and, bit for bit, to one launch."""
    stores, lookups, slots = mixed_batch(device, weighted, dtype)
    assert (lookups.offsets.diff() == 0).any() and (slots >= 0).any() and (slots < 0).any()
    recorder = record_forward_launches(monkeypatch)
    grouped = pooled_forward(stores, lookups, slots, pooling)
    assert [(launch["BLOCK_D"], launch["features"], launch["GROUPED"]) for launch in recorder.launches] == [
        (group.block_d, len(group.features), True) for group in stores.column_groups]
    assert [launch["BLOCK_D"] for launch in recorder.launches] == [8, 16, 32, 64, 128, 256, 512]
    torch.testing.assert_close(grouped.double(), reference_forward(stores, lookups, slots, pooling),
                               rtol=1e-5, atol=1e-5)

    monkeypatch.setenv("TIERED_TBE_FORWARD_ONE_LAUNCH", "1")
    one_launch = pooled_forward(stores, lookups, slots, pooling)
    assert recorder.launches[-1]["BLOCK_D"] == 512 and recorder.launches[-1]["GROUPED"] is False
    assert torch.equal(grouped, one_launch)


def test_pooling_none_on_mixed_dims_is_one_launch_with_zeros_past_each_dim(monkeypatch, device):
    """Pooling none writes each lookup's row whole, zeros past its table's dim up to the widest: one launch."""
    stores, lookups, slots = mixed_batch(device)
    recorder = record_forward_launches(monkeypatch)
    output = pooled_forward(stores, lookups, slots, "none")
    assert [(launch["BLOCK_D"], launch["GROUPED"]) for launch in recorder.launches] == [(512, False)]
    assert output.shape == (lookups.num_lookups, 300)
    torch.testing.assert_close(output.double(), reference_forward(stores, lookups, slots, "none"), rtol=1e-6, atol=0)


@pytest.mark.parametrize("pooling", ["sum", "mean", "none"])
def test_per_sample_weight_gradients_on_mixed_dims(pooling, monkeypatch, device):
    """The per-sample-weight gradient launches per column group too (pooled), equal to the reference
    and to one launch."""
    if pooling == "none":
        stores, lookups, slots = make_batch(dims=(5, 5, 5), num_rows=(3, 1, 6), weighted=True, device=device)
    else:
        stores, lookups, slots = mixed_batch(device)
    width = stores.max_dim if pooling == "none" else stores.total_dim
    grad_output = torch.randn(lookups.num_lookups if pooling == "none" else lookups.batch_size, width, device=device)
    grouped = per_sample_weights_grad(grad_output, stores, lookups, slots, pooling)
    torch.testing.assert_close(grouped.double(), reference_per_sample_weights_grad(grad_output, stores, lookups, slots,
                                                                                   pooling), rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("TIERED_TBE_FORWARD_ONE_LAUNCH", "1")
    torch.testing.assert_close(per_sample_weights_grad(grad_output, stores, lookups, slots, pooling), grouped,
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_pooling_none_output_is_padded_and_exact(weighted, device):
    """Pooling none returns N rows of an output of padded_size(N) rows (the graph's key holds the padded
    size, so batches of changing N share a few graphs); each row is the lookup's row (times its weight),
    exactly: one fp32 product an element, as the reference rounds it."""
    stores, lookups, slots = make_batch(dims=(6, 6, 6, 6), num_rows=(7, 1, 40, 5), batch_size=9, max_bag=6,
                                        weighted=weighted, device=device)
    n = lookups.num_lookups - 1 + lookups.num_lookups % 2  # odd, past 32: not a padded size
    lookups = lookups._replace(indices=lookups.indices[:n], offsets=lookups.offsets.clamp(max=n),
                               per_sample_weights=None if not weighted else lookups.per_sample_weights[:n])
    slots = slots[:n]
    assert n > 32 and padded_size(n) > n
    output = pooled_forward(stores, lookups, slots, "none")
    assert output.shape == (lookups.num_lookups, 6) and output.is_contiguous()
    assert output.untyped_storage().nbytes() == padded_size(lookups.num_lookups) * 6 * 4
    assert torch.equal(output, reference_forward(stores, lookups, slots, "none").float())
