"""What a prefetch decides and holds: locked slots are never evicted, hits lock before misses choose,
lookups change nothing, rows outside the cached tables are left alone, LFU ages its counts,
lookahead evicts the row needed latest, and unlocks release exactly what their prefetch took."""

import copy

import pytest
import torch
from cache_helpers import (
    DEVICE,
    TABLE_A,
    TABLE_B,
    initial_rows,
    make_tables,
    prefetch,
    rows_of_set,
    rows_tensor,
)

from tiered_tbe.base.graphs import padded_size
from tiered_tbe.cache import CachedTable, CacheStats, SlotCache
from tiered_tbe.cache.policy import EMPTY, NEXT_USE_UNKNOWN


def test_locked_slots_are_never_evicted(mover):
    num_sets = 2
    table = CachedTable(0, 200, 2, initial_rows(0, 200, 2).to(DEVICE), None)
    cache = SlotCache([table], num_slots=8, associativity=4, mover=mover)
    first, second = rows_of_set(0, num_sets, 4), rows_of_set(0, num_sets, 7)[4:]
    batch_first = prefetch(cache, rows_tensor(first))
    assert sorted(batch_first.slot_of_index.tolist()) == [0, 1, 2, 3]
    # Batch 1 still in flight (no unlock): batch 2's rows of the same set find no way.
    batch_second = prefetch(cache, rows_tensor(second + second))
    assert batch_second.slot_of_index.tolist() == [-1] * 6
    assert sorted(cache.tags[:4].tolist()) == sorted(first)
    stats = cache.stats()
    assert (stats.unique_misses, stats.misses_no_slot, stats.evictions, stats.lookups) == (7, 3, 0, 10)
    assert cache.num_locked() == 4
    cache.unlock(batch_second)  # no slot to release: every slot was -1
    assert cache.num_locked() == 4
    cache.unlock(batch_first)
    assert cache.num_locked() == 0
    # Unlocked, the same batch evicts: all four rows were last used at step 1, so ties go to the
    # lowest ways, taken by the missed rows in ascending order.
    assert prefetch(cache, rows_tensor(second)).slot_of_index.tolist() == [0, 1, 2]
    assert cache.stats().evictions == 3


def test_hits_lock_before_misses_choose_and_misses_go_in_row_order(mover):
    num_sets = 2
    table = CachedTable(0, 400, 2, initial_rows(0, 400, 2).to(DEVICE), None)
    cache = SlotCache([table], num_slots=8, associativity=4, mover=mover)
    old = rows_of_set(0, num_sets, 4, high=400)
    cache.unlock(prefetch(cache, rows_tensor(old)))
    new = rows_of_set(0, num_sets, 8, high=400)[4:]
    # The batch uses old[3] (in way 3) and four new rows. old[3] is a hit, locked before any
    # victim is chosen; the misses go in ascending row order, each to the lowest of the tied
    # unlocked ways (all last used at step 1), and the largest finds none.
    batch = rows_tensor([new[3], old[3], new[1], new[0], new[2]])
    assert prefetch(cache, batch).slot_of_index.tolist() == [-1, 3, 1, 0, 2]
    assert cache.tags.tolist()[:4] == [new[0], new[1], new[2], old[3]]
    torch.testing.assert_close(cache.weights[:4].cpu(), initial_rows(0, 400, 2)[cache.tags[:4].cpu()])


def test_lookup_changes_nothing_and_takes_no_lock(mover):
    cache = SlotCache(make_tables(), num_slots=8, associativity=4, mover=mover)
    cache.unlock(prefetch(cache, rows_tensor([4, 5, 260])))
    before = {name: getattr(cache, name).clone() for name in ("tags", "last_use", "use_count", "locks")}
    slots = cache.lookup(rows_tensor([5, 6, 260, 210, 5, -3]))
    assert slots.dtype == torch.int32
    tags = cache.tags
    assert tags[slots[0]] == 5 and tags[slots[2]] == 260 and slots[0] == slots[4]
    assert slots[[1, 3, 5]].tolist() == [-1, -1, -1]  # not cached; uncached table; not a row
    for name, value in before.items():
        assert torch.equal(getattr(cache, name), value), name
    assert cache.step == 1 and cache.stats().lookups == 3


def test_rows_outside_cached_tables_are_left_alone(mover):
    cache = SlotCache(make_tables(), num_slots=8, associativity=4, mover=mover)
    assert prefetch(cache, rows_tensor([200, 249, 350, 10**12, -1, 200])).slot_of_index.tolist() == [-1] * 6
    assert (cache.tags == EMPTY).all()
    assert cache.stats() == CacheStats(batches=1)
    assert prefetch(cache, rows_tensor([])).slot_of_index.shape == (0,)
    assert cache.step == 2


