"""Rows moving between slots and backing stores: dirty victims written back (clean ones not), a row
read in place after its eviction, flush, write_back, invalidate, bytes counted per table, half
precision bit-exact, and the staged mover under random timing and when its threads fail."""

import time

import numpy as np
import pytest
import torch
from cache_helpers import (
    DEVICE,
    ROW_BYTES,
    TrainingCheck,
    initial_rows,
    make_tables,
    make_trace,
    prefetch,
    rows_tensor,
    slow_write_backs,
)

from tiered_tbe.cache import CachedTable, SlotCache
from tiered_tbe.cache.mover import MOVERS
from tiered_tbe.cache.policy import EMPTY


def test_dirty_victims_written_back_clean_ones_not(mover):
    table = CachedTable(0, 64, 3, initial_rows(0, 64, 3).to(DEVICE), None)
    cache = SlotCache([table], num_slots=2, associativity=2, mover=mover)  # one set: every row conflicts
    first = prefetch(cache, rows_tensor([5, 9]))
    slots = first.slot_of_index
    # Row 5 is updated and marked dirty; row 9 is scribbled on but not marked (a clean slot is
    # a copy of its backing row, so the cache may drop it without writing).
    cache.weights[slots[0]] += 100
    cache.weights[slots[1]] += 100
    cache.mark_dirty(slots[:1])
    cache.unlock(first)
    second = prefetch(cache, rows_tensor([20, 30]))
    assert second.slot_of_index.tolist() == slots.tolist()  # both evicted
    cache.drain()  # the staged mover writes back behind the prefetch
    torch.testing.assert_close(table.weights[5].cpu(), initial_rows(5, 1, 3)[0] + 100)
    torch.testing.assert_close(table.weights[9].cpu(), initial_rows(9, 1, 3)[0])
    stats = cache.stats()
    assert (stats.evictions, stats.write_backs, stats.bytes_out, stats.bytes_in) == (2, 1, 12, 4 * 12)
    cache.unlock(second)
    # Re-fetched, the written-back row carries its update.
    again = prefetch(cache, rows_tensor([5]))
    torch.testing.assert_close(cache.weights[again.slot_of_index[0]].cpu(), initial_rows(5, 1, 3)[0] + 100)


def test_a_row_evicted_dirty_and_missed_again_next_batch_carries_its_update(mover):
    """The write-back of an evicted row and its fill one prefetch later: the fill reads the
    backing store after the write-back reached it (one set, so every batch evicts the last)."""
    table = CachedTable(0, 64, 3, initial_rows(0, 64, 3).to(DEVICE), initial_rows(0, 64, 1).to(DEVICE))
    cache = SlotCache([table], num_slots=2, associativity=2, mover=mover, staging_rows=1)
    slow_write_backs(cache)
    expected = initial_rows(0, 64, 3).clone()
    for step, rows in enumerate([[1, 2], [3, 4], [1, 2], [3, 4], [1, 5], [2, 3]]):
        batch = cache.prefetch(rows_tensor(rows))
        cache.wait_filled(batch)
        slots = batch.slot_of_index.long()
        torch.testing.assert_close(cache.weights[slots].cpu(), expected[rows], rtol=0, atol=0, msg=f"step {step}")
        cache.weights[slots] += 1.0
        cache.state[slots] += 1.0
        expected[rows] += 1.0
        cache.mark_dirty(batch)
        cache.unlock(batch)
    cache.flush()
    torch.testing.assert_close(table.weights.cpu(), expected, rtol=0, atol=0)
    torch.testing.assert_close(table.state.cpu(), initial_rows(0, 64, 1) + (expected - initial_rows(0, 64, 3))[:, :1])


