"""Padded graph inputs (base/padded_inputs.py): a replay lays a batch out at its padded size in the copy that
moves it into the graph's static tensor, with the values padding it first would give."""

import pytest
import torch

from tiered_tbe.base import graphs, padded_inputs
from tiered_tbe.base.graphs import StepGraphs, to_device
from tiered_tbe.base.padded_inputs import POSITIONS, LaidOutInput, PaddedInput, padded_input
from tiered_tbe.kernels.grouping import PaddedBags

DEVICE = torch.device("cuda") if torch.cuda.is_available() and not graphs.SIMULATION else torch.device("cpu")


def reference_padding(tensor: torch.Tensor, size: int, fill) -> torch.Tensor:
    """Plain torch: ``tensor`` then ``size - N`` entries of ``fill`` (or their own positions)."""
    tail = [float(i) if tensor.dtype.is_floating_point else i for i in range(tensor.numel(), size)]
    values = tensor.tolist() + (tail if fill == POSITIONS else [fill] * (size - tensor.numel()))
    return torch.tensor(values, dtype=tensor.dtype)


@pytest.mark.parametrize("dtype,fill", [(torch.int64, 7), (torch.int32, -1), (torch.float32, 0.0),
                                        (torch.int32, POSITIONS), (torch.int64, POSITIONS)])
def test_materialize_and_replay_copies_give_the_padded_tensor(dtype, fill):
    generator = torch.Generator().manual_seed(3)
    # Sizes whose padding grows (the kept buffer is replaced), shrinks and vanishes, in one order.
    for count, size in [(5, 8), (1, 64), (0, 3), (40, 41), (100, 300), (17, 20)]:
        tensor = torch.randint(-50, 50, (count,), generator=generator).to(dtype).to(DEVICE)
        padded = padded_input(tensor, size, fill)
        assert isinstance(padded, PaddedInput) and padded.numel() == size and padded.dtype == dtype
        expected = reference_padding(tensor.cpu(), size, fill)
        assert torch.equal(padded.materialize().cpu(), expected)
        static = torch.full((size,), 99, dtype=dtype, device=DEVICE)  # poisoned
        targets, sources = padded.copy_pairs(static)
        for target, source in zip(targets, sources):
            target.copy_(source)
        assert torch.equal(static.cpu(), expected), (count, size)


def test_padded_input_is_the_tensor_itself_when_nothing_pads_it():
    tensor = torch.arange(6, device=DEVICE)
    assert padded_input(tensor, 6, 0) is tensor
    assert padded_input(tensor, 4, 0) is tensor
    assert padded_input(None, 10, 0) is None


def test_a_grown_padding_buffer_is_kept_for_copies_still_queued():
    padded_inputs._TAILS.clear()
    retired = len(padded_inputs._RETIRED)
    small = padded_input(torch.zeros(2, dtype=torch.int64, device=DEVICE), 4, 12345)
    first = small.copy_pairs(torch.empty(4, dtype=torch.int64, device=DEVICE))[1][1]
    large = padded_input(torch.zeros(2, dtype=torch.int64, device=DEVICE), 40, 12345)
    large.copy_pairs(torch.empty(40, dtype=torch.int64, device=DEVICE))
    assert len(padded_inputs._RETIRED) == retired + 1
    assert padded_inputs._RETIRED[-1].data_ptr() == first.data_ptr()  # still referenced, never reallocated


def test_eager_runs_see_padded_tensors_and_keys_match_the_padded_shape():
    tensor = torch.arange(5, dtype=torch.int32, device=DEVICE)
    padded = padded_input(tensor, 8, -1)
    (moved,) = to_device([padded], DEVICE)
    assert torch.equal(moved.cpu(), torch.tensor([0, 1, 2, 3, 4, -1, -1, -1], dtype=torch.int32))
    assert graphs._signature(padded) == graphs._signature(moved)
    seen = []
    StepGraphs(enabled=False).run("key", [padded, None], lambda tensors: seen.append(tensors), DEVICE)
    assert torch.equal(seen[0][0].cpu(), moved.cpu()) and seen[0][1] is None


class _RecordingGraph:
    """Stands in for a captured CUDA graph: a replay reads its static inputs."""

    def __init__(self, statics):
        self.statics = statics
        self.read = []

    def replay(self):
        self.read.append([None if static is None else static.clone() for static in self.statics])


