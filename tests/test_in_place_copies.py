"""A training forward copies the rows it reads in place, and its backward reads the copies instead of
the backing stores (kernels/in_place_copies.py, CacheConfig.in_place_copies).

An ``lfu-admit`` cache of 8 slots refuses most misses, so most rows are read in place. The copies'
values are the stores' by construction, so training is the same with and without them; what shows
that the backward reads them is a store poisoned between a forward and its backward: with the copies
the poison is overwritten by the update, without them it is updated. Both backends: the Triton
kernels (the interpreter, a few steps) and their plain-torch reference (which models the copies).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tiered_tbe import SGD, CacheConfig, Placement, RowwiseAdagrad, TableSpec
from tiered_tbe.batch import CopyRows
from tiered_tbe.kernels.in_place_copies import InPlaceCopies
from tiered_tbe.module import TieredEmbeddingBags

SPECS = [(60, 6, Placement.HOST_CACHED), (20, 3, Placement.MANAGED_CACHED), (9, 4, Placement.DEVICE)]
BATCH_SIZE = 3
POISON = 1.0e6


def make(backend, copies, device, optimizer=None, weights_dtype=torch.float32):
    tables = [TableSpec(n, d, name=f"t{i}", placement=p) for i, (n, d, p) in enumerate(SPECS)]
    config = CacheConfig(slots=8, associativity=4, policy="lfu-admit", in_place_copies=copies)
    return TieredEmbeddingBags(tables, optimizer=optimizer or SGD(lr=0.5), weights_dtype=weights_dtype,
                               cache=config, device=device, backend=backend, seed=3)


def make_batches(steps, device, seed=11):
    """TBE batches of random rows, bags of 0-4 lookups (some rows repeated within a batch)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        indices, lengths = [], []
        for num_rows, _, _ in SPECS:
            for _ in range(BATCH_SIZE):
                n = int(torch.randint(0, 5, (1,), generator=generator))
                indices.append(torch.randint(0, num_rows, (n,), generator=generator))
                lengths.append(n)
        out.append((torch.cat(indices).long().to(device), torch.tensor([0] + lengths).cumsum(0).to(device)))
    return out


def weights_of(module):
    module.flush()
    return [module.table(t).clone() for t in range(len(SPECS))]


def rows_read_in_place(module, indices, offsets):
    """Prefetch the batch; ``[(table, row, rank)]`` of its lookups read in place (no slot)."""
    module.prefetch(indices, offsets)
    batch = module._prefetched[-1][2]
    slots, ranks = batch.slot_of_index.tolist(), batch.in_place_rank.tolist()
    lengths = (offsets[1:] - offsets[:-1]).tolist()
    tables = [t for t in range(len(SPECS)) for _ in range(BATCH_SIZE)]
    table_of_lookup = [table for table, n in zip(tables, lengths) for _ in range(n)]
    return [(table, int(row), rank) for table, row, slot, rank in zip(table_of_lookup, indices.tolist(), slots, ranks)
            if slot < 0 and table < 2]


def train(module, batches, poison_from=None, poisoned_rows=None):
    """Serial training; from step ``poison_from`` on, every row a batch reads in place is poisoned in
    its store between the batch's forward and its backward (and added to ``poisoned_rows``)."""
    for step, (indices, offsets) in enumerate(batches):
        poisoned = []
        if poison_from is not None and step >= poison_from:
            poisoned = rows_read_in_place(module, indices, offsets)
            if poisoned_rows is not None:
                poisoned_rows.update((table, row) for table, row, _ in poisoned)
        out = module(indices, offsets)
        for table, row, _ in poisoned:
            module.storage.table_weights[table][row] = POISON
        (out * torch.linspace(-1, 1, out.shape[1], device=out.device)).sum().backward()
    return weights_of(module)