def test_a_row_read_in_place_sees_the_write_back_of_its_eviction(mover):
    """Row 1 is evicted dirty by B, then C misses it while B's locked rows fill its set: C reads
    row 1 in the backing store (slot -1), which must hold the update by then."""
    table = CachedTable(0, 64, 3, initial_rows(0, 64, 3).to(DEVICE), None)
    cache = SlotCache([table], num_slots=2, associativity=2, mover=mover)
    slow_write_backs(cache)
    a = prefetch(cache, rows_tensor([1, 2]))
    cache.weights[a.slot_of_index.long()] += 10.0
    cache.mark_dirty(a)
    cache.unlock(a)
    b = cache.prefetch(rows_tensor([3, 4]))  # evicts rows 1 and 2, dirty; B stays in flight
    c = prefetch(cache, rows_tensor([1]))
    assert c.slot_of_index.tolist() == [-1]
    torch.testing.assert_close(table.weights[1].cpu(), initial_rows(1, 1, 3)[0] + 10.0, rtol=0, atol=0)
    cache.unlock(b)
    cache.unlock(c)


def test_flush_writes_dirty_rows_and_state_once(mover):
    tables = make_tables()
    cache = SlotCache(tables, num_slots=8, associativity=4, mover=mover)
    batch = prefetch(cache, rows_tensor([1, 2, 260, 205]))
    slots = batch.slot_of_index
    assert slots[3] == -1
    cache.weights[slots[:3].long()] = 7.0
    cache.state[slots[:3].long()] = 3.0
    cache.mark_dirty(slots[:2])  # rows 1 and 2 (table A, with state); row 260 stays clean
    cache.flush()
    assert (tables[0].weights[1:3] == 7).all() and (tables[0].state[1:3] == 3).all()
    torch.testing.assert_close(tables[1].weights[10].cpu(), initial_rows(260, 1, 6)[0])  # clean: untouched
    assert int(cache.dirty.sum()) == 0 and cache.num_locked() == 3  # flush keeps rows and locks
    stats = cache.stats()
    assert (stats.write_backs, stats.bytes_out) == (2, 2 * ROW_BYTES)
    cache.flush()
    assert cache.stats().write_backs == 2  # nothing dirty: nothing written


def test_bytes_count_each_tables_row_size(mover):
    wide = CachedTable(0, 50, 4, initial_rows(0, 50, 4).to(DEVICE), initial_rows(0, 50, 2).to(DEVICE))  # 24 B
    narrow = CachedTable(50, 50, 2, initial_rows(50, 50, 2).to(DEVICE), None)  # 8 B
    cache = SlotCache([wide, narrow], num_slots=64, associativity=64, mover=mover)  # one set: nothing evicted
    batch = prefetch(cache, rows_tensor([1, 2, 3, 60, 61, 2]))
    assert cache.stats().bytes_in == 3 * 24 + 2 * 8
    # Rows of both tables (two host segments of different widths) are in their slots.
    slots = batch.slot_of_index.long()
    torch.testing.assert_close(cache.weights[slots[:3], :4].cpu(), initial_rows(0, 50, 4)[[1, 2, 3]])
    torch.testing.assert_close(cache.state[slots[:3], :2].cpu(), initial_rows(0, 50, 2)[[1, 2, 3]])
    torch.testing.assert_close(cache.weights[slots[3:5], :2].cpu(), initial_rows(50, 50, 2)[[10, 11]])
    cache.mark_dirty(batch.slot_of_index[[0, 3]])
    cache.flush()
    assert cache.stats().bytes_out == 24 + 8


def test_write_back_copies_now_and_keeps_dirty_bits(mover):
    tables = make_tables()
    cache = SlotCache(tables, num_slots=8, associativity=4, mover=mover)
    slots = prefetch(cache, rows_tensor([1, 260])).slot_of_index
    cache.weights[slots.long()] = 5.0
    cache.mark_dirty(slots)
    cache.write_back(rows_tensor([-1, int(slots[0]), int(slots[0])], dtype=torch.int32))
    assert (tables[0].weights[1] == 5).all()
    torch.testing.assert_close(tables[1].weights[10].cpu(), initial_rows(260, 1, 6)[0])
    assert int(cache.dirty.sum()) == 2
    assert (cache.stats().write_backs, cache.stats().bytes_out) == (1, ROW_BYTES)


