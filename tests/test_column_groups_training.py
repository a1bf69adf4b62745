"""Training through the module on batches whose lookup count changes every step: a forward launched per
column group (kernels/rows.py ``ColumnGroup``) trains bit for bit as one launch over every feature, pooling
none's padded outputs as outputs of exactly N rows, and on the GPU a few forward graphs serve every batch
(the lookup count is not in a pooled forward's graph key; pooling none's is its padded size), and the backward,
its batch padded (kernels/grouping.py pad_batch), replays a graph per padded size. Batches whose batch size
changes every step too: padded bags (pad_bags) train bit for bit as unpadded ones, and on the GPU replay a
few graphs."""

from __future__ import annotations

import pytest
import torch

from tiered_tbe import CacheConfig, Placement, TableSpec, TieredEmbeddingBags
from tiered_tbe.base.graphs import padded_size
from tiered_tbe.kernels import backward as backward_module
from tiered_tbe.kernels import forward as forward_module
from tiered_tbe.kernels import grouping
from tiered_tbe.kernels.addressing import POOLING_NONE
from tiered_tbe.kernels.grouping import padded_batch_size
from tiered_tbe.optimizers import SGD, RowwiseAdagrad


def _ragged_batches(table_rows, num_features, steps, batch_size, device, weighted=True, seed=0, batch_sizes=None):
    """Batches whose lookup count changes every step (no count twice): bags of 0..5 lookups, ``batch_size``
    samples, or the sizes of ``batch_sizes`` in turn."""
    generator = torch.Generator(device=device).manual_seed(seed)
    batches, counts = [], set()
    for step in range(steps):
        batch_size = batch_size if batch_sizes is None else batch_sizes[step % len(batch_sizes)]
        lengths = torch.randint(0, 6, (num_features * batch_size,), generator=generator, device=device)
        while int(lengths.sum()) in counts:  # one more lookup in the first bag that can take one
            lengths[int(torch.nonzero(lengths < 5)[0])] += 1
        counts.add(int(lengths.sum()))
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        feature_of = torch.arange(num_features, device=device).repeat_interleave(batch_size).repeat_interleave(lengths)
        rows = torch.tensor(table_rows, device=device)[feature_of]
        indices = (torch.rand(int(offsets[-1]), generator=generator, device=device) ** 2 * rows).long()
        weights = torch.rand(indices.numel(), generator=generator, device=device) if weighted else None
        batches.append((indices, offsets, weights))
    assert len({int(b[1][-1]) for b in batches}) == steps
    return batches


def _train(module, batches):
    """Train ``module`` on ``batches``; the outputs and the state after."""
    outputs = []
    for indices, offsets, weights in batches:
        output = module(indices, offsets, per_sample_weights=weights)
        outputs.append(output.detach().clone())
        grad = torch.linspace(-1, 1, output.numel(), device=output.device).view(output.shape)
        output.backward(grad)
    return outputs, {k: v.clone() for k, v in module.state_dict().items()}


def _module(dims, device, pooling="sum", **kwargs):
    tables = [TableSpec(rows, dim, name=f"t{t}", placement=Placement.MANAGED_CACHED)
              for t, (rows, dim) in enumerate(zip((40, 3, 25, 60), dims))]
    return TieredEmbeddingBags(tables, pooling=pooling, optimizer=RowwiseAdagrad(lr=0.1), device=device, seed=3,
                               cache=CacheConfig(slots=16, associativity=4), bounds_check="off", **kwargs)


def test_module_training_on_mixed_dims_equals_one_launch_bitwise(monkeypatch, device):
    """A cached module of mixed dims trained on batches whose lookup count changes every step: its
    outputs and its tables equal, bit for bit, those of the same training with one launch a forward."""
    # One forward tile for every launch: on the GPU the autotuner picks a tile per group, and a tile of
    # other lanes sums a bag's lookups in another order (bits, not values, differ).
    monkeypatch.setenv("TIERED_TBE_FORWARD_TILE", "16,1,4")
    dims = (3, 16, 33, 120)
    batches = _ragged_batches((40, 3, 25, 60), 4, steps=4, batch_size=3, device=device)
    grouped = _train(_module(dims, device), batches)
    monkeypatch.setenv("TIERED_TBE_FORWARD_ONE_LAUNCH", "1")
    one_launch = _train(_module(dims, device), batches)
    for a, b in zip(grouped[0], one_launch[0]):
        assert torch.equal(a, b)
    for key, value in grouped[1].items():
        assert torch.equal(value, one_launch[1][key]), key