@pytest.mark.parametrize("backend, steps", [("triton", 4), ("torch", 12)])
def test_the_backward_reads_the_forwards_copies(backend, steps, device, one_simulated_thread):
    batches = make_batches(steps, device)
    # Last, a new row looked up 40 times in one bag: read in place, and updated by the backward's
    # kernel for rows of many lookups (kernels/hot_rows.py).
    indices, offsets = batches[-1]
    batches.append((torch.cat([torch.full((40,), 57, device=device), indices]),
                    torch.cat([offsets[:1], offsets[1:] + 40])))
    plain = train(make(backend, 64, device), batches)
    poisoned = set()
    poisoned_with_copies = train(make(backend, 64, device), batches, poison_from=1, poisoned_rows=poisoned)
    assert (0, 57) in poisoned
    poisoned_without = train(make(backend, 0, device), batches, poison_from=1)
    for want, got in zip(plain, poisoned_with_copies):
        assert torch.equal(want, got)
    assert any(not torch.equal(want, got) for want, got in zip(plain, poisoned_without)), \
        "no row was read in place: the test shows nothing"


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_the_forward_writes_a_copy_of_each_row_read_in_place_and_nothing_else(backend, device, one_simulated_thread):
    module = make(backend, 64, device, optimizer=RowwiseAdagrad(lr=0.1))
    batches = make_batches(3, device, seed=4)
    train(module, batches[:2])
    indices, offsets = batches[2]
    read_in_place = rows_read_in_place(module, indices, offsets)
    assert read_in_place, "no row was read in place"
    copies = module._copy_rows.rows
    copies.fill_(float("nan"))
    expected = {rank: module.storage.table_weights[table][row].clone() for table, row, rank in read_in_place}
    module(indices, offsets).sum().backward()
    for rank, row in expected.items():
        assert torch.equal(copies[rank, :row.numel()], row.to(copies.device))
    untouched = [r for r in range(copies.shape[0]) if r not in expected]
    assert torch.isnan(copies[untouched]).all()
    # An evaluation forward writes no copy (no backward will read it).
    copies.fill_(float("nan"))
    with torch.no_grad():
        module(*make_batches(1, device, seed=9)[0])
    assert torch.isnan(copies).all()


def test_two_forwards_before_their_backwards_read_the_stores(device, one_simulated_thread, monkeypatch):
    """forward(a), forward(b), then both backwards (one loss): b's update reaches rows a read in place
    before a's backward, so a's copies are stale there. The module reads the stores for a (and, the
    copies being b's, for whichever backward runs second), and trains as without copies; a module
    that read the copies anyway would not."""
    batches = make_batches(16, device, seed=7)

    def train_in_pairs(copies):
        module = make("torch", copies, device)
        for (ia, oa), (ib, ob) in zip(batches[::2], batches[1::2]):
            loss = module(ia, oa).sum() + 2 * module(ib, ob).square().sum()
            loss.backward()
        return weights_of(module)

    without = train_in_pairs(0)
    for want, got in zip(without, train_in_pairs(64)):
        assert torch.equal(want, got)
    # No guard: every backward reads the copies, whichever forward wrote them last.
    monkeypatch.setattr(CopyRows, "for_backward", lambda self, batch: InPlaceCopies(batch.in_place_rank, self.rows))
    assert any(not torch.equal(want, got) for want, got in zip(without, train_in_pairs(64))), \
        "the batches share no row read in place: the test shows nothing"


def test_a_batch_with_more_rows_read_in_place_than_copy_rows(device, one_simulated_thread):
    """Rows ranked past the copy rows keep no copy and are read from their stores: the same training."""
    batches = make_batches(10, device, seed=2)
    results = [train(make("torch", copies, device), batches) for copies in (0, 1, 64)]
    for other in results[1:]:
        for want, got in zip(results[0], other):
            assert torch.equal(want, got)


