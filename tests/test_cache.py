"""SlotCache: the slot remap, write-backs, locks, aging, counters, and exact agreement with the simulator.

In simulation mode the Numba kernels run in the CUDA simulator on CPU tensors: the caches
here are tiny (a few sets of a few ways) and the batches short. On a GPU the same tests run
on CUDA tensors; the ``gpu`` tests at the end add the memory tiers and larger sizes.
"""

import copy
import time

import numpy as np
import pytest
import torch

from tiered_tbe import default_device
from tiered_tbe.cache import CachedTable, CacheSimulator, CacheStats, SlotCache, batch_kernels
from tiered_tbe.cache._kernels import NOT_CACHED, OUTCOME_FILLED, OUTCOME_HIT, OUTCOME_NO_SLOT
from tiered_tbe.cache.launch import KernelLauncher
from tiered_tbe.cache.policy import EMPTY, NEXT_USE_UNKNOWN, set_of_row_cpu

# Two cached tables with a table that is not cached between them (global rows 200..249).
# Both cached tables have 24-byte rows (fp32: 4 columns + 2 state values; 6 columns, no state),
# so the simulator's single row_bytes matches the cache's per-table byte counts.
TABLE_A = (0, 200, 4, 2)  # global_row_start, num_rows, dim, state_width
TABLE_B = (250, 100, 6, 0)
UNCACHED = (200, 250)
ROW_BYTES = 24
DEVICE = default_device()