def test_lfu_aging_halves_counts_and_lets_a_once_hot_row_go(mover):
    def run(decay_interval):
        table = CachedTable(0, 16, 1, initial_rows(0, 16, 1).to(DEVICE), None)
        cache = SlotCache([table], num_slots=2, associativity=2, policy="lfu", lfu_decay_interval=decay_interval,
                          mover=mover)
        counts = []
        for row in (7, 7, 7, 7, 3, 5):  # row 7 hot early, then rows 3 and 5
            cache.unlock(prefetch(cache, rows_tensor([row, row])))  # two lookups, one use
            counts.append(sorted(zip(cache.tags.tolist(), cache.use_count.tolist())))
        return counts

    aged = run(decay_interval=2)
    assert aged[:4] == [[(-1, 0), (7, 1)], [(-1, 0), (7, 1)], [(-1, 0), (7, 2)], [(-1, 0), (7, 1)]]
    # Step 5: row 3 fills the empty way. Step 6: counts tied at 1, row 7 least recent: evicted.
    assert aged[4] == [(3, 1), (7, 1)]
    assert aged[5] == [(3, 0), (5, 0)]
    # Without aging row 7 keeps 4 uses and stays; row 3 (1 use) goes instead.
    assert run(decay_interval=1000)[5] == [(5, 1), (7, 4)]


def test_lookahead_evicts_the_row_needed_latest(mover):
    table = CachedTable(0, 64, 1, initial_rows(0, 64, 1).to(DEVICE), None)
    cache = SlotCache([table], num_slots=3, associativity=3, policy="lookahead", mover=mover)
    cache.unlock(prefetch(cache, rows_tensor([10, 11, 12])))
    ways = {row: way for way, row in enumerate(cache.tags.tolist())}
    # The pipeline's hint: row 10 next needed at step 5, row 12 at step 3, row 11 at none.
    cache.next_use[ways[10]], cache.next_use[ways[12]] = 5, 3
    cache.unlock(prefetch(cache, rows_tensor([20])))
    assert 11 not in cache.tags.tolist()
    cache.next_use[cache.tags == 20] = 4
    cache.unlock(prefetch(cache, rows_tensor([21])))
    assert sorted(cache.tags.tolist()) == [12, 20, 21]  # row 10 (step 5) was needed latest
    cache.next_use.fill_(NEXT_USE_UNKNOWN)  # no hint: least recently used goes
    cache.unlock(prefetch(cache, rows_tensor([22])))
    assert sorted(cache.tags.tolist()) == [20, 21, 22]


def test_unlock_with_mark_dirty_dirties_exactly_the_batchs_slots_and_releases_its_bypassed_rows():
    conflicting = rows_of_set(0, 2, 3)  # 3 rows of one set of 2 ways
    cache = SlotCache(make_tables(), num_slots=4, associativity=2)
    first = prefetch(cache, rows_tensor(conflicting + conflicting[:1]))  # 2 slots locked, 1 row bypassed
    assert sorted(first.slot_of_index.tolist()).count(-1) == 1 and int(cache.bypass_count.sum()) == 1
    other = prefetch(cache, rows_tensor(rows_of_set(1, 2, 1)))
    cache.unlock(first, mark_dirty=True)
    assert set(cache.dirty.nonzero().flatten().tolist()) == {s for s in first.slot_of_index.tolist() if s >= 0}
    assert int(cache.bypass_count.sum()) == 0 and int(cache.locks.sum()) == 1  # other's lock stays
    cache.unlock(other)  # no mark_dirty: its slot stays clean
    assert int(cache.dirty.sum()) == 2 and cache.num_locked() == 0


