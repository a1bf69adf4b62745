"""A prefetch's bookkeeping: its kernels against plain torch (outcomes, victims, write-back lists,
counters), consistent counters, int32 rows as int64 rows, and the constructor's checks."""


import numpy as np
import pytest
import torch
from cache_helpers import (
    DEVICE,
    ROW_BYTES,
    TrainingCheck,
    make_tables,
    make_trace,
    prefetch,
    rows_tensor,
)

from tiered_tbe.cache import CachedTable, CacheStats, SlotCache, batch_kernels
from tiered_tbe.cache._kernels import NOT_CACHED, OUTCOME_FILLED, OUTCOME_HIT, OUTCOME_NO_SLOT, OUTCOME_SET_FULL
from tiered_tbe.cache.launch import KernelLauncher
from tiered_tbe.cache.policy import EMPTY, set_of_row_cpu


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
    hit, filled, set_full = (real & (outcome == code) for code in (OUTCOME_HIT, OUTCOME_FILLED, OUTCOME_SET_FULL))
    no_slot = set_full | (real & (outcome == OUTCOME_NO_SLOT))  # both leave the row in its backing store
    evicted = filled & (victim_row != EMPTY)
    dirty_victim = evicted & (victim_was_dirty != 0)

    def bytes_of(of_rows, counted):
        of_table = (torch.searchsorted(starts, of_rows, right=True) - 1).clamp(min=0)
        return int((row_bytes[of_table] * counted).sum())

    counters = {"lookups": int(inside.sum()), "lookup_hits": int((inside & hit[position]).sum()), "unique_rows": k,
                "unique_hits": int(hit.sum()), "unique_misses": k - int(hit.sum()),
                "misses_no_slot": int(no_slot.sum()), "misses_set_full": int(set_full.sum()),
                "evictions": int(evicted.sum()), "write_backs": int(dirty_victim.sum()),
                "bytes_in": bytes_of(unique_rows.clamp(max=int(ends[-1])), filled),
                "bytes_out": bytes_of(victim_row.clamp(min=0), dirty_victim)}
    # The rank of each row given no slot among them (ascending rows), for each of its lookups.
    no_slot_rank = torch.cumsum(no_slot.long(), 0) - 1
    return {"unique_rows": unique_rows,
            "slot_of_index": torch.where(inside, slot_of_unique.long()[position], -1),
            "in_place_rank": torch.where(inside & no_slot[position], no_slot_rank[position], -1),
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
    outcome = torch.from_numpy(rng.choice([OUTCOME_HIT, OUTCOME_FILLED, OUTCOME_NO_SLOT, OUTCOME_SET_FULL],
                                          size=k).astype(np.int8))
    slot = torch.from_numpy(rng.integers(0, 50, size=k).astype(np.int32))
    slot[(outcome == OUTCOME_NO_SLOT) | (outcome == OUTCOME_SET_FULL)] = -1
    victim = torch.from_numpy(rng.choice(np.r_[np.arange(5, 30), 100] + base, size=k))
    victim[(outcome != OUTCOME_FILLED) | torch.from_numpy(rng.random(k) < 0.3)] = EMPTY
    dirty = torch.from_numpy((rng.random(k) < 0.6).astype(np.uint8)) * (victim != EMPTY)
    for target, values in ((unique.outcome, outcome), (unique.slot_of_unique, slot), (unique.victim_row, victim),
                           (unique.victim_was_dirty, dirty)):
        target[:k] = values.to(**on)
    want = reference_bookkeeping(rows, starts, ends, row_bytes, unique.slot_of_unique.cpu(), unique.outcome.cpu(),
                                 unique.victim_row.cpu(), unique.victim_was_dirty.cpu(), unique.none_key)
    slot_of_index, in_place_rank, bypassed_rows, write_back_keys, counters = batch_kernels.outcomes_of_batch(
        launcher, unique, starts.to(**on), row_bytes.to(**on))
    assert slot_of_index.dtype == torch.int32 and torch.equal(slot_of_index.long().cpu(), want["slot_of_index"])
    assert in_place_rank.dtype == torch.int32 and torch.equal(in_place_rank.long().cpu(), want["in_place_rank"])
    assert torch.equal(bypassed_rows.cpu(), want["bypassed_rows"])
    assert write_back_keys.dtype == (torch.int32 if base == 0 else torch.int64)
    assert torch.equal(write_back_keys.long().cpu(), want["write_back_keys"])
    assert counters.tolist() == want["counters"]


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
