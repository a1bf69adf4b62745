"""The CPU policy simulator: against an independent plain-Python model of the spec, by hand, and its API."""

import time

import numpy as np
import pytest
import torch

from tiered_tbe.cache import CacheSimulator, CacheStats, simulate, simulate_batches
from tiered_tbe.cache.policy import set_of_row_cpu


def reference_simulate(batches, num_slots, associativity, policy, decay_interval, training=True):
    """The policy spec of tiered_tbe.cache.policy written out naively, sharing only the hash.

    Each set is a list of ways, each way None or a dict; nothing here is vectorized or compiled.
    """
    num_sets = num_slots // associativity
    sets = [[None] * associativity for _ in range(num_sets)]
    stats = CacheStats()
    for step, batch in enumerate(batches, start=1):
        stats.batches += 1
        used_ways = set()
        unique_rows = sorted(set(int(r) for r in batch))
        hit_rows = set()
        for row in unique_rows:  # hits first
            ways = sets[set_of_row_cpu(row, num_sets)]
            for way, entry in enumerate(ways):
                if entry is not None and entry["row"] == row:
                    entry["last_use"], entry["count"] = step, entry["count"] + 1
                    used_ways.add((set_of_row_cpu(row, num_sets), way))
                    hit_rows.add(row)
        for row in unique_rows:  # then misses, ascending
            if row in hit_rows:
                continue
            the_set = set_of_row_cpu(row, num_sets)
            ways = sets[the_set]
            free = [w for w in range(associativity) if (the_set, w) not in used_ways]
            empty = [w for w in free if ways[w] is None]
            if empty:
                way = empty[0]
            elif free:
                way = min(free, key=lambda w, ways=ways: (
                    (ways[w]["last_use"], w) if policy == "lru" else (ways[w]["count"], ways[w]["last_use"], w)))
            else:
                stats.misses_no_slot += 1
                continue
            if ways[way] is not None:
                stats.evictions += 1
                stats.write_backs += ways[way]["dirty"]
            ways[way] = {"row": row, "last_use": step, "count": 1, "dirty": False}
            used_ways.add((the_set, way))
        for the_set, way in used_ways:
            sets[the_set][way]["dirty"] |= training
        if step % decay_interval == 0:
            for ways in sets:
                for entry in ways:
                    if entry is not None:
                        entry["count"] //= 2
        stats.lookups += len(batch)
        stats.lookup_hits += sum(int(r) in hit_rows for r in batch)
        stats.unique_rows += len(unique_rows)
        stats.unique_hits += len(hit_rows)
        stats.unique_misses += len(unique_rows) - len(hit_rows)
    return stats


def as_trace(batches):
    rows = np.concatenate(batches) if batches else np.zeros(0, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum([b.size for b in batches])]).astype(np.int64)
    return rows.astype(np.int64), offsets


def zipf_batches(seed, num_batches, batch_size, num_rows, exponent=1.2):
    rng = np.random.default_rng(seed)
    return [(rng.zipf(exponent, rng.integers(1, batch_size)) - 1) % num_rows for _ in range(num_batches)]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("num_slots, associativity, decay", [(8, 2, 3), (32, 4, 5), (48, 8, 64), (6, 6, 2)])
def test_matches_reference_model(policy, num_slots, associativity, decay):
    batches = zipf_batches(seed=num_slots + associativity, num_batches=60, batch_size=40, num_rows=300)
    want = reference_simulate(batches, num_slots, associativity, policy, decay)
    got = simulate(*as_trace(batches), num_slots, associativity, policy, lfu_decay_interval=decay)
    assert got == want
    assert got.evictions > 0 and got.unique_hits > 0


def test_inference_writes_nothing_back():
    batches = zipf_batches(seed=1, num_batches=40, batch_size=30, num_rows=200)
    stats = simulate(*as_trace(batches), 16, 4, training=False)
    assert stats == reference_simulate(batches, 16, 4, "lru", 64, training=False)
    assert stats.evictions > 0 and stats.write_backs == 0 and stats.bytes_out == 0