def rows_tensor(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def initial_rows(start, num_rows, dim):
    """Distinct, exactly representable values: row g, column c holds g + c / 8."""
    rows = torch.arange(start, start + num_rows, dtype=torch.float32)[:, None]
    return rows + torch.arange(dim, dtype=torch.float32)[None, :] / 8


def make_tables(device=DEVICE, dtype=torch.float32):
    tables = []
    for start, num_rows, dim, state_width in (TABLE_A, TABLE_B):
        weights = initial_rows(start, num_rows, dim).to(device=device, dtype=dtype)
        state = None
        if state_width:
            state = initial_rows(start, num_rows, state_width).to(device) * -1
        tables.append(CachedTable(start, num_rows, dim, weights, state))
    return tables


def rows_of_set(the_set, num_sets, count, low=0, high=200):
    """The first ``count`` rows in [low, high) that hash to ``the_set``."""
    found = [r for r in range(low, high) if set_of_row_cpu(r, num_sets) == the_set]
    assert len(found) >= count
    return found[:count]


def make_trace(num_batches=30, num_sets=4, seed=0):
    """Batches of global rows with repeats, hot rows, uncached rows, and set conflicts."""
    rng = np.random.default_rng(seed)
    hot = np.array([3, 17, 42, 99, 260, 301])
    conflicting = np.array(rows_of_set(1, num_sets, 9))  # more rows of one set than it has ways
    batches = []
    for b in range(num_batches):
        parts = [rng.choice(hot, size=rng.integers(2, 8)),  # repeats within and across batches
                 rng.integers(0, 200, size=rng.integers(2, 6)),
                 rng.integers(250, 350, size=rng.integers(1, 5)),
                 rng.integers(*UNCACHED, size=rng.integers(0, 3))]
        if b % 5 == 2:
            parts.append(conflicting[rng.permutation(conflicting.size)[: rng.integers(5, 10)]])
        if b % 7 == 3:
            parts.append(conflicting[:2])  # rows hit again later
        batch = np.concatenate(parts)
        batches.append(rng.permutation(batch).astype(np.int64))
    return batches


def prefetch(cache: SlotCache, rows: torch.Tensor):
    """``cache.prefetch``, then wait for the batch's rows (the staged mover moves them behind the call)."""
    batch = cache.prefetch(rows)
    cache.wait_filled(batch)
    return batch


def is_cached_row(rows):
    return (rows < UNCACHED[0]) | ((rows >= TABLE_B[0]) & (rows < TABLE_B[0] + TABLE_B[1]))


class TrainingCheck:
    """Drives a SlotCache as serial training does and checks every row's newest copy.

    Each batch adds 1 to every column (and state value) of every unique row it uses: in the
    row's slot, or in its backing store when its slot is -1. ``updates[g]`` counts them, so
    row g must read ``initial + updates[g]`` wherever the cache says it is.
    """

    def __init__(self, cache: SlotCache):
        self.cache = cache
        self.updates = np.zeros(400, dtype=np.int64)

    def expected(self, table: CachedTable, rows):
        updates = torch.as_tensor(self.updates[rows])[:, None].float()
        value = initial_rows(0, 400, table.dim)[rows] + updates
        state = None
        if table.state is not None:
            state = -initial_rows(0, 400, table.state_width)[rows] + updates
        return value, state

    def table_of(self, row):
        return next(t for t in self.cache.tables if t.global_row_start <= row < t.global_row_start + t.num_rows)

    def step(self, batch: np.ndarray) -> torch.Tensor:
        return self.train(self.prefetch(batch), batch)

    def prefetch(self, batch: np.ndarray):
        return self.cache.prefetch(torch.from_numpy(batch).to(self.cache.device))

    def train(self, prefetched, batch: np.ndarray) -> torch.Tensor:
        """Check and update the rows of a prefetched batch (batches train in prefetch order)."""
        cache = self.cache
        cache.wait_filled(prefetched)
        slot_of_index = prefetched.slot_of_index
        slots = slot_of_index.long().cpu()
        cached = torch.from_numpy(is_cached_row(batch))
        # The remap: uncached tables -1; otherwise the slot holds the row, or -1.
        assert (slots[~cached] == -1).all()
        tags = cache.tags.cpu()
        assert (tags[slots[slots >= 0]] == torch.from_numpy(batch)[slots >= 0]).all()
        # Every lookup reads its row's newest copy, from its slot or its backing store.
        for row in np.unique(batch[is_cached_row(batch)]):
            table = self.table_of(row)
            slot = int(slots[np.flatnonzero(batch == row)[0]])
            weights, state = self._copy(table, row, slot)
            want_weights, want_state = self.expected(table, [row])
            torch.testing.assert_close(weights, want_weights[0], rtol=0, atol=0)
            if state is not None:
                torch.testing.assert_close(state, want_state[0], rtol=0, atol=0)
            # Backward's update, where the kernels would apply it.
            if slot >= 0:
                cache.weights[slot, : table.dim] += 1
                cache.state[slot, : table.state_width] += 1
            else:
                local = row - table.global_row_start
                table.weights[local] += 1
                if table.state is not None:
                    table.state[local] += 1
            self.updates[row] += 1
        cache.mark_dirty(prefetched)
        cache.unlock(prefetched)
        return slot_of_index

    def _copy(self, table, row, slot):
        if slot >= 0:
            state = self.cache.state[slot, : table.state_width] if table.state is not None else None
            return self.cache.weights[slot, : table.dim].float().cpu(), None if state is None else state.cpu()
        local = row - table.global_row_start
        state = table.state[local] if table.state is not None else None
        return table.weights[local].float().cpu(), None if state is None else state.cpu()

    def check_backing_after_flush(self):
        self.cache.flush()
        assert int(self.cache.dirty.sum()) == 0
        for table in self.cache.tables:
            rows = list(range(table.global_row_start, table.global_row_start + table.num_rows))
            want_weights, want_state = self.expected(table, rows)
            torch.testing.assert_close(table.weights.float().cpu(), want_weights, rtol=0, atol=0)
            if table.state is not None:
                torch.testing.assert_close(table.state.cpu(), want_state, rtol=0, atol=0)


def assert_same_state(cache: SlotCache, simulator: CacheSimulator):
    for name in ("tags", "last_use", "use_count", "dirty"):
        np.testing.assert_array_equal(getattr(cache, name).cpu().numpy(), getattr(simulator, name), err_msg=name)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_agrees_with_simulator_hit_for_hit(policy, mover):
    """Same trace, same policy: equal counters after every batch, equal slots, exact rows."""
    cache = SlotCache(make_tables(), num_slots=16, associativity=4, policy=policy, lfu_decay_interval=4, mover=mover,
                      staging_rows=3)
    simulator = CacheSimulator(16, 4, policy, lfu_decay_interval=4, row_bytes=ROW_BYTES)
    check = TrainingCheck(cache)
    for batch in make_trace():
        check.step(batch)
        cached = batch[is_cached_row(batch)]
        simulator.run(cached, np.array([0, cached.size]))
        assert cache.stats() == simulator.stats
        assert_same_state(cache, simulator)
        assert cache.num_locked() == 0
    stats = cache.stats()
    # The trace exercises what it is meant to.
    assert stats.unique_hits > 20 and stats.lookup_hits > stats.unique_hits
    assert stats.evictions > 20 and stats.misses_no_slot > 5 and stats.write_backs == stats.evictions
    check.check_backing_after_flush()


def test_agrees_with_simulator_mixing_training_and_inference(mover):
    """Batches of evaluation (no mark_dirty) between training ones: a clean row that replaces a
    dirty one is clean, and dropping it writes nothing."""
    cache = SlotCache(make_tables(), num_slots=16, associativity=4, policy="lru", mover=mover)
    simulator = CacheSimulator(16, 4, "lru", training=True, row_bytes=ROW_BYTES)
    for b, batch in enumerate(make_trace(num_batches=16, seed=5)):
        prefetched = prefetch(cache, torch.from_numpy(batch).to(DEVICE))
        if b % 3 == 0:
            cache.mark_dirty(prefetched)
        cache.unlock(prefetched)
        cached = batch[is_cached_row(batch)]
        # The simulator replays one mode per run; switch it by hand between batches.
        simulator.training = b % 3 == 0
        simulator.run(cached, np.array([0, cached.size]))
        assert cache.stats() == simulator.stats
        assert_same_state(cache, simulator)
    assert 0 < cache.stats().write_backs < cache.stats().evictions


def test_policies_differ_on_the_trace():
    """The agreement test would not notice a policy argument that is ignored; this trace tells them apart."""
    def run(policy):
        simulator = CacheSimulator(16, 4, policy, lfu_decay_interval=4)
        for batch in make_trace():
            cached = batch[is_cached_row(batch)]
            simulator.run(cached, np.array([0, cached.size]))
        return simulator.stats

    assert run("lru") != run("lfu")


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


def slow_write_backs(cache: SlotCache, seconds: float = 0.02) -> None:
    """Make the staged mover's write-backs land late (a race that skipped a wait would show)."""
    if cache.mover.name == "staged":
        cache.mover.delay = lambda where: time.sleep(seconds) if where == "write_back" else None


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


def test_counters_are_consistent(mover):
    cache = SlotCache(make_tables(), num_slots=16, associativity=4, mover=mover)
    check = TrainingCheck(cache)
    for batch in make_trace(num_batches=12, seed=3):
        check.step(batch)
    stats = cache.stats()
    assert stats.batches == 12
    assert stats.unique_hits + stats.unique_misses == stats.unique_rows
    assert stats.lookup_hits >= stats.unique_hits and stats.lookups >= stats.unique_rows
    assert stats.bytes_in == stats.rows_copied_in * ROW_BYTES
    assert stats.bytes_out == stats.write_backs * ROW_BYTES
    assert stats.evictions <= stats.rows_copied_in
    cache.reset_stats()
    assert cache.stats() == CacheStats()


def reference_bookkeeping(rows, starts, ends, row_bytes, slot_of_unique, outcome, victim_row, victim_was_dirty,
                          none_key):
    """Plain torch (int64, on the CPU): what the prefetch's bookkeeping kernels compute
    (cache/batch_kernels.py) from a batch's rows and the policy kernel's outputs per unique row."""
    n = rows.numel()
    table = (torch.searchsorted(starts, rows, right=True) - 1).clamp(min=0)
    inside = (rows >= starts[table]) & (rows < ends[table])
    unique = torch.unique(rows[inside])  # ascending
    k = unique.numel()
    unique_rows = torch.full((n,), NOT_CACHED, dtype=torch.int64)
    unique_rows[:k] = unique
    position = torch.searchsorted(unique, rows).clamp(max=max(k - 1, 0))
    real = torch.arange(n) < k
    hit, filled, no_slot = (real & (outcome == code) for code in (OUTCOME_HIT, OUTCOME_FILLED, OUTCOME_NO_SLOT))
    evicted = filled & (victim_row != EMPTY)
    dirty_victim = evicted & (victim_was_dirty != 0)

    def bytes_of(of_rows, counted):
        of_table = (torch.searchsorted(starts, of_rows, right=True) - 1).clamp(min=0)
        return int((row_bytes[of_table] * counted).sum())

    counters = {"lookups": int(inside.sum()), "lookup_hits": int((inside & hit[position]).sum()), "unique_rows": k,
                "unique_hits": int(hit.sum()), "unique_misses": k - int(hit.sum()),
                "misses_no_slot": int(no_slot.sum()),
                "evictions": int(evicted.sum()), "write_backs": int(dirty_victim.sum()),
                "bytes_in": bytes_of(unique_rows.clamp(max=int(ends[-1])), filled),
                "bytes_out": bytes_of(victim_row.clamp(min=0), dirty_victim)}
    return {"unique_rows": unique_rows,
            "slot_of_index": torch.where(inside, slot_of_unique.long()[position], -1),
            "bypassed_rows": torch.where(no_slot, unique_rows, NOT_CACHED),
            "write_back_keys": torch.where(dirty_victim, victim_row, none_key),
            "counters": [counters[name] for name in batch_kernels.COUNTER_NAMES]}


@pytest.mark.parametrize("base", [0, 1 << 40], ids=["int32 keys", "int64 keys"])
@pytest.mark.parametrize("shape", ["mixed", "one lookup", "a row repeated", "no cached row"])
def test_prefetch_bookkeeping_kernels_match_plain_torch(base, shape):
    """The prefetch's bookkeeping kernels against reference_bookkeeping, with made-up policy
    outcomes: tables of different row bytes with an uncached gap (and one table of one row),
    rows outside them, repeats, and rows beyond 2^31 (int64 sort keys)."""
    rng = np.random.default_rng(base % 97 + len(shape))
    starts = torch.tensor([5, 40, 100]) + base
    ends = torch.tensor([30, 60, 101]) + base
    row_bytes = torch.tensor([24, 8, 516])
    rows = {"mixed": rng.integers(0, 110, size=200),
            "one lookup": np.array([100]),
            "a row repeated": np.concatenate([np.full(3000, 7), [41, 100, 2]]),
            "no cached row": np.array([0, 31, 99, 3, 3])}[shape] + base
    rows = torch.from_numpy(rng.permutation(rows).astype(np.int64))
    launcher = KernelLauncher(DEVICE)
    on = dict(device=DEVICE)
    unique = batch_kernels.unique_rows_of_batch(launcher, rows.to(**on), starts.to(**on), ends.to(**on),
                                                int(ends[-1]), num_sets=7)
    n, k = rows.numel(), int(unique.unique_number[-1])
    want_unique = reference_bookkeeping(rows, starts, ends, row_bytes, *(torch.zeros(n, dtype=torch.int64),) * 4,
                                        none_key=unique.none_key)["unique_rows"]
    assert torch.equal(unique.unique_rows.cpu(), want_unique)
    want_sets = [set_of_row_cpu(int(row), 7) for row in want_unique[:k]] + [7] * (n - k)
    assert unique.set_of_unique.tolist() == want_sets
    assert (unique.slot_of_unique == -1).all() and (unique.outcome == 0).all()
    assert (unique.victim_row == EMPTY).all() and (unique.victim_was_dirty == 0).all()

    # Made-up decisions of the policy kernel for the unique rows (padding stays as initialised).
    outcome = torch.from_numpy(rng.choice([OUTCOME_HIT, OUTCOME_FILLED, OUTCOME_NO_SLOT], size=k).astype(np.int8))
    slot = torch.from_numpy(rng.integers(0, 50, size=k).astype(np.int32))
    slot[outcome == OUTCOME_NO_SLOT] = -1
    victim = torch.from_numpy(rng.choice(np.r_[np.arange(5, 30), 100] + base, size=k))
    victim[(outcome != OUTCOME_FILLED) | torch.from_numpy(rng.random(k) < 0.3)] = EMPTY
    dirty = torch.from_numpy((rng.random(k) < 0.6).astype(np.uint8)) * (victim != EMPTY)
    for target, values in ((unique.outcome, outcome), (unique.slot_of_unique, slot), (unique.victim_row, victim),
                           (unique.victim_was_dirty, dirty)):
        target[:k] = values.to(**on)
    want = reference_bookkeeping(rows, starts, ends, row_bytes, unique.slot_of_unique.cpu(), unique.outcome.cpu(),
                                 unique.victim_row.cpu(), unique.victim_was_dirty.cpu(), unique.none_key)
    slot_of_index, bypassed_rows, write_back_keys, counters = batch_kernels.outcomes_of_batch(
        launcher, unique, starts.to(**on), row_bytes.to(**on))
    assert slot_of_index.dtype == torch.int32 and torch.equal(slot_of_index.long().cpu(), want["slot_of_index"])
    assert torch.equal(bypassed_rows.cpu(), want["bypassed_rows"])
    assert write_back_keys.dtype == (torch.int32 if base == 0 else torch.int64)
    assert torch.equal(write_back_keys.long().cpu(), want["write_back_keys"])
    assert counters.tolist() == want["counters"]


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


def test_int32_rows_prefetch_as_int64_rows_do():
    caches = [SlotCache(make_tables(), num_slots=16, associativity=4) for _ in range(2)]
    for batch in make_trace(num_batches=8, seed=5):
        slots = []
        for cache, dtype in zip(caches, (torch.int64, torch.int32)):
            prefetched = prefetch(cache, rows_tensor(batch, dtype))
            slots.append(prefetched.slot_of_index.tolist())
            cache.unlock(prefetched, mark_dirty=True)
        assert slots[0] == slots[1]
    assert torch.equal(caches[0].tags, caches[1].tags) and caches[0].stats() == caches[1].stats()
    with pytest.raises(TypeError, match="int64 or int32"):
        caches[0].prefetch(rows_tensor([1, 2], torch.int16))


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
def test_staged_mover_under_random_timing_equals_serial_training(seed):
    """The staged mover's threads slowed at random (sleeps before host copies, one intra-op
    thread, one-row staging buffers so every batch is many chunks), batches kept in flight two
    deep: every row each batch reads is its newest value, as in serial training, and the
    decisions equal the zero-copy cache's."""
    rng = np.random.default_rng(seed)
    checks = {}
    for mover in ("staged", "zero_copy"):
        cache = SlotCache(make_tables(), num_slots=16, associativity=4, mover=mover, staging_rows=1, mover_threads=1)
        if mover == "staged":
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
    assert checks["staged"].cache.stats() == checks["zero_copy"].cache.stats()
    stats = checks["staged"].cache.stats()
    assert stats.write_backs > 10 and stats.misses_no_slot > 3
    assert checks["staged"].cache.mover.stats["rows_written"] >= stats.write_backs


def test_constructor_checks():
    tables = make_tables()
    with pytest.raises(ValueError, match="multiple of associativity"):
        SlotCache(tables, num_slots=10, associativity=4)
    with pytest.raises(ValueError, match="overlaps"):
        SlotCache([tables[0], CachedTable(150, 10, 4, torch.zeros(10, 4, device=DEVICE))], num_slots=8, associativity=4)
    with pytest.raises(ValueError, match="one cache holds one dtype"):
        SlotCache([tables[0], CachedTable(300, 10, 4, torch.zeros(10, 4, dtype=torch.float16, device=DEVICE))], 8, 4)
    with pytest.raises(ValueError, match="weights must be"):
        SlotCache([CachedTable(0, 10, 4, torch.zeros(10, 5, device=DEVICE))], 8, 4)
    with pytest.raises(ValueError, match="policy must be one of"):
        SlotCache(tables, 8, 4, policy="fifo")
    with pytest.raises(ValueError, match="mover must be one of"):
        SlotCache(tables, 8, 4, mover="dma")
    with pytest.raises(ValueError, match="staging_rows must be >= 1"):
        SlotCache(tables, 8, 4, mover="staged", staging_rows=0)
    with pytest.raises(ValueError, match="row_width"):
        SlotCache(tables, 8, 4, row_width=5)
    wide = SlotCache(tables, 8, 4, row_width=8, state_width=3, weights_dtype=torch.float32)
    assert wide.weights.shape == (8, 8) and wide.state.shape == (8, 3)
    assert SlotCache(tables, 8, 4).state.shape == (8, 2)
    with pytest.raises(TypeError, match="int64 or int32"):
        wide.prefetch(rows_tensor([1, 2], torch.int16))
    with pytest.raises(TypeError, match="1-D int64 tensor"):  # hints and lookups take int64 rows only
        wide.lookup(rows_tensor([1, 2], torch.int32))


# ---------------------------------------------------------------- GPU (the lent H200)

@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["device", "host", "managed"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_gpu_agrees_with_simulator_on_every_tier(placement, policy, mover):
    from tiered_tbe.cache.tiers import allocate
    from tiered_tbe.specs import Placement

    tables = []
    for start, num_rows, dim, state_width in (TABLE_A, TABLE_B):
        weights = allocate(Placement(placement), num_rows * dim, torch.float32, "cuda").tensor.view(num_rows, dim)
        weights.copy_(initial_rows(start, num_rows, dim))
        state = None
        if state_width:
            state = allocate(Placement(placement), num_rows * state_width, torch.float32, "cuda").tensor
            state = state.view(num_rows, state_width)
            state.copy_(-initial_rows(start, num_rows, state_width))
        tables.append(CachedTable(start, num_rows, dim, weights, state))
    if mover == "staged" and placement == "device":
        pytest.skip("the staged mover needs a backing store the host can read")
    cache = SlotCache(tables, num_slots=16, associativity=4, policy=policy, lfu_decay_interval=4, device="cuda",
                      mover=mover, staging_rows=3)
    simulator = CacheSimulator(16, 4, policy, lfu_decay_interval=4, row_bytes=ROW_BYTES)
    check = TrainingCheck(cache)
    for batch in make_trace(num_batches=60, seed=7):
        check.step(batch)
        cached = batch[is_cached_row(batch)]
        simulator.run(cached, np.array([0, cached.size]))
        assert cache.stats() == simulator.stats
        assert_same_state(cache, simulator)
    check.check_backing_after_flush()


@pytest.mark.gpu
def test_gpu_large_trace_matches_simulator_and_never_syncs(mover):
    """A Zipf trace over a 1M-row table in pinned host memory, a 4096-slot cache: counters and
    slots equal the simulator's, and prefetch / mark_dirty / unlock / lookup never wait for the
    device (the staged mover's threads do, off this thread)."""
    from tiered_tbe.cache.tiers import allocate
    from tiered_tbe.specs import Placement

    num_rows, dim = 1 << 20, 16
    weights = allocate(Placement.HOST, num_rows * dim, torch.float32, "cuda").tensor.view(num_rows, dim)
    weights.copy_(torch.randn(num_rows, dim, device="cuda"))
    table = CachedTable(0, num_rows, dim, weights, None)
    cache = SlotCache([table], num_slots=4096, associativity=32, policy="lru", device="cuda", mover=mover)
    simulator = CacheSimulator(4096, 32, "lru", row_bytes=dim * 4)
    rng = np.random.default_rng(0)
    batches = [(rng.zipf(1.1, 20000) - 1) % num_rows for _ in range(20)]
    reference = table.weights.clone()
    for trace_batch in batches:
        rows = torch.from_numpy(trace_batch).cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            batch = cache.prefetch(rows)
            again = cache.lookup(rows)
            cache.wait_filled(batch)
            slots = batch.slot_of_index
            cache.mark_dirty(batch)
            cache.unlock(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(slots, again)
        hit = slots >= 0
        assert torch.equal(cache.tags[slots[hit].long()], rows[hit])
        assert torch.equal(cache.weights[slots[hit].long()], reference[rows[hit]])
        simulator.run(trace_batch, np.array([0, trace_batch.size]))
    assert cache.stats() == simulator.stats
    assert_same_state(cache, simulator)
    cache.flush()
    assert torch.equal(table.weights, reference)


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