def test_padded_pooling_none_trains_as_unpadded_bitwise(monkeypatch, device):
    """Pooling none through the module over batches of changing N (each padded to its size's bucket):
    outputs and tables bit for bit those of outputs of exactly N rows."""
    batches = _ragged_batches((40, 3, 25, 60), 4, steps=4, batch_size=3, device=device)
    assert any(padded_size(int(offsets[-1])) != int(offsets[-1]) for _, offsets, _ in batches)
    padded = _train(_module((8,) * 4, device, pooling="none"), batches)
    monkeypatch.setattr(forward_module, "padded_size", lambda n: n)
    unpadded = _train(_module((8,) * 4, device, pooling="none"), batches)
    for a, b in zip(padded[0], unpadded[0]):
        assert torch.equal(a, b)
    for key, value in padded[1].items():
        assert torch.equal(value, unpadded[1][key]), key


def test_module_training_on_changing_batch_sizes_padded_equals_unpadded_bitwise(monkeypatch, device):
    """A cached module trained on batches whose batch size and lookup count change every step, its forward's
    and backward's batches padded (bags and lookups: kernels/grouping.py pad_bags, pad_batch) as where they run
    as CUDA graphs, trains bit for bit as one that pads nothing: outputs (the batch's rows only) and tables."""
    dims = (3, 16, 33, 120)
    batches = _ragged_batches((40, 3, 25, 60), 4, steps=5, batch_size=None, device=device,
                              batch_sizes=(3, 5, 9, 6, 11))
    plain = _train(_module(dims, device), batches)
    padded_to = []

    def recording_pad_bags(lookups, num_features, batch_size, **layout):
        padded_to.append((lookups.batch_size, batch_size))
        return grouping.pad_bags(lookups, num_features, batch_size, **layout)

    def pads(graphs, device, mode):
        return mode != POOLING_NONE

    for module in (forward_module, backward_module):
        monkeypatch.setattr(module, "pads_batches", pads)
        monkeypatch.setattr(module, "pad_bags", recording_pad_bags)
    padded = _train(_module(dims, device), batches)
    # The forward pads to padded_size(B) (3, 5 and 6 are such sizes), the backward to a power of two, but not
    # the first batch (StepGraphs.size_changed: only a batch whose size changed is padded).
    assert padded_to == [(5, 8), (9, 10), (9, 16), (6, 8), (11, 12), (11, 16)]
    for a, b in zip(padded[0], plain[0]):
        assert a.shape == b.shape and torch.equal(a, b)
    for key, value in padded[1].items():
        assert torch.equal(value, plain[1][key]), key


@pytest.mark.parametrize("pooling", ["sum", "none"])
def test_the_output_of_a_padded_batch_takes_in_place_ops(monkeypatch, pooling, device):
    """The module's output over a padded buffer (a pooled batch's bags padded as where graphs run, pooling
    none's lookups always) is no view: a model that scales it in place trains as one that scales a copy."""
    monkeypatch.setattr(forward_module, "pads_batches", lambda graphs, device, mode: mode != POOLING_NONE)
    dims = (8,) * 4 if pooling == "none" else (3, 16, 33, 120)
    batches = _ragged_batches((40, 3, 25, 60), 4, steps=3, batch_size=None, device=device, batch_sizes=(5, 9, 11))
    tables = []
    for in_place in (True, False):
        module = _module(dims, device, pooling=pooling)
        for indices, offsets, weights in batches:
            output = module(indices, offsets, per_sample_weights=weights)
            assert not output._is_view()
            output = output.mul_(3) if in_place else output * 3
            output.backward(torch.linspace(-1, 1, output.numel(), device=device).view(output.shape))
        tables.append(module.state_dict())
    for key, value in tables[0].items():
        assert torch.equal(value, tables[1][key]), key


# ---------------------------------------------------------------------------------------------- GPU