def test_small_trace_by_hand():
    # One set of two ways, LRU. Batches: [1, 1, 2], [1], [3], [2, 4].
    rows = np.array([1, 1, 2, 1, 3, 2, 4])
    offsets = np.array([0, 3, 4, 5, 7])
    sim = CacheSimulator(2, 2, row_bytes=10).run(rows, offsets)
    # step 1: 1, 2 fill both ways. step 2: 1 hits. step 3: 3 evicts 2 (last used at step 1).
    # step 4: 2 and 4 miss; 2 evicts 1 (step 2, older than 3's step 3), 4 evicts 3.
    assert sim.stats == CacheStats(batches=4, lookups=7, lookup_hits=1, unique_rows=6, unique_hits=1,
                                   unique_misses=5, misses_no_slot=0, evictions=3, write_backs=3,
                                   bytes_in=50, bytes_out=30)
    assert sim.tags.tolist() == [2, 4] and sim.last_use.tolist() == [4, 4] and sim.dirty.tolist() == [1, 1]


def test_a_batch_larger_than_its_set_gets_no_slot_for_the_rest():
    rows = np.arange(10, dtype=np.int64)  # one batch of 10 distinct rows, one set of 4 ways
    stats = simulate(rows, np.array([0, 10]), 4, 4)
    assert (stats.unique_misses, stats.misses_no_slot, stats.rows_copied_in) == (10, 6, 4)
    sim = CacheSimulator(4, 4).run(rows, np.array([0, 10]))
    assert sim.tags.tolist() == [0, 1, 2, 3]  # ascending row order takes the ways


def test_simulate_batches_equals_simulate_across_chunks():
    batches = zipf_batches(seed=2, num_batches=50, batch_size=50, num_rows=500)
    want = simulate(*as_trace(batches), 32, 4, "lfu", lfu_decay_interval=7, row_bytes=12)
    mixed = [torch.from_numpy(b) if i % 2 else b.tolist() for i, b in enumerate(batches)]
    got = simulate_batches(mixed, 32, 4, "lfu", lfu_decay_interval=7, row_bytes=12, lookups_per_call=97)
    assert got == want
    assert simulate_batches([], 32, 4) == CacheStats()


def test_empty_batches_are_steps():
    # An empty batch still advances the clock (and LFU's aging), as SlotCache.prefetch does.
    rows = np.array([5, 5, 5, 9], dtype=np.int64)
    with_empty = CacheSimulator(2, 2, "lfu", lfu_decay_interval=2).run(rows, np.array([0, 1, 1, 2, 3, 4]))
    assert with_empty.step == 5 and with_empty.stats.batches == 5
    # Row 5: used at steps 1, 3, 4, halved after steps 2 and 4: ((1 >> 1) + 2) >> 1 = 1. Row 9:
    # filled at step 5, not halved. Were the empty batch no step, row 9 would be halved to 0.
    assert with_empty.use_count.tolist() == [1, 1]


def test_input_checks():
    with pytest.raises(ValueError, match="multiple of associativity"):
        simulate(np.zeros(1), np.array([0, 1]), 10, 4)
    with pytest.raises(ValueError, match="rise from 0"):
        simulate(np.zeros(3), np.array([0, 2]), 8, 4)
    with pytest.raises(ValueError, match=">= 0"):
        simulate(np.array([1, -1]), np.array([0, 2]), 8, 4)
    with pytest.raises(ValueError, match="lookahead"):
        simulate(np.zeros(1), np.array([0, 1]), 8, 4, policy="lookahead")
    with pytest.raises(ValueError, match="policy must be one of"):
        simulate(np.zeros(1), np.array([0, 1]), 8, 4, policy="mru")


def test_speed_a_million_lookups_in_well_under_a_second():
    rng = np.random.default_rng(0)
    rows = (rng.zipf(1.05, 1_000_000) - 1) % 10_000_000
    offsets = np.append(np.arange(0, rows.size, 20_000), rows.size)
    simulate(rows[:100], np.array([0, 100]), 1024, 32)  # compile outside the timing
    start = time.perf_counter()
    stats = simulate(rows, offsets, 1 << 16, 32)
    seconds = time.perf_counter() - start
    assert stats.lookups == rows.size
    # ~0.1-0.3 s on one core of a loaded machine: 100M lookups well under a minute. The bound
    # is loose so a busy CI machine passes; a per-batch Python loop would take seconds.
    assert seconds < 2.0, f"{seconds:.2f} s for 1M lookups"
