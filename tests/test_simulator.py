"""The CPU policy simulator: against an independent plain-Python model of the spec, by hand, and its API."""


import numpy as np
import pytest
import torch

from tiered_tbe.cache import CacheSimulator, CacheStats, simulate, simulate_batches
from tiered_tbe.cache.policy import POLICIES, set_of_row_cpu

# The policies that rank without the lookahead window; each policy that reads the window is run with several.
UNHINTED = [name for name, policy in POLICIES.items() if not policy.reads_window]
WINDOWS = [(name, window) for name, policy in POLICIES.items()
           for window in ((1, 3, 8) if policy.reads_window else (0,))]


def reference_simulate(batches, num_slots, associativity, policy, decay_interval, training=True,
                       lookahead_window=0, pipeline_depth=0):
    """The policy spec of tiered_tbe.cache.policy written out naively, sharing only the hash.

    Each set is a list of ways, each way None or a dict; nothing here is vectorized or compiled.
    Lookahead looks the window up in the batch list itself; a pipeline of depth k releases
    batch j - k right after batch j's prefetch. lfu-admit keeps a dict of use counts by row and takes a
    batch's misses most used first, each refused when its victim's row is used at least as often;
    lookahead-admit takes them soonest needed first, each refused when its victim's row is needed no later.
    """
    num_sets = num_slots // associativity
    sets = [[None] * associativity for _ in range(num_sets)]
    stats = CacheStats()
    held_by_batch = []  # (set, way) locked by each batch
    bypassed_by_batch = []  # rows each batch got no slot for (read from the backing store)
    admitting = policy == "lfu-admit"
    row_counts = {}  # lfu-admit: batches that named each row, halved with the ways' counts

    def next_use(row, batch_index):
        for later in range(batch_index + 1, min(batch_index + lookahead_window, len(batches) - 1) + 1):
            if row in set(int(r) for r in batches[later]):
                return later + 1  # the step of that batch's prefetch
        return float("inf")

    def rank(ways, w, batch_index):
        entry = ways[w]
        if policy == "lru":
            return (entry["last_use"], w)
        if policy in ("lfu", "lfu-admit"):
            return (entry["count"], entry["last_use"], w)
        if policy in ("lookahead", "lookahead-admit"):
            return (-next_use(entry["row"], batch_index), entry["last_use"], w)
        raise NotImplementedError(f"the reference model knows no policy {policy!r}: write its victim key here")

    for batch_index, batch in enumerate(batches):
        step = batch_index + 1
        stats.batches += 1
        held, bypassed = [], set()
        in_flight = range(max(0, batch_index - pipeline_depth), batch_index)  # not yet finished
        barred = set().union(*(bypassed_by_batch[b] for b in in_flight))
        unique_rows = sorted(set(int(r) for r in batch))
        if admitting:
            for row in unique_rows:
                row_counts[row] = min(row_counts.get(row, 0) + 1, 32767)
        hit_rows = set()
        for row in unique_rows:  # hits first
            the_set = set_of_row_cpu(row, num_sets)
            for way, entry in enumerate(sets[the_set]):
                if entry is not None and entry["row"] == row:
                    entry["last_use"], entry["count"] = step, entry["count"] + 1
                    if admitting:
                        entry["count"] = row_counts[row]
                    entry["locks"] += 1
                    held.append((the_set, way))
                    hit_rows.add(row)
        misses = sorted(unique_rows, key=lambda r: (-row_counts[r], r)) if admitting else unique_rows
        if policy == "lookahead-admit":
            misses = sorted(unique_rows, key=lambda r: (next_use(r, batch_index), r))
        room, asked = {}, {}  # per set: its unlocked ways after the hits, the misses that asked it so far
        for row in misses:  # then misses, ascending (lfu-admit: most used first)
            if row in hit_rows:
                continue
            the_set = set_of_row_cpu(row, num_sets)
            ways = sets[the_set]
            free = [w for w in range(associativity) if ways[w] is None or ways[w]["locks"] == 0]
            empty = [w for w in free if ways[w] is None]
            if row in barred:  # a batch in flight reads it from its backing store
                stats.misses_no_slot += 1
                bypassed.add(row)
                continue
            room.setdefault(the_set, len(free))
            asked[the_set] = asked.get(the_set, 0) + 1
            if asked[the_set] > room[the_set]:  # more misses asked than it had unlocked ways, admitted or not
                stats.misses_no_slot += 1
                stats.misses_set_full += 1
                bypassed.add(row)
                continue
            way = empty[0] if empty else min(free, key=lambda w, ways=ways: rank(ways, w, batch_index))
            if admitting and ways[way] is not None and row_counts[row] <= ways[way]["count"]:
                stats.misses_no_slot += 1  # not admitted: read in place, like a row of a full set
                bypassed.add(row)
                continue
            if (policy == "lookahead-admit" and ways[way] is not None
                    and next_use(row, batch_index) >= next_use(ways[way]["row"], batch_index)):
                stats.misses_no_slot += 1  # needed no sooner than its victim: read in place
                bypassed.add(row)
                continue
            if ways[way] is not None:
                stats.evictions += 1
                stats.write_backs += ways[way]["dirty"]
            ways[way] = {"row": row, "last_use": step, "count": row_counts[row] if admitting else 1, "dirty": False,
                         "locks": 1}
            held.append((the_set, way))
        held_by_batch.append(held)
        bypassed_by_batch.append(bypassed)
        if batch_index >= pipeline_depth:  # that batch's backward: dirty, then unlocked
            for the_set, way in held_by_batch[batch_index - pipeline_depth]:
                sets[the_set][way]["locks"] -= 1
                sets[the_set][way]["dirty"] |= training
        if step % decay_interval == 0:
            for ways in sets:
                for entry in ways:
                    if entry is not None:
                        entry["count"] //= 2
            row_counts = {row: count // 2 for row, count in row_counts.items()}
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


@pytest.mark.parametrize("policy", UNHINTED)
@pytest.mark.parametrize("num_slots, associativity, decay", [(8, 2, 3), (32, 4, 5), (48, 8, 64), (6, 6, 2)])
def test_matches_reference_model(policy, num_slots, associativity, decay):
    batches = zipf_batches(seed=num_slots + associativity, num_batches=60, batch_size=40, num_rows=300)
    want = reference_simulate(batches, num_slots, associativity, policy, decay)
    got = simulate(*as_trace(batches), num_slots, associativity, policy, lfu_decay_interval=decay)
    assert got == want
    assert got.evictions > 0 and got.unique_hits > 0


@pytest.mark.parametrize("policy, window", WINDOWS)
@pytest.mark.parametrize("depth", [0, 1, 3])
@pytest.mark.parametrize("num_slots, associativity", [(16, 2), (48, 8), (64, 64)])
def test_window_and_pipeline_depth_match_reference_model(policy, window, depth, num_slots, associativity):
    batches = zipf_batches(seed=num_slots + depth, num_batches=50, batch_size=30, num_rows=300)
    want = reference_simulate(batches, num_slots, associativity, policy, 5, lookahead_window=window,
                              pipeline_depth=depth)
    got = simulate(*as_trace(batches), num_slots, associativity, policy, lfu_decay_interval=5,
                   lookahead_window=window, pipeline_depth=depth)
    assert got == want
    assert got.evictions > 0 and got.unique_hits > 0


def test_lookahead_differs_from_lru_and_deeper_pipelines_lock_more():
    """The reference agreement would not notice an ignored window or depth; these counters do."""
    trace = as_trace(zipf_batches(seed=3, num_batches=80, batch_size=60, num_rows=400))
    lru = simulate(*trace, 32, 4, "lru")
    lookahead = simulate(*trace, 32, 4, "lookahead", lookahead_window=4)
    assert lookahead != lru and lookahead.unique_hits > lru.unique_hits
    assert simulate(*trace, 32, 4, "lookahead", lookahead_window=1) != lookahead
    no_slot = [simulate(*trace, 32, 4, "lru", pipeline_depth=depth).misses_no_slot for depth in (0, 1, 3)]
    assert no_slot[0] < no_slot[1] < no_slot[2]


@pytest.mark.parametrize("policy, window, depth", [("lookahead", 3, 0), ("lookahead", 5, 2), ("lru", 8, 2)])
def test_runs_in_chunks_equal_one_run(policy, window, depth):
    """A trace fed in pieces, each with the window's batches after it as its future (the next piece
    starts with them), is the whole trace; so is simulate_batches, whatever its chunk size."""
    batches = zipf_batches(seed=4, num_batches=60, batch_size=50, num_rows=500)
    options = dict(lfu_decay_interval=7, row_bytes=12, lookahead_window=window, pipeline_depth=depth)
    whole = CacheSimulator(32, 4, policy, **options).run(*as_trace(batches)).finish()
    pieces = CacheSimulator(32, 4, policy, **options)
    for start in range(0, 60, 7):
        rows, offsets = as_trace(batches[start : start + 7 + window])
        pieces.run(rows, offsets, num_batches=min(7, 60 - start))
    assert pieces.step == 60
    assert (pieces.locks.sum() > 0) == (depth > 0)  # the last batches are still in flight
    pieces.finish()
    assert pieces.stats == whole.stats
    for name in ("tags", "last_use", "use_count", "dirty", "locks"):
        np.testing.assert_array_equal(getattr(pieces, name), getattr(whole, name), err_msg=name)
    assert whole.locks.sum() == 0
    for lookups_per_call in (1, 97, 10**6):
        got = simulate_batches(batches, 32, 4, policy, lookups_per_call=lookups_per_call, **options)
        assert got == whole.stats, lookups_per_call
    # Without its future a piece's last batches see a shorter window: the counters differ.
    if policy == "lookahead":
        blind = CacheSimulator(32, 4, policy, **options)
        for start in range(0, 60, 7):
            blind.run(*as_trace(batches[start : start + 7]))
        assert blind.stats != whole.stats


def test_sparse_row_ids_give_the_same_lookahead():
    """Row ids far beyond the trace's size are renumbered before the next-use pass: same result."""
    batches = zipf_batches(seed=5, num_batches=40, batch_size=50, num_rows=300)
    sparse = [b * 1_000_003 + (1 << 40) for b in batches]  # same pattern of repeats, huge ids
    dense_sim = CacheSimulator(16, 16, "lookahead", lookahead_window=4)  # one set: sets do not matter
    sparse_sim = CacheSimulator(16, 16, "lookahead", lookahead_window=4)
    for start in range(0, 40, 10):  # in pieces: the cached rows' next uses are looked up too
        dense_sim.run(*as_trace(batches[start : start + 14]), num_batches=10)
        sparse_sim.run(*as_trace(sparse[start : start + 14]), num_batches=10)
    assert sparse_sim.stats == dense_sim.stats
    assert dense_sim.stats == simulate(*as_trace(batches), 16, 16, "lookahead", lookahead_window=4)


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
    with pytest.raises(ValueError, match=r"batch_offsets\[-1\] must equal len\(rows\) = 3, got 2"):
        simulate(np.zeros(3), np.array([0, 2]), 8, 4)
    with pytest.raises(ValueError, match=r"batch_offsets must be non-decreasing: batch_offsets\[2\] = 1 < "):
        simulate(np.zeros(3), np.array([0, 2, 1, 3]), 8, 4)
    with pytest.raises(ValueError, match=">= 0"):
        simulate(np.array([1, -1]), np.array([0, 2]), 8, 4)
    with pytest.raises(ValueError, match="lookahead_window"):
        simulate(np.zeros(1), np.array([0, 1]), 8, 4, policy="lookahead", lookahead_window=-1)
    with pytest.raises(ValueError, match="pipeline_depth"):
        simulate(np.zeros(1), np.array([0, 1]), 8, 4, pipeline_depth=-1)
    with pytest.raises(ValueError, match="num_batches"):
        CacheSimulator(8, 4).run(np.zeros(1), np.array([0, 1]), num_batches=2)
    with pytest.raises(ValueError, match="policy must be one of"):
        simulate(np.zeros(1), np.array([0, 1]), 8, 4, policy="mru")