def test_a_replay_copies_padded_and_plain_inputs_into_their_statics():
    plain = torch.arange(3, 6, dtype=torch.int64, device=DEVICE)
    statics = [torch.full((8,), 99, dtype=torch.int64, device=DEVICE), torch.full((3,), 99, device=DEVICE,
                                                                                   dtype=torch.int64),
               torch.full((8,), 99, dtype=torch.int32, device=DEVICE), None,
               torch.full((9,), 99, dtype=torch.int64, device=DEVICE)]
    graph = _RecordingGraph(statics)
    captured = graphs._Captured(graph, statics, [None] * 5, None)
    step_graphs = StepGraphs(enabled=False)
    for count in (5, 8, 0, 7):  # batches of every size up to the padded one
        batch = torch.arange(10, 10 + count, dtype=torch.int64, device=DEVICE)
        order = torch.arange(count, dtype=torch.int32, device=DEVICE).flip(0)
        offsets = torch.tensor([0, 1, count], dtype=torch.int64, device=DEVICE)  # 2 features of one bag
        step_graphs._replay(captured, [padded_input(batch, 8, -3), plain, padded_input(order, 8, POSITIONS), None,
                                       PaddedBags(offsets, 2, 1, 4)])
        read = graph.read[-1]
        assert read[4].tolist() == [0, 1, 1, 1, 1, count, count, count, count]
        assert read[0].tolist() == list(range(10, 10 + count)) + [-3] * (8 - count)
        assert read[1].tolist() == [3, 4, 5]
        assert read[2].tolist() == list(range(count))[::-1] + list(range(count, 8))



def reference_bags(offsets: list[int], num_features: int, batch_size: int, padded_batch_size: int) -> list[int]:
    """Plain Python: each feature's offsets, then where its last bag ends for each bag added, then the end."""
    laid_out = []
    for feature in range(num_features):
        laid_out += offsets[feature * batch_size:(feature + 1) * batch_size]
        laid_out += [offsets[(feature + 1) * batch_size]] * (padded_batch_size - batch_size)
    return laid_out + offsets[-1:]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_features,batch_size,padded_batch_size", [(1, 1, 2), (3, 5, 8), (8, 7, 64), (2, 1, 16)])
def test_padded_bags_lay_offsets_out_at_more_bags_a_feature(dtype, num_features, batch_size, padded_batch_size):
    generator = torch.Generator().manual_seed(num_features * 100 + batch_size)
    lengths = torch.randint(0, 4, (num_features * batch_size,), generator=generator)
    lengths[::3] = 0  # empty bags
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(dtype).to(DEVICE)
    bags = PaddedBags(offsets, num_features, batch_size, padded_batch_size)
    expected = torch.tensor(reference_bags(offsets.tolist(), num_features, batch_size, padded_batch_size),
                            dtype=dtype)
    assert bags.numel() == expected.numel() and bags.dtype == dtype and graphs._signature(bags)[0] == (bags.size,)
    assert torch.equal(bags.materialize().cpu(), expected)
    static = torch.full((bags.size,), -99, dtype=dtype, device=DEVICE)  # poisoned
    targets, sources = bags.copy_pairs(static)
    torch._foreach_copy_(targets, sources)  # as a replay copies them, strided and expanded parts included
    assert torch.equal(static.cpu(), expected)


@pytest.mark.gpu
def test_a_captured_graph_replays_batches_of_every_size_as_their_padded_tensors():
    """The real thing: one key captured once, then replayed for batches of 1-8 entries padded to 8; the
    outputs equal the enqueue run on the padded tensors, and the tails stay right as sizes change."""
    device = torch.device("cuda")
    step_graphs = StepGraphs()

    def enqueue(tensors):
        batch, order = tensors
        return (batch * 3 + order.to(batch.dtype),)

    generator = torch.Generator().manual_seed(0)
    for count in [5, 6, 8, 1, 7, 7, 3, 8, 2]:
        batch = torch.randint(-9, 9, (count,), generator=generator).to(device)
        order = torch.randperm(count, generator=generator).to(torch.int32).to(device)
        inputs = [padded_input(batch, 8, -5), padded_input(order, 8, POSITIONS)]
        (output,) = step_graphs.run("padded", inputs, enqueue, device)
        (expected,) = enqueue([padded.materialize() if isinstance(padded, LaidOutInput) else padded
                               for padded in inputs])
        assert torch.equal(output, expected), count
    assert step_graphs.captures == 1 and step_graphs.replays == 8