def _graphed_equals_eager(dims, pooling, optimizer, batch_sizes=None):
    """On the GPU: 24 batches of 512 samples (or of ``batch_sizes`` in turn), each of its own lookup count,
    trained by a module with CUDA graphs and one without; every output and the tables after are equal bit for
    bit. Returns the graphed module and the batches."""
    device = torch.device("cuda")
    table_rows = (40_000, 3, 25_000, 60_000)
    batches = _ragged_batches(table_rows, 4, steps=24, batch_size=512, device=device, batch_sizes=batch_sizes)
    kwargs = dict(pooling=pooling, optimizer=optimizer, device=device, seed=3, bounds_check="off",
                  cache=CacheConfig(slots=4096, associativity=32))
    tables = [TableSpec(rows, dim, name=f"t{t}", placement=Placement.MANAGED_CACHED)
              for t, (rows, dim) in enumerate(zip(table_rows, dims))]
    graphed = TieredEmbeddingBags(tables, **kwargs)
    eager = TieredEmbeddingBags(tables, cuda_graphs=False, **kwargs)
    graphed_outputs, graphed_state = _train(graphed, batches)
    eager_outputs, eager_state = _train(eager, batches)
    torch.cuda.synchronize()
    for a, b in zip(graphed_outputs, eager_outputs):
        assert torch.equal(a, b)
    for key, value in graphed_state.items():
        assert torch.equal(value, eager_state[key]), key
    return graphed, batches


@pytest.mark.gpu
@pytest.mark.parametrize("pooling", ["sum", "none"])
def test_batches_of_changing_lookup_counts_replay_a_few_forward_graphs(pooling):
    """The forward captures at most one graph per bag-length class (pooled: the count is not in its key) or
    per padded size (none), and trains as the eager module does (_graphed_equals_eager)."""
    dims = (8,) * 4 if pooling == "none" else (8, 24, 64, 256)
    graphed, batches = _graphed_equals_eager(dims, pooling, SGD(lr=0.1))
    if pooling == "none":
        keys = len({padded_size(int(offsets[-1])) for _, offsets, _ in batches})
    else:
        keys = len({forward_module.bag_length_class(int(offsets[-1]), offsets.numel() - 1)
                    for _, offsets, _ in batches})
    assert keys <= 4 and 1 <= graphed._forward_graphs.captures <= keys
    assert graphed._forward_graphs.replays >= len(batches) - 2 * keys


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(8, 24, 64, 256), (64, 64, 64, 64)])
def test_batches_of_changing_lookup_counts_replay_a_few_backward_graphs(dims):
    """The backward, its batch padded to padded_size(N), captures at most one graph per padded size and
    replays the rest, and trains as the eager module does (_graphed_equals_eager)."""
    graphed, batches = _graphed_equals_eager(dims, "sum", RowwiseAdagrad(lr=0.1))
    keys = len({padded_size(int(offsets[-1])) for _, offsets, _ in batches})
    assert keys <= 4 and 1 <= graphed._backward_graphs.captures <= keys
    assert graphed._backward_graphs.replays >= len(batches) - 2 * keys


@pytest.mark.gpu
def test_batches_of_changing_batch_sizes_replay_a_few_graphs():
    """Batch sizes from 300 to 507, a new one every step: the forward, its bags padded to padded_size(B),
    captures at most one graph per padded size and bag-length class; the backward, its bags padded to a
    power of two and its lookups to padded_size(N), at most one per padded lookup count; both replay the
    rest and train as the eager module does (_graphed_equals_eager)."""
    graphed, batches = _graphed_equals_eager((8, 24, 64, 256), "sum", RowwiseAdagrad(lr=0.1),
                                             batch_sizes=tuple(range(300, 508, 9)))
    sizes = [(offsets.numel() - 1) // 4 for _, offsets, _ in batches]
    assert len(set(sizes)) == len(batches)
    forward_keys = len({(padded_size(size), forward_module.bag_length_class(int(offsets[-1]), offsets.numel() - 1))
                        for size, (_, offsets, _) in zip(sizes, batches)})
    backward_keys = len({(padded_batch_size(size), padded_size(int(offsets[-1])))
                         for size, (_, offsets, _) in zip(sizes, batches)})
    assert forward_keys <= 8 and backward_keys <= 6
    assert 1 <= graphed._forward_graphs.captures <= forward_keys
    assert graphed._forward_graphs.replays >= len(batches) - 2 * forward_keys
    assert 1 <= graphed._backward_graphs.captures <= backward_keys
    assert graphed._backward_graphs.replays >= len(batches) - 2 * backward_keys