def test_invalidate_drops_rows_unwritten_and_refuses_while_locked(mover):
    tables = make_tables()
    cache = SlotCache(tables, num_slots=8, associativity=4, mover=mover)
    batch = prefetch(cache, rows_tensor([1, 2]))
    cache.weights[batch.slot_of_index.long()] = 9.0
    cache.mark_dirty(batch)
    with pytest.raises(RuntimeError, match="locked"):
        cache.invalidate()
    cache.unlock(batch)
    cache.invalidate()
    assert (cache.tags == EMPTY).all() and int(cache.dirty.sum()) == 0
    torch.testing.assert_close(tables[0].weights[1:3].cpu(), initial_rows(1, 2, 4))  # not written back
    again = prefetch(cache, rows_tensor([1]))
    torch.testing.assert_close(cache.weights[again.slot_of_index[0], :4].cpu(), initial_rows(1, 1, 4)[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_rows_copy_bit_exact(dtype, mover):
    table = CachedTable(0, 32, 5, (torch.randn(32, 5) * 1000).to(DEVICE, dtype), None)
    cache = SlotCache([table], num_slots=2, associativity=2, mover=mover)
    slots = prefetch(cache, rows_tensor([3, 30])).slot_of_index
    assert cache.weights.dtype == dtype
    assert torch.equal(cache.weights[slots.long()].view(torch.int16), table.weights[[3, 30]].view(torch.int16))
    cache.weights[slots.long()] = 1.5
    cache.mark_dirty(slots)
    cache.flush()
    assert (table.weights[[3, 30]] == 1.5).all()


@pytest.mark.parametrize("seed", [9, 10])
def test_movers_under_random_timing_equal_serial_training(seed):
    """Every mover of the registry, the staged mover's threads slowed at random (sleeps before host
    copies, one intra-op thread, one-row staging buffers so every batch is many chunks), batches
    kept in flight two deep: every row each batch reads is its newest value, as in serial
    training, and the decisions are the same whichever mover carries the rows."""
    rng = np.random.default_rng(seed)
    checks = {}
    for mover in MOVERS:
        cache = SlotCache(make_tables(), num_slots=16, associativity=4, mover=mover, staging_rows=1, mover_threads=1)
        if hasattr(cache.mover, "delay"):  # the staged mover's hook before each host copy
            # Write-backs slower than fills, to give a missing wait its chance to show.
            cache.mover.delay = lambda where: time.sleep(float(rng.choice([0, 0, 0.0005, 0.002])) *
                                                         (4 if where == "write_back" else 1))
        check = checks[mover] = TrainingCheck(cache)
        in_flight = []
        for batch in make_trace(num_batches=24, seed=seed):
            in_flight.append((check.prefetch(batch), batch))
            if len(in_flight) > 2:
                check.train(*in_flight.pop(0))
        for prefetched, batch in in_flight:
            check.train(prefetched, batch)
        check.check_backing_after_flush()
    stats = checks["staged"].cache.stats()
    assert all(check.cache.stats() == stats for check in checks.values())
    assert stats.write_backs > 10 and stats.misses_no_slot > 3
    assert checks["staged"].cache.mover.stats["rows_written"] >= stats.write_backs


def test_staged_mover_threads_stop_with_their_cache_and_errors_reach_the_caller():
    import gc
    import threading

    def mover_threads():
        return [t for t in threading.enumerate() if t.name.startswith("tiered_tbe")]

    before = set(mover_threads())  # (other tests' caches may not have been collected yet)
    cache = SlotCache(make_tables(), num_slots=8, associativity=4, mover="staged")
    cache.unlock(prefetch(cache, rows_tensor([1, 2])))
    started = set(mover_threads()) - before
    assert len(started) == 2
    del cache
    gc.collect()
    for thread in started:
        thread.join(timeout=10)
    assert not any(thread.is_alive() for thread in started), "a dropped cache's mover threads must exit"

    cache = SlotCache(make_tables(), num_slots=8, associativity=4, mover="staged")

    def broken(where):
        raise OSError("disk gone")

    cache.mover.delay = broken
    batch = cache.prefetch(rows_tensor([1, 2]))
    with pytest.raises(RuntimeError, match="staged row mover failed") as failure:
        cache.wait_filled(batch)
    assert isinstance(failure.value.__cause__, OSError)
    with pytest.raises(RuntimeError, match="staged row mover failed"):
        cache.prefetch(rows_tensor([3]))
