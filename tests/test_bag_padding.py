"""A batch laid out at more bags a feature than it has (kernels/grouping.py ``pad_bags``), so that batches
whose batch size changes every step share a few CUDA graphs of the forward (``padded_size(B)`` bags) and of
the backward (a power of two): the padding's bags are empty, so the forward's rows and the backward's update
are the unpadded ones bit for bit. Against a plain-torch layout of the bags; edge sizes: one bag a feature,
empty bags, shared tables, int32 offsets, the caller's ``bag_of_index``."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import ALL_OPTIMIZERS, STEP, assert_stores_equal, make_batch, poison_empty  # noqa: F401

from tiered_tbe.base.graphs import padded_size, to_device
from tiered_tbe.kernels.backward import backward_update
from tiered_tbe.kernels.forward import pooled_forward
from tiered_tbe.kernels.grouping import pad_bags, padded_batch_size
from tiered_tbe.kernels.linearize import linearize
from tiered_tbe.kernels.rows import Lookups


def _reference_layout(offsets: torch.Tensor, num_features: int, batch_size: int, padded: int):
    """Bag lengths ``[F, padded]`` (zeros past ``batch_size``) and the bag ``f * padded + b`` of every lookup."""
    lengths = torch.zeros(num_features, padded, dtype=torch.int64)
    lengths[:, :batch_size] = offsets.cpu().long().diff().view(num_features, batch_size)
    bags = torch.repeat_interleave(torch.arange(num_features * padded), lengths.view(-1))
    return lengths, bags


@pytest.mark.parametrize("batch_size, padded, feature_table_map, index_dtype", [
    (1, 2, None, torch.int64),
    (3, 4, None, torch.int64),
    (5, 8, (0, 1, 2, 1, 3), torch.int32),
    (9, 10, None, torch.int32),
    (6, 6, None, torch.int64),  # nothing to pad: the batch as it is
])
def test_pad_bags_matches_a_plain_layout(batch_size, padded, feature_table_map, index_dtype, device):
    stores, lookups, _ = make_batch(batch_size=batch_size, index_dtype=index_dtype, device=device,
                                    feature_table_map=feature_table_map)
    lookups = linearize(stores, lookups)
    result = pad_bags(lookups, stores.num_features, padded)
    num_features = stores.num_features
    assert result.batch_size == padded and result.offsets.numel() == num_features * padded + 1
    assert result.offsets.dtype == lookups.offsets.dtype
    lengths, bags = _reference_layout(lookups.offsets, num_features, batch_size, padded)
    assert result.offsets[0].item() == 0 and result.offsets[-1].item() == lookups.num_lookups
    assert torch.equal(result.offsets.cpu().long().diff(), lengths.view(-1))
    assert torch.equal(result.bag_of_index.cpu().long(), bags)
    assert result.bag_of_index.dtype == torch.int32
    # The linearize of the padded layout gives the same bags: a batch padded before or after it agrees.
    relinearized = linearize(stores, result._replace(global_rows=None, bag_of_index=None))
    assert torch.equal(relinearized.bag_of_index, result.bag_of_index)
    assert torch.equal(relinearized.global_rows, lookups.global_rows)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("batch_size, weighted, cached", [(9, True, True), (13, False, True), (17, True, False)])
def test_padded_forward_equals_unpadded_bitwise(batch_size, pooling, weighted, cached, device):
    assert padded_size(batch_size) > batch_size
    stores, lookups, slot_of_index = make_batch(batch_size=batch_size, weighted=weighted, device=device)
    slot_of_index = slot_of_index if cached else None
    plain = pooled_forward(stores, lookups, slot_of_index, pooling, pad=False)
    padded = pooled_forward(stores, lookups, slot_of_index, pooling, pad=True)
    assert padded.shape == plain.shape == (batch_size, stores.total_dim) and padded.is_contiguous()
    assert not padded._is_view()  # autograd takes in-place ops on the module's output (kernels/forward.leading_rows)
    assert padded.untyped_storage().nbytes() == padded_size(batch_size) * stores.total_dim * 4
    assert torch.equal(padded, plain)
    # Against fp64 plain torch: a padded bag's rows never land in the output.
    weights = lookups.per_sample_weights if weighted else torch.ones(lookups.num_lookups, device=device)
    expected = torch.zeros(batch_size, stores.total_dim, dtype=torch.float64, device=device)
    table_rows = [t.double() for t in stores.table_weights]
    if cached:
        cache = stores.cache_weights.double()
    for bag in range(stores.num_features * batch_size):
        feature, sample = divmod(bag, batch_size)
        table = stores.features[feature]
        dim = stores.dims[table]
        start, end = int(lookups.offsets[bag]), int(lookups.offsets[bag + 1])
        column = stores.output_offsets[feature]
        for position in range(start, end):
            slot = int(slot_of_index[position]) if cached else -1
            row = cache[slot, :dim] if slot >= 0 else table_rows[table][int(lookups.indices[position]), :dim]
            expected[sample, column:column + dim] += weights[position].double() * row
        if pooling == "mean" and end > start:
            expected[sample, column:column + dim] /= end - start
    torch.testing.assert_close(padded.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, pooling, batch_size, weighted, cached, given_bags", [
    ("rowwise_adagrad", "sum", 5, True, True, False),
    ("adam", "mean", 3, False, True, True),
    ("sgd", "mean", 7, True, False, True),
    ("adagrad", "sum", 1, False, True, False),
])
def test_padded_backward_equals_unpadded_bitwise(name, pooling, batch_size, weighted, cached, given_bags, device):
    """Bags padded to a power of two (and lookups to padded_size(N)), with the batch's bag_of_index given
    (the module's checked path and the prefetch) or linearized in the backward."""
    assert padded_batch_size(batch_size) > batch_size or batch_size == 1
    optimizer = ALL_OPTIMIZERS[name]
    stores, lookups, slot_of_index = make_batch(batch_size=batch_size, weighted=weighted, optimizer=optimizer,
                                                device=device, feature_table_map=(0, 1, 2, 3, 2))
    lookups = linearize(stores, lookups) if given_bags else lookups
    slot_of_index = slot_of_index if cached else None
    grad_output = torch.randn(batch_size, stores.total_dim, device=device)
    plain, padded = stores.clone(), stores.clone()
    backward_update(grad_output, plain, lookups, slot_of_index, pooling, optimizer, STEP, pad=False)
    backward_update(grad_output, padded, lookups, slot_of_index, pooling, optimizer, STEP, pad=True)
    assert_stores_equal(padded, plain)


def test_padded_batch_size_is_a_power_of_two():
    assert [padded_batch_size(n) for n in (0, 1, 2, 3, 5, 8, 9, 8192, 8193, 16384)] == \
        [1, 1, 2, 4, 8, 8, 16, 8192, 16384, 16384]


class _KeyRecorder:
    """Stands in for a ``StepGraphs``: records each call's key and its inputs' shapes (what a graph is keyed
    by), then runs the launches eagerly."""

    enabled = True

    def __init__(self):
        self.keys = []

    def run(self, key, inputs, enqueue, device, advance=None):
        self.keys.append((key, tuple(None if t is None else (tuple(t.shape), t.dtype) for t in inputs)))
        return enqueue(to_device(inputs, device))


def _batch_of(stores, batch_size: int, num_lookups: int, generator: torch.Generator, device):
    """A batch of exactly ``num_lookups`` lookups in ``batch_size`` bags a feature (random bag lengths)."""
    num_bags = stores.num_features * batch_size
    cuts = torch.sort(torch.randint(0, num_lookups + 1, (num_bags - 1,), generator=generator)).values
    offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([num_lookups])])
    table_of_index = torch.tensor(stores.features)[torch.repeat_interleave(torch.arange(num_bags),
                                                                           offsets.diff()) // batch_size]
    rows = torch.tensor([w.shape[0] for w in stores.table_weights])[table_of_index]
    indices = (torch.rand(num_lookups, generator=generator) * rows).long()
    return Lookups(indices.to(device), offsets.to(device), batch_size)


def test_batch_sizes_of_one_padded_size_share_a_graph_key(device):
    """Batch sizes 5-8 (the backward's power of two: 8) and 9-10 (the forward's padded_size: 10), lookup
    counts of one padded size: one key each for the forward and the backward, where unpadded batches
    of those sizes had one key each."""
    optimizer = ALL_OPTIMIZERS["rowwise_adagrad"]
    stores, _, _ = make_batch(optimizer=optimizer, device=device)
    generator = torch.Generator().manual_seed(5)
    padded_keys, plain_keys = _KeyRecorder(), _KeyRecorder()
    for batch_size, num_lookups in ((5, 61), (7, 58), (8, 64), (6, 57)):
        assert padded_size(num_lookups) == 64
        lookups = _batch_of(stores, batch_size, num_lookups, generator, device)
        grad_output = torch.randn(batch_size, stores.total_dim, device=device)
        for graphs, pad in ((padded_keys, True), (plain_keys, False)):
            backward_update(grad_output, stores, lookups, None, "sum", optimizer, STEP, graphs=graphs, pad=pad)
    assert len(set(padded_keys.keys)) == 1 and len(set(plain_keys.keys)) == 4
    forward_keys, plain_forward_keys = _KeyRecorder(), _KeyRecorder()
    for batch_size in (9, 10, 9):
        lookups = _batch_of(stores, batch_size, 6 * batch_size, generator, device)
        padded = pooled_forward(stores, lookups, None, "mean", graphs=forward_keys, pad=True)
        plain = pooled_forward(stores, lookups, None, "mean", graphs=plain_forward_keys, pad=False)
        assert torch.equal(padded, plain)
    assert len(set(forward_keys.keys)) == 1 and len(set(plain_forward_keys.keys)) == 2


def test_batches_are_padded_where_graphs_run_on_a_gpu_for_pooled_outputs(monkeypatch):
    from tiered_tbe.kernels.addressing import POOLING_MEAN, POOLING_NONE, POOLING_SUM
    from tiered_tbe.kernels.grouping import pads_batches

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    on, off = _KeyRecorder(), _KeyRecorder()
    off.enabled = False
    assert pads_batches(on, cuda, POOLING_SUM) and pads_batches(on, cuda, POOLING_MEAN)
    assert not pads_batches(on, cuda, POOLING_NONE)  # its output and gradient rows are its lookups'
    assert not pads_batches(on, cpu, POOLING_SUM) and not pads_batches(None, cuda, POOLING_SUM)
    assert not pads_batches(off, cuda, POOLING_SUM)
    monkeypatch.setenv("TIERED_TBE_PAD_BATCHES", "0")
    assert not pads_batches(on, cuda, POOLING_SUM)


def test_a_batch_the_size_of_the_one_before_it_is_not_padded(monkeypatch, device):
    """Where batches are padded (graphs on a GPU; forced here), the backward pads a batch only when its lookup
    count or batch size differs from the batch before it (the first batch is not padded): batches that keep
    one size replay their own size's graph without copying their arrays. The updates are the same either way
    (bit for bit, against stores never padded)."""
    from tiered_tbe.base.graphs import StepGraphs
    from tiered_tbe.kernels import backward as backward_module
    from tiered_tbe.kernels import grouping

    padded_sizes = []

    def recording_pad_batch(stores, lookups, *args):
        padded_sizes.append(lookups.num_lookups)
        return grouping.pad_batch(stores, lookups, *args)

    monkeypatch.setattr(backward_module, "pads_batches", lambda graphs, device, mode: True)
    monkeypatch.setattr(backward_module, "pad_batch", recording_pad_batch)
    optimizer = ALL_OPTIMIZERS["rowwise_adagrad"]
    stores, _, _ = make_batch(optimizer=optimizer, device=device)
    padded, plain = stores.clone(), stores.clone()
    graphs = StepGraphs(enabled=False)
    generator = torch.Generator().manual_seed(11)
    sizes = [(6, 61), (6, 61), (6, 61), (7, 61), (7, 58), (7, 58), (6, 61)]
    for batch_size, num_lookups in sizes:
        lookups = _batch_of(stores, batch_size, num_lookups, generator, device)
        grad_output = torch.randn(batch_size, stores.total_dim, device=device)
        backward_update(grad_output, padded, lookups, None, "sum", optimizer, STEP, graphs=graphs)
        backward_update(grad_output, plain, lookups, None, "sum", optimizer, STEP, pad=False)
    # Padded: each batch whose size changed (batch size 6 -> 7, lookups 61 -> 58, 7 -> 6); the first is not.
    assert padded_sizes == [61, 58, 61]
    assert_stores_equal(padded, plain)
    assert graphs.size_changed((61, 6)) is False and graphs.size_changed((62, 6)) is True  # (lookups, batch size)