def test_unlock_launches_enqueued_by_the_caller_release_as_unlock_does():
    """The backward enqueues a batch's unlock in its own graph (unlock_launches), then drops the
    batch's record (launched=True): the same locks, dirty bits and bypassed rows as unlock(mark_dirty);
    the launches alone change nothing, and a batch unlocked already has none."""
    conflicting = rows_of_set(0, 2, 3)
    cache = SlotCache(make_tables(), num_slots=4, associativity=2)
    batch = prefetch(cache, rows_tensor(conflicting + conflicting[:1]))  # 2 slots locked, 1 row bypassed
    launches = cache.unlock_launches(batch, mark_dirty=True)
    marks = cache.mark_dirty_launches(batch)
    assert cache.num_locked() == 2 and int(cache.bypass_count.sum()) == 1 and int(cache.dirty.sum()) == 0
    assert launches.key != marks.key and len(launches.inputs) == 2
    launches.enqueue(list(launches.inputs))
    cache.unlock(batch, mark_dirty=True, launched=True)
    assert cache.num_locked() == 0 and int(cache.bypass_count.sum()) == 0
    assert set(cache.dirty.nonzero().flatten().tolist()) == {s for s in batch.slot_of_index.tolist() if s >= 0}
    with pytest.raises(RuntimeError, match="holds no lock"):
        cache.unlock_launches(batch)
    with pytest.raises(RuntimeError, match="holds no lock"):
        cache.unlock(batch, launched=True)
    empty = prefetch(cache, rows_tensor([]))
    assert cache.unlock_launches(empty) is None and cache.mark_dirty_launches(empty) is None
    cache.unlock(empty, launched=True)


def test_a_batchs_dirty_marks_take_an_array_of_its_padded_size_and_mark_its_slots():
    """mark_dirty_launches of a batch (a pipeline's backward takes them into its CUDA graph, keyed by its
    inputs' shapes) read an array of the prefetch's padded size (a batch whose size differs from the one
    before it), so batches whose size changes every step share a few graphs; they mark exactly the slots
    of the batch's lookups, as marking its slot_of_index does."""
    rows = [3, 17, 42, 99, 260, 301, 3, 17, 5, 7, 11]  # 11 lookups, repeats: padded to 12
    marked = []
    for mark in ("launches", "slot_of_index"):
        cache = SlotCache(make_tables(), num_slots=8, associativity=2)
        cache.unlock(prefetch(cache, rows_tensor([1, 2])))  # a batch of another size first
        batch = prefetch(cache, rows_tensor(rows))
        if mark == "launches":
            launches = cache.mark_dirty_launches(batch)
            (slots,) = launches.inputs
            assert slots.numel() == padded_size(len(rows)) != batch.slot_of_index.numel()
            launches.enqueue(list(launches.inputs))
        else:
            cache.mark_dirty(batch.slot_of_index)
        marked.append(set(cache.dirty.nonzero().flatten().tolist()))
        assert marked[-1] == {s for s in batch.slot_of_index.tolist() if s >= 0}
        cache.unlock(batch)
    assert marked[0] == marked[1]


@pytest.mark.parametrize("sizes, fused", [((5, 5, 5), 2), ((5, 5, 40), 2), ((40, 5, 5), 1), ((5, 40, 12), 1)],
                         ids=["same_size", "earlier_smaller", "first_larger", "second_larger"])
def test_a_prefetch_that_unlocks_earlier_batches_first_equals_unlock_then_prefetch(mover, monkeypatch, sizes, fused):
    """prefetch(rows, unlock_first=[...]) (a pipeline's deferred unlocks: in the prefetch's graph when an
    earlier batch's lookups fit the prefetch's size, its arrays cut or padded to it; else by their own
    launch) leaves the cache as unlock() of each, then prefetch()."""
    generator = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, 60, (n,), generator=generator) for n in sizes]
    caches = [SlotCache(make_tables(), num_slots=8, associativity=2, mover=mover) for _ in range(2)]
    held = [[prefetch(cache, rows_tensor(batches[0].tolist())), prefetch(cache, rows_tensor(batches[1].tolist()))]
            for cache in caches]
    for batch in held[0]:
        caches[0].unlock(batch)
    expected = prefetch(caches[0], rows_tensor(batches[2].tolist()))
    unlocks = []
    unlock = SlotCache.unlock
    monkeypatch.setattr(SlotCache, "unlock", lambda cache, batch, mark_dirty=False, launched=False: (
        unlocks.append(launched), unlock(cache, batch, mark_dirty, launched))[1])
    got = caches[1].prefetch(rows_tensor(batches[2].tolist()), unlock_first=held[1])
    assert sorted(unlocks) == [False] * (2 - fused) + [True] * fused  # launched: in the prefetch's launches
    caches[1].wait_filled(got)
    assert not any(caches[1].holds(batch) for batch in held[1]) and caches[1].holds(got)
    assert torch.equal(got.slot_of_index, expected.slot_of_index)
    for name in ("tags", "locks", "dirty", "bypass_count", "last_use"):
        assert torch.equal(getattr(caches[1], name), getattr(caches[0], name)), name
    for slot, row in enumerate(caches[0].tags.tolist()):  # a slot's columns past its table's dim are not its row's
        dim = next((dim for start, rows, dim, _ in (TABLE_A, TABLE_B) if start <= row < start + rows), 0)
        assert torch.equal(caches[1].weights[slot, :dim], caches[0].weights[slot, :dim]), slot
    assert caches[1].stats() == caches[0].stats()