def test_in_place_copies_is_a_whole_number_and_counted_in_the_cache_memory(device):
    with pytest.raises(ValueError, match="in_place_copies must be a whole number >= 0"):
        CacheConfig(in_place_copies=-1)
    assert CacheConfig(slots=64).copy_rows(64) == 4  # a sixteenth of the slots
    assert CacheConfig(in_place_copies=0).copy_rows(64) == 0
    assert make("torch", 0, device)._copy_rows is None
    assert make("torch", 5, device)._copy_rows.rows.shape == (5, 6)  # rows of the widest cached dim


def forwards_keeping_copies(module, batches):
    """Train ``batches`` serially; per batch, whether its forward kept copies and whether its prefetch left
    rows of the cached tables in place."""
    kept = []
    plain_forward = module.backend.forward

    def spy(*args, copies=None, **kwargs):
        kept.append(copies is not None)
        return plain_forward(*args, copies=copies, **kwargs)

    module.backend = dataclasses.replace(module.backend, forward=spy)
    read = []
    for indices, offsets in batches:
        read.append(bool(rows_read_in_place(module, indices, offsets)))
        (module(indices, offsets) * 0.5).sum().backward()
    return kept, read


def test_a_forward_keeps_copies_only_while_prefetches_leave_rows_in_place(device, one_simulated_thread, monkeypatch):
    """Copies cost a forward registers even where every row has a slot, so a forward keeps them only
    while the cache's counters, read without a sync, say recent prefetches left rows in place: from the
    first batch that did, until ``QUIET_READINGS`` readings in a row found none (each switch is a graph of
    its own). On the CPU a reading lands at once, so each forward follows its own prefetch. Two quiet
    readings here: with room for every row, the first three forwards keep copies (the first has nothing
    to compare); behind an lfu-admit cache of 8 slots, every batch but one after two quiet ones."""
    monkeypatch.setattr(CopyRows, "QUIET_READINGS", 2)
    roomy = TieredEmbeddingBags([TableSpec(n, d, name=f"t{i}", placement=p) for i, (n, d, p) in enumerate(SPECS)],
                                optimizer=SGD(lr=0.5), device=device, backend="torch", seed=3,
                                cache=CacheConfig(slots=128, associativity=4, policy="lru", in_place_copies=16))
    kept, read = forwards_keeping_copies(roomy, make_batches(5, device))
    assert read == [False] * 5 and kept == [True, True, False, False, False], (kept, read)
    batches = make_batches(9, device)
    for step in (2, 3, 6):  # batches of the uncached table alone: nothing read in place
        indices, offsets = batches[step]
        cached = int(offsets[2 * BATCH_SIZE])  # the first two tables' lookups
        batches[step] = (indices[cached:], torch.cat([torch.zeros(2 * BATCH_SIZE, dtype=offsets.dtype,
                                                                  device=device), offsets[2 * BATCH_SIZE:] - cached]))
    kept, read = forwards_keeping_copies(make("torch", 64, device), batches)
    assert read == [True, True, False, False, True, True, False, True, True], (kept, read)
    assert kept == [True, True, True, False, True, True, True, True, True], (kept, read)


def test_counter_readings_hand_over_each_change_once_and_none_after_a_reset():
    """cache/counter_readings.py on the CPU, where a copy lands at once: the first reading and one after
    the counters fell (a reset) give no change; the others their counters' growth, in order, once."""
    from tiered_tbe.cache.batch_kernels import COUNTER_NAMES
    from tiered_tbe.cache.counter_readings import MISSES_NO_SLOT, CounterReadings

    class FakeCache:
        device = torch.device("cpu")
        value = 0

        def copy_counters(self, target):
            target.fill_(self.value)

    cache = FakeCache()
    readings = CounterReadings([cache], slots=2)
    changes = []
    for tag, value in enumerate([5, 7, 7, 3, 4]):
        cache.value = value
        assert readings.record(tag)
        changes += [(t, None if c is None else int(c[0, MISSES_NO_SLOT])) for t, c in readings.landed()]
    assert changes == [(0, None), (1, 2), (2, 0), (3, None), (4, 1)]
    assert list(readings.landed()) == []
    assert readings._copies.shape == (2, 1, len(COUNTER_NAMES))
