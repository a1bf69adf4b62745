"""A prefetch's graph lends its outputs to the batch until the batch's unlock (base/graphs.py ``OutputLoan``,
``StepGraphs(replicas=)``), instead of copying them each replay: a replica of the key's graph per batch in
flight, none overwritten while lent."""

from __future__ import annotations

import pytest
import torch
from cache_helpers import make_tables, prefetch, rows_tensor

from tiered_tbe.base import graphs
from tiered_tbe.base.graphs import OutputLoan, StepGraphs
from tiered_tbe.cache import SlotCache
from tiered_tbe.cache.mover import MOVERS
from tiered_tbe.cache.slot_cache import LENT_REPLICAS


class _ReplayingGraph:
    """Stands in for a captured CUDA graph: a replay runs the launches on the static inputs and writes their
    results into the outputs the capture returned (a graph writes its outputs where it captured them)."""

    def __init__(self, enqueue, statics):
        self.enqueue, self.statics = enqueue, statics
        self.outputs = None

    def replay(self):
        for output, result in zip(self.outputs, self.enqueue(self.statics)):
            output.copy_(result)


@pytest.fixture
def replaying_graphs(monkeypatch):
    """StepGraphs whose captures are _ReplayingGraphs, on a device named cuda (what run asks of it), on the
    CPU: the keys, the replicas and the loans run as on a GPU."""

    def capture(self, key, inputs, enqueue, device):
        statics = [None if tensor is None else torch.zeros(tensor.shape, dtype=tensor.dtype) for tensor in inputs]
        graph = _ReplayingGraph(enqueue, statics)
        graph.outputs = tuple(torch.full_like(result, -7) for result in enqueue(statics))
        self.captures += 1
        return graphs._Captured(graph, statics, [None] * len(inputs), graph.outputs)

    monkeypatch.setattr(StepGraphs, "_capture", capture)
    monkeypatch.setattr(graphs, "current_stream_handle", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(graphs, "to_device", lambda inputs, device: list(inputs))  # eager runs stay on the CPU


def _doubled(tensors):
    (batch,) = tensors
    return (batch * 2,)


def test_lent_outputs_stay_as_replayed_until_given_back(replaying_graphs):
    cuda = torch.device("cuda")
    step_graphs = StepGraphs(capacity=4, capture_after=0, enabled=True, replicas=3)
    loans, outputs = [], []
    for value in range(1, 4):  # three batches of one shape in flight: a replica each
        loans.append(OutputLoan())
        (output,) = step_graphs.run("k", [torch.full((5,), value)], _doubled, cuda, loan=loans[-1])
        outputs.append(output)
    assert step_graphs.captures == 3 and step_graphs.replays == 3 and step_graphs.eager == 0
    assert [output.tolist() for output in outputs] == [[2] * 5, [4] * 5, [6] * 5]  # none overwritten
    assert len({output.data_ptr() for output in outputs}) == 3  # the graphs' own outputs, not copies
    # A fourth batch while all three are lent: eager, into tensors of its own; the lent ones untouched.
    (eager,) = step_graphs.run("k", [torch.full((5,), 4)], _doubled, cuda, loan=OutputLoan())
    assert eager.tolist() == [8] * 5 and step_graphs.eager == 1
    assert [output.tolist() for output in outputs] == [[2] * 5, [4] * 5, [6] * 5]
    # The second batch's loan given back: the next batch replays its replica (no capture), the others stay.
    loans[1].give_back()
    (fifth,) = step_graphs.run("k", [torch.full((5,), 5)], _doubled, cuda, loan=OutputLoan())
    assert fifth.data_ptr() == outputs[1].data_ptr() and fifth.tolist() == [10] * 5
    assert step_graphs.captures == 3 and outputs[0].tolist() == [2] * 5 and outputs[2].tolist() == [6] * 5


def test_unlent_replays_return_copies_and_leave_the_replica_free(replaying_graphs):
    cuda = torch.device("cuda")
    step_graphs = StepGraphs(capacity=4, capture_after=0, enabled=True, replicas=2)
    (first,) = step_graphs.run("k", [torch.full((3,), 1)], _doubled, cuda)
    (second,) = step_graphs.run("k", [torch.full((3,), 2)], _doubled, cuda)
    assert first.tolist() == [2] * 3 and second.tolist() == [4] * 3  # copies: the replay did not change first
    assert step_graphs.captures == 1  # one replica served both


def test_one_replica_lent_makes_a_key_of_one_replica_run_eagerly(replaying_graphs):
    """replicas=1 (every StepGraphs but the prefetch's): a lent replica is never replayed over."""
    cuda = torch.device("cuda")
    step_graphs = StepGraphs(capacity=4, capture_after=0, enabled=True)
    loan = OutputLoan()
    (lent,) = step_graphs.run("k", [torch.full((2,), 1)], _doubled, cuda, loan=loan)
    (other,) = step_graphs.run("k", [torch.full((2,), 3)], _doubled, cuda)
    assert lent.tolist() == [2, 2] and other.tolist() == [6, 6] and step_graphs.eager == 1


@pytest.mark.parametrize("mover", list(MOVERS))
def test_a_batch_holds_its_loan_until_its_unlock(mover):
    """Each prefetch's tensors are lent to its batch, given back by its unlock (also a pipeline's, joined
    to a later prefetch), where the mover reads no list after the prefetch; the staged mover's are copies."""
    cache = SlotCache(make_tables(), num_slots=8, associativity=4, mover=mover)
    lends = not cache.mover.hands_off_device_lists
    first = prefetch(cache, rows_tensor([1, 2, 3]))
    second = prefetch(cache, rows_tensor([4, 5]))
    loans = dict(cache._loans)
    assert sorted(loans) == ([first.step, second.step] if lends else [])
    cache.unlock(first)
    assert cache._loans.keys() == ({second.step} if lends else set())
    assert all(loan.returned == (step == first.step) for step, loan in loans.items())
    third = cache.prefetch(rows_tensor([6, 7]), unlock_first=[second])  # a pipeline's deferred unlock
    assert cache._loans.keys() == ({third.step} if lends else set())
    assert all(loan.returned for step, loan in loans.items())
    cache.unlock(third)
    assert not cache._loans


@pytest.mark.gpu
def test_batches_in_flight_keep_their_prefetch_tensors_without_copies():
    """On the GPU: batches of one size prefetched ahead (more than the replicas), each batch's tensors as
    its prefetch made them until its unlock, equal to those of a cache that copies them, and captures only
    as batches pile up."""
    generator = torch.Generator().manual_seed(4)
    lending = SlotCache(make_tables(), num_slots=64, associativity=4)
    copying = SlotCache(make_tables(), num_slots=64, associativity=4)
    copying._lends_outputs = False
    copying._prefetch_graphs.replicas = 1
    in_flight = []
    for step in range(40):
        rows = rows_tensor(torch.randint(0, 200, (64,), generator=generator).tolist())
        batches = [cache.prefetch(rows) for cache in (lending, copying)]
        in_flight.append(batches)
        depth = 3 if step < 20 else 10  # a pipeline of depth 2, then more batches than replicas
        while len(in_flight) > depth:
            old_lent, old_copied = in_flight.pop(0)
            for name in ("slot_of_index", "locked_slots", "bypassed_rows", "sorted_rows", "order", "in_place_rank"):
                assert torch.equal(getattr(old_lent, name), getattr(old_copied, name)), (step, name)
            lending.unlock(old_lent)
            copying.unlock(old_copied)
    # One batch size, one key: a replica per batch in flight up to LENT_REPLICAS, eager runs beyond them.
    assert lending._prefetch_graphs.captures == LENT_REPLICAS and copying._prefetch_graphs.captures == 1
    assert lending._prefetch_graphs.eager > copying._prefetch_graphs.eager
    assert lending.num_locked() == copying.num_locked()