def test_a_prefetch_refuses_to_unlock_a_batch_it_does_not_hold_and_changes_nothing(mover):
    cache = SlotCache(make_tables(), num_slots=8, associativity=2, mover=mover)
    first = prefetch(cache, rows_tensor([1, 2, 3]))
    second = prefetch(cache, rows_tensor([4]))
    cache.unlock(second)
    locks, step = cache.locks.clone(), cache.step
    for unlock_first in ([first, second], [first, first]):
        with pytest.raises(RuntimeError, match="holds no lock|twice"):
            cache.prefetch(rows_tensor([5, 6]), unlock_first=unlock_first)
        assert cache.step == step and torch.equal(cache.locks, locks) and cache.holds(first)
    empty = cache.prefetch(rows_tensor([]), unlock_first=[first])  # no graph: unlocked by its own launch
    assert not cache.holds(first) and cache.num_locked() == 0
    cache.unlock(empty)


def test_unlock_twice_or_with_a_tensor_is_refused(mover):
    cache = SlotCache(make_tables(), num_slots=8, associativity=4, mover=mover)
    batch = prefetch(cache, rows_tensor([1, 1, 2]))
    assert sorted(cache.locks.tolist()) == [0] * 6 + [1, 1]  # one lock per unique row
    with pytest.raises(TypeError, match="CacheBatch"):
        cache.unlock(batch.slot_of_index)  # a remap is not a batch: nothing released
    assert cache.num_locked() == 2
    cache.unlock(batch)
    with pytest.raises(RuntimeError, match="holds no lock"):
        cache.unlock(batch)
    assert cache.num_locked() == 0 and int(cache.locks.min()) == 0


def test_unlock_of_a_copied_batch_releases_its_rows_left_in_the_backing_store(mover):
    """Issue 12: the batch is found by the step its handle names, so a copy of the handle (with
    copies of its tensors) releases the locks and the rows its prefetch gave no slot, and those
    rows are cached again by the next prefetch."""
    num_sets = 1
    table = CachedTable(0, 200, 2, initial_rows(0, 200, 2).to(DEVICE), None)
    cache = SlotCache([table], num_slots=4, associativity=4, mover=mover)
    holder = prefetch(cache, rows_tensor(rows_of_set(0, num_sets, 4)))  # fills the one set with locked rows
    bypassing = prefetch(cache, rows_tensor([150, 151]))
    assert bypassing.slot_of_index.tolist() == [-1, -1] and cache.bypass_count[150] == 1
    twin = copy.copy(bypassing)
    twin.slot_of_index, twin.locked_slots = twin.slot_of_index.clone(), twin.locked_slots.clone()
    twin.bypassed_rows = twin.bypassed_rows.clone()
    cache.unlock(twin)
    cache.unlock(holder)
    assert int(cache.bypass_count.sum()) == 0 and cache.num_locked() == 0
    with pytest.raises(RuntimeError, match="holds no lock"):
        cache.unlock(bypassing)  # the original names the same batch: released once
    again = prefetch(cache, rows_tensor([150, 151]))
    assert (again.slot_of_index >= 0).all(), "rows released by the copy must be cacheable again"
    torch.testing.assert_close(cache.weights[again.slot_of_index.long()].cpu(), initial_rows(150, 2, 2))


def test_locked_slots_release_a_batch_without_a_sort_and_write_back_names_a_row_once(mover):
    table = CachedTable(0, 300, 3, initial_rows(0, 300, 3).to(DEVICE), None)
    cache = SlotCache([table], num_slots=8, associativity=2, mover=mover)
    batch = prefetch(cache, rows_tensor([7, 7, 250, 7, 3, 250, 11, 19, 23]))
    slot_of_index, locked = batch.slot_of_index, batch.locked_slots
    held = locked[locked >= 0]
    assert held.numel() == torch.unique(held).numel() == int((cache.locks > 0).sum())  # one lock per row
    assert set(held.tolist()) == set(slot_of_index[slot_of_index >= 0].tolist())
    cache.weights[slot_of_index[0]] += 1.0
    cache.write_back(slot_of_index)  # row 7 named three times: one write
    assert cache.stats().write_backs == int((slot_of_index >= 0).sum()) - 3  # 7 x3 and 250 x2 once each
    torch.testing.assert_close(table.weights[7].cpu(), initial_rows(7, 1, 3)[0] + 1.0)
    cache.unlock(batch)
    assert cache.num_locked() == 0
