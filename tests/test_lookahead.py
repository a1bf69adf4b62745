"""The lookahead policy and pipelined locking: SlotCache.add_upcoming (the window bits), the
simulator's window and pipeline depth against the cache, Belady's rule within the window, and what
lookahead saves.

The SlotCache tests run the Numba kernels in the CUDA simulator (tiny caches, short traces);
the simulator-only tests use larger Zipf traces.
"""

import numpy as np
import pytest
import torch
from cache_helpers import (
    DEVICE,
    ROW_BYTES,
    initial_rows,
    is_cached_row,
    make_tables,
    make_trace,
    rows_of_set,
    rows_tensor,
)

from tiered_tbe.base.sorting import INT64_MAX
from tiered_tbe.cache import MAX_LOOKAHEAD, CachedTable, CacheSimulator, SlotCache, simulate
from tiered_tbe.cache._kernels import WINDOW_BITS
from tiered_tbe.cache.bounds import belady
from tiered_tbe.cache.policy import EMPTY, NEXT_USE_UNKNOWN, POLICIES
from tiered_tbe.traces import zipf_trace


def add_window(cache: SlotCache, batches, j: int, window: int) -> None:
    """What the pipeline does before prefetching batch ``j``: record each batch of ``j+1 .. j+window``
    (fewer at the end) that is not recorded yet, at the step of its prefetch."""
    for later in range(j + 1, min(j + window, len(batches) - 1) + 1):
        step = cache.step + 1 + (later - j)
        if step not in cache.upcoming_steps:
            cache.add_upcoming(torch.from_numpy(batches[later]).to(DEVICE), step)


def assert_decoded_next_use(cache: SlotCache, reference: list[int], tags_before: list[int]) -> None:
    """After a lookahead prefetch: every slot that held a row, in a set where a row was filled (so
    a victim was chosen), has the next use that ``next_use_of_slots`` gave before the prefetch."""
    ways = cache.associativity
    tags_after, next_use = cache.tags.tolist(), cache.next_use.tolist()
    for first in range(0, cache.num_slots, ways):
        if tags_before[first:first + ways] == tags_after[first:first + ways]:
            continue  # no fill: the set may not have chosen a victim, its next_use is stale
        for slot in range(first, first + ways):
            if tags_before[slot] != EMPTY:
                assert next_use[slot] == reference[slot], (cache.step, slot)


class PipelinedDriver:
    """Drives a SlotCache as a prefetch pipeline of depth ``depth`` does, batch by batch.

    Before batch j: the lookahead hint of batches j+1..j+window (lookahead only); then its
    prefetch; then batch j - depth finishes: mark_dirty of its slots (training), unlock.
    """

    def __init__(self, cache: SlotCache, batches, window: int, depth: int, hints: bool = True):
        self.cache, self.batches, self.window, self.depth, self.hints = cache, batches, window, depth, hints
        self.in_flight: list = []  # CacheBatch of the batches prefetched, not finished

    def hint(self, j: int) -> None:
        """The lookahead hints before batch j's prefetch (nothing for other policies)."""
        if self.hints:
            add_window(self.cache, self.batches, j, self.window)

    def prefetch(self, j: int) -> torch.Tensor:
        """Batch j's prefetch, then batch j - depth finishes."""
        cache = self.cache
        rows = torch.from_numpy(self.batches[j]).to(DEVICE)
        batch = cache.prefetch(rows)
        cache.wait_filled(batch)
        slot_of_index = batch.slot_of_index
        hit = slot_of_index >= 0
        assert torch.equal(cache.tags[slot_of_index[hit].long()], rows[hit])
        self.in_flight.append(batch)
        if len(self.in_flight) > self.depth:
            self._finish_oldest()
        return slot_of_index

    def step(self, j: int) -> torch.Tensor:
        self.hint(j)
        return self.prefetch(j)

    def finish(self) -> None:
        while self.in_flight:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        batch = self.in_flight.pop(0)
        self.cache.mark_dirty(batch)
        self.cache.unlock(batch)


def assert_same_state(cache: SlotCache, simulator: CacheSimulator):
    for name in ("tags", "last_use", "use_count", "dirty", "locks"):
        np.testing.assert_array_equal(getattr(cache, name).cpu().numpy(), getattr(simulator, name), err_msg=name)


def words_of(cache: SlotCache, rows) -> list[int]:
    return cache.window_bits[rows_tensor(rows)].tolist()


def bit(step: int) -> int:
    """The int64 value of a word holding only the bit of ``step``."""
    return int(np.array([1 << (step % WINDOW_BITS)], dtype=np.uint64).view(np.int64)[0])


def test_add_upcoming_sets_one_bit_per_step_and_clears_it_when_the_step_leaves_the_window(mover):
    cache = SlotCache(make_tables(), num_slots=16, associativity=4, policy="lookahead", mover=mover)
    assert cache.window_bits is None  # nothing allocated before the first hint
    # Repeats, a row of the uncached table between the cached ones (210), rows outside every
    # table (10**12, -1) and padding (INT64_MAX) are fine; only rows of cached tables get bits.
    cache.add_upcoming(rows_tensor([17, 3, 17, 210, 10**12, -1, INT64_MAX, 260, 17]), 2)
    cache.add_upcoming(rows_tensor([3, 3, 299]), 3)
    cache.add_upcoming(rows_tensor([]), 4)
    cache.add_upcoming(rows_tensor([17, 349]), 65)  # bit 1: step 1 is not recorded
    assert cache.window_bits.shape == (350,) and cache.upcoming_steps == [2, 3, 4, 65]
    assert words_of(cache, [17, 3, 260, 299, 349]) == [bit(2) | bit(65), bit(2) | bit(3), bit(2), bit(3), bit(65)]
    assert int(cache.window_bits.count_nonzero()) == 5  # row 210 and the others got nothing

    cache.unlock(cache.prefetch(rows_tensor([17])))  # step 1: nothing recorded leaves the window
    assert cache.upcoming_steps == [2, 3, 4, 65]
    # Step 66 shares bit 2 with step 2, which the next prefetch (step 2) forgets: forgotten first.
    cache.add_upcoming(rows_tensor([3, 349, 349]), 66)
    assert cache.upcoming_steps == [3, 4, 65, 66]
    assert words_of(cache, [17, 3, 260, 299, 349]) == [bit(65), bit(3) | bit(66), 0, bit(3), bit(65) | bit(66)]
    for _ in range(2):  # steps 2 and 3: step 3 leaves
        cache.unlock(cache.prefetch(rows_tensor([])))
    assert cache.upcoming_steps == [4, 65, 66]
    assert words_of(cache, [17, 3, 260, 299, 349]) == [bit(65), bit(66), 0, 0, bit(65) | bit(66)]
    # Bit 63, the sign bit: step 127 is the soonest use of row 3 at the prefetch of step 64 ...
    for _ in range(60):  # ... steps 4 .. 63
        cache.prefetch(rows_tensor([]))
    cache.add_upcoming(rows_tensor([3]), 127)
    assert words_of(cache, [3]) == [bit(66) | bit(127)] and bit(127) < 0
    cache.clear_upcoming()
    assert cache.upcoming_steps == [] and int(cache.window_bits.count_nonzero()) == 0


def test_add_upcoming_rejects_bad_input_and_changes_nothing(mover):
    cache = SlotCache(make_tables(), num_slots=16, associativity=4, policy="lookahead", mover=mover)
    cache.unlock(cache.prefetch(rows_tensor([3])))  # step 1: hints for steps 3 .. 66
    bad = [
        (ValueError, "outside the window", rows_tensor([3]), 2),  # the next prefetch's own batch
        (ValueError, "outside the window", rows_tensor([3]), 1),
        (ValueError, "outside the window", rows_tensor([3]), 3 + WINDOW_BITS),
        (TypeError, "step must be an int", rows_tensor([3]), 3.0),
        (TypeError, "step must be an int", rows_tensor([3]), True),
        (TypeError, "int64", rows_tensor([3], torch.int32), 3),
        (TypeError, "int64", rows_tensor([[3]]), 3),
        (ValueError, "on meta", torch.zeros(1, dtype=torch.int64, device="meta"), 3),
    ]
    for error, message, rows, step in bad:  # before any hint: nothing gets allocated either
        with pytest.raises(error, match=message):
            cache.add_upcoming(rows, step)
        assert cache.window_bits is None and cache.upcoming_steps == []
    cache.add_upcoming(rows_tensor([3, 17]), 3)
    cache.add_upcoming(rows_tensor([42]), 2 + MAX_LOOKAHEAD)  # the farthest step
    bits_before = cache.window_bits.clone()
    for error, message, rows, step in bad + [(ValueError, "already recorded", rows_tensor([5]), 3)]:
        with pytest.raises(error, match=message):
            cache.add_upcoming(rows, step)
        assert torch.equal(cache.window_bits, bits_before) and cache.upcoming_steps == [3, 2 + MAX_LOOKAHEAD]


@pytest.mark.parametrize("num_rows", [0, 1, 3000])
def test_window_bits_kernel_equals_its_torch_reference(num_rows, device):
    """Random rows (repeats, rows of no cached table before, between and after the tables, -1, INT64_MAX
    padding) set and clear random bits, bit 63 among them, of words that already hold bits; more rows
    than a program's block."""
    from tiered_tbe.cache.window_bits import update_window_bits, update_window_bits_reference

    generator = torch.Generator().manual_seed(num_rows)
    table_starts = torch.tensor([5, 40, 41, 200], device=device)
    table_ends = torch.tensor([30, 41, 100, 260], device=device)  # rows 30..39 and 100..199 are of no cached table
    rows = torch.randint(-3, 280, (num_rows,), generator=generator).to(device)
    if num_rows:
        rows[::7] = INT64_MAX
        rows[::11] = 40  # a table of one row, named many times
    words = torch.randint(-2**62, 2**62, (260,), generator=generator).to(device)
    initial, expected = words.clone(), words.clone()
    for step, set_bit in [(63, True), (2, True), (127, False), (66, False), (9, True), (0, False)]:
        update_window_bits(words, rows, table_starts, table_ends, step, set_bit)
        update_window_bits_reference(expected, rows, table_starts, table_ends, step, set_bit)
        assert torch.equal(words, expected), (step, set_bit)
    untouched = torch.cat([torch.arange(0, 5), torch.arange(30, 40), torch.arange(100, 200)]).to(device)
    assert torch.equal(words[untouched], initial[untouched])
    assert num_rows == 0 or not torch.equal(words, initial)


def soonest_uses(recorded: dict[int, list[int]], step: int) -> dict[int, int]:
    """row -> the soonest recorded step in ``step + 2 .. step + 1 + WINDOW_BITS`` naming it."""
    soonest = {}
    for later in sorted(recorded, reverse=True):
        if step + 1 < later <= step + 1 + WINDOW_BITS:
            soonest.update({row: later for row in recorded[later]})
    return soonest


def test_next_use_of_slots_is_the_soonest_recorded_step_of_each_row(mover):
    """Random hints over 150 steps (the window's bits wrap around twice), checked before every
    prefetch against a direct computation; each prefetch decodes the same values on the device."""
    rng = np.random.default_rng(5)
    cache = SlotCache(make_tables(), num_slots=32, associativity=4, policy="lookahead", mover=mover)
    candidates = np.concatenate([np.arange(0, 40), np.arange(250, 270)])  # crowded sets, two tables
    recorded: dict[int, list[int]] = {}
    for _ in range(150):
        step = cache.step
        for later in rng.choice(np.arange(step + 2, step + 2 + WINDOW_BITS), size=3, replace=False).tolist():
            if later not in cache.upcoming_steps:
                rows = rng.choice(candidates, size=int(rng.integers(0, 6))).tolist() + [210, INT64_MAX]
                cache.add_upcoming(rows_tensor(rows), later)
                recorded[later] = rows
        soonest = soonest_uses(recorded, step)
        tags_before = cache.tags.tolist()
        reference = cache.next_use_of_slots().tolist()
        assert reference == [soonest.get(row, NEXT_USE_UNKNOWN) for row in tags_before]
        cache.unlock(cache.prefetch(rows_tensor(rng.choice(candidates, size=6).tolist())))
        assert_decoded_next_use(cache, reference, tags_before)
    assert cache.stats().evictions > 100


@pytest.mark.parametrize("depth", [0, 2])
def test_a_window_of_64_batches_agrees_with_the_simulator_across_the_wrap_of_the_bits(depth, mover):
    """Steps 60 .. 130 with a window of 64 batches: every prefetch's window spans a multiple of 64,
    so the steps' bits wrap around; the cache and the simulator choose the same victims."""
    window, warmup = MAX_LOOKAHEAD, 59
    batches = make_trace(num_batches=71, num_sets=8, seed=3)
    cached_batches = [batch[is_cached_row(batch)] for batch in batches]
    cache = SlotCache(make_tables(), num_slots=32, associativity=4, policy="lookahead", lfu_decay_interval=4,
                      mover=mover)
    simulator = CacheSimulator(32, 4, "lookahead", lfu_decay_interval=4, row_bytes=ROW_BYTES,
                               lookahead_window=window, pipeline_depth=depth)
    for _ in range(warmup):  # empty batches: only the steps move
        cache.prefetch(rows_tensor([]))
    simulator.run(np.zeros(0, dtype=np.int64), np.zeros(warmup + 1, dtype=np.int64))
    driver = PipelinedDriver(cache, batches, window, depth)
    for j in range(len(batches)):
        driver.hint(j)
        tags_before, reference = cache.tags.tolist(), cache.next_use_of_slots().tolist()
        driver.prefetch(j)
        assert_decoded_next_use(cache, reference, tags_before)
        known = cached_batches[j : j + 1 + window]
        simulator.run(np.concatenate(known), np.concatenate([[0], np.cumsum([b.size for b in known])]), 1)
        assert cache.stats() == simulator.stats, j
        assert_same_state(cache, simulator)
    assert cache.step == warmup + len(batches) and cache.upcoming_steps == []
    driver.finish()
    simulator.finish()
    assert_same_state(cache, simulator)
    lru = simulate(np.concatenate(cached_batches), np.concatenate([[0], np.cumsum([b.size for b in cached_batches])]),
                   32, 4, "lru", lfu_decay_interval=4, row_bytes=ROW_BYTES, pipeline_depth=depth)
    assert cache.stats().evictions > 20 and cache.stats() != lru  # the hints changed victims


@pytest.mark.parametrize("policy, window, depth", [  # every policy of the registry
    (name, window, depth) for name, policy in POLICIES.items()
    for window, depth in (((1, 0), (3, 0), (1, 2), (3, 2)) if policy.reads_window else ((0, 2),))
])
def test_slot_cache_agrees_with_simulator(policy, window, depth, mover):
    """Same trace, hints and pipeline: equal counters and per-slot state (locks included) after every
    batch, and after the batches still in flight finish."""
    batches = make_trace(num_batches=24, num_sets=8, seed=11)
    cached_batches = [batch[is_cached_row(batch)] for batch in batches]
    cache = SlotCache(make_tables(), num_slots=32, associativity=4, policy=policy, lfu_decay_interval=4,
                      mover=mover)
    simulator = CacheSimulator(32, 4, policy, lfu_decay_interval=4, row_bytes=ROW_BYTES, lookahead_window=window,
                               pipeline_depth=depth)
    driver = PipelinedDriver(cache, batches, window, depth, hints=POLICIES[policy].reads_window)
    for j in range(len(batches)):
        driver.step(j)
        # The simulator sees batch j and its window (the window's uncached rows change nothing).
        known = cached_batches[j : j + 1 + window]
        offsets = np.concatenate([[0], np.cumsum([b.size for b in known])])
        simulator.run(np.concatenate(known), offsets, num_batches=1)
        assert cache.stats() == simulator.stats, j
        assert_same_state(cache, simulator)
    driver.finish()
    simulator.finish()
    assert_same_state(cache, simulator)
    assert cache.num_locked() == 0
    stats = cache.stats()
    # lookahead-admit leaves a miss in place unless the window needs it before its victim: few evictions here.
    assert stats.evictions > (2 if policy == "lookahead-admit" else 10)
    assert stats.write_backs > 0 and stats.unique_hits > 20
    if depth:
        assert stats.misses_no_slot > 0  # the trace fills sets with the locks of batches in flight


def test_lookahead_without_hints_is_lru(mover):
    batches = make_trace(num_batches=16, num_sets=4, seed=2)
    lookahead = SlotCache(make_tables(), num_slots=16, associativity=4, policy="lookahead", mover=mover)
    driver = PipelinedDriver(lookahead, batches, window=0, depth=1, hints=False)
    lru = CacheSimulator(16, 4, "lru", pipeline_depth=1, row_bytes=ROW_BYTES)
    for j, batch in enumerate(batches):
        driver.step(j)
        cached = batch[is_cached_row(batch)]
        lru.run(cached, np.array([0, cached.size]))
        assert lookahead.stats() == lru.stats
        assert_same_state(lookahead, lru)
    # In the simulator: a window of no batches is LRU, at any depth; a window of some is not.
    trace = zipf_trace(5_000, 1.05, 64, 4, 40, seed=0)
    rows, offsets = trace.rows, trace.batch_offsets
    for depth in (0, 2):
        plain = simulate(rows, offsets, 256, 8, "lru", pipeline_depth=depth)
        assert simulate(rows, offsets, 256, 8, "lookahead", lookahead_window=0, pipeline_depth=depth) == plain
        assert simulate(rows, offsets, 256, 8, "lookahead", lookahead_window=2, pipeline_depth=depth) != plain


def eviction_check(policy: str, window: int, depth: int, seed: int) -> tuple[int, int]:
    """Drive a two-set SlotCache over a trace of rows crowding one set; at every prefetch check, from
    the cache's own state, each row evicted against the rows left in the set.

    Returns (needed rows evicted while an unneeded unlocked row stayed: violations, evictions
    checked). Asserts that the next use the cache decodes (``next_use_of_slots``, and the kernel's
    own for the sets it chose victims in) is the window's soonest use, and that no locked row is
    evicted.
    """
    rng = np.random.default_rng(seed)
    table = CachedTable(0, 400, 1, initial_rows(0, 400, 1).to(DEVICE), None)
    cache = SlotCache([table], num_slots=8, associativity=4, policy=policy)
    crowded = rows_of_set(0, 2, 10, high=400)  # ten rows for four ways
    other = rows_of_set(1, 2, 3, high=400)
    batches = [rng.permutation(np.concatenate([rng.choice(crowded, int(rng.integers(1, 4)), replace=False),
                                               rng.choice(other, int(rng.integers(0, 2)))])).astype(np.int64)
               for _ in range(30)]
    driver = PipelinedDriver(cache, batches, window, depth, hints=True)
    violations = checked = 0
    for j, batch in enumerate(batches):
        step = cache.step + 1  # this prefetch's step
        soonest = {}  # row -> step of its first batch in the window
        for later in range(min(j + window, len(batches) - 1), j, -1):
            soonest.update({int(row): step + later - j for row in batches[later]})
        driver.hint(j)
        tags_before, locks_before = cache.tags.tolist(), cache.locks.tolist()
        reference = cache.next_use_of_slots().tolist()
        assert reference == [soonest.get(row, NEXT_USE_UNKNOWN) for row in tags_before]
        driver.prefetch(j)
        if policy == "lookahead":
            assert_decoded_next_use(cache, reference, tags_before)
        tags_after, used = cache.tags.tolist(), set(batch.tolist())
        for slot, (old, new) in enumerate(zip(tags_before, tags_after)):
            if old < 0 or old == new:
                continue
            assert locks_before[slot] == 0, "a locked row was evicted"
            checked += 1
            first = slot - slot % 4
            # Ways that were candidates too (unlocked, not used by this batch) and kept their row.
            kept = [s for s in range(first, first + 4) if s != slot and locks_before[s] == 0
                    and tags_before[s] >= 0 and tags_before[s] == tags_after[s] and tags_before[s] not in used]
            if old in soonest and any(tags_before[s] not in soonest or soonest[tags_before[s]] > soonest[old]
                                      for s in kept):
                violations += 1
    driver.finish()
    return violations, checked


@pytest.mark.parametrize("depth", [0, 1])
def test_lookahead_never_evicts_a_needed_row_while_an_unneeded_one_is_in_the_set(depth):
    """Also: of needed rows, the one needed latest goes first. LRU, on the same trace, does not."""
    seed = 2 + 2 * depth  # traces on which LRU does evict a needed row (the check is not vacuous)
    violations, checked = eviction_check("lookahead", window=3, depth=depth, seed=seed)
    assert violations == 0 and checked > 20
    lru_violations, _ = eviction_check("lru", window=3, depth=depth, seed=seed)
    assert lru_violations > 0  # the trace does put needed and unneeded rows in one set


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("depth", [0, 2])
def test_belady_bounds_lookahead(seed, depth):
    rng = np.random.default_rng(seed)
    alpha = float(rng.uniform(0.8, 1.4))
    trace = zipf_trace(20_000, alpha, 128, 4, 50, seed=seed)
    for num_slots in (64, 512, 2048):
        optimum = belady(trace.rows, trace.batch_offsets, num_slots, num_rows=trace.num_rows)
        for window in (1, 4, 16):
            stats = simulate(trace.rows, trace.batch_offsets, num_slots, 8, "lookahead", lookahead_window=window,
                             pipeline_depth=depth)
            assert optimum.unique_hits >= stats.unique_hits, (num_slots, window)
            assert optimum.hit_rate_by_lookup >= stats.hit_rate_by_lookup, (num_slots, window)


def rows_moved(stats) -> int:
    return stats.rows_copied_in + stats.write_backs


def test_lookahead_moves_fewer_rows_than_lru():
    """Zipf 1.05 over 200K rows, batches of 8192 lookups, a cache of 5% of the rows in 32-way sets,
    a window of 4 batches: lookahead moves 0.845x the rows LRU moves serially and 0.897x with a
    pipeline of depth 2 (whose locks leave it fewer victims to choose from); with a window of 8
    batches, 0.765x and 0.876x."""
    trace = zipf_trace(200_000, 1.05, 1024, 8, 120, seed=0)
    for depth, most in ((0, 0.86), (2, 0.91)):
        lru = simulate(trace.rows, trace.batch_offsets, 9984, 32, "lru", pipeline_depth=depth)
        lookahead = simulate(trace.rows, trace.batch_offsets, 9984, 32, "lookahead", lookahead_window=4,
                             pipeline_depth=depth)
        assert rows_moved(lookahead) / rows_moved(lru) < most, depth
        assert lookahead.hit_rate_by_lookup > lru.hit_rate_by_lookup


@pytest.mark.gpu
def test_gpu_lookahead_pipeline_matches_simulator_and_never_syncs(mover):
    """A Zipf trace over a 1M-row table, 4096 slots, window 4, depth 2: counters and slots equal the
    simulator's, and add_upcoming / prefetch / mark_dirty / unlock never wait for the device."""
    from tiered_tbe.cache.tiers import allocate
    from tiered_tbe.specs import Placement

    num_rows, dim, window, depth = 1 << 20, 16, 4, 2
    weights = allocate(Placement.HOST, num_rows * dim, torch.float32, "cuda").tensor.view(num_rows, dim)
    weights.normal_()
    table = CachedTable(0, num_rows, dim, weights, None)
    cache = SlotCache([table], num_slots=4096, associativity=32, policy="lookahead", device="cuda", mover=mover)
    simulator = CacheSimulator(4096, 32, "lookahead", row_bytes=dim * 4, lookahead_window=window,
                               pipeline_depth=depth)
    rng = np.random.default_rng(0)
    batches = [(rng.zipf(1.1, 20000) - 1) % num_rows for _ in range(24)]
    in_flight = []
    for j, batch in enumerate(batches):
        # Each batch is recorded once, at the step of its prefetch, when it enters the window:
        # batch j + window (the whole first window at j = 0). Copied to the GPU before the checks.
        first_new = j + window if j else 1
        new = {cache.step + 1 + (later - j): torch.from_numpy(batches[later]).cuda()
               for later in range(first_new, min(j + window, len(batches) - 1) + 1)}
        rows = torch.from_numpy(batch).cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step, hint_rows in new.items():
                cache.add_upcoming(hint_rows, step)
            in_flight.append(cache.prefetch(rows))
            if len(in_flight) > depth:
                done = in_flight.pop(0)
                cache.mark_dirty(done)
                cache.unlock(done)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        known = batches[j : j + 1 + window]
        simulator.run(np.concatenate(known), np.concatenate([[0], np.cumsum([b.size for b in known])]), 1)
    assert cache.stats() == simulator.stats
    assert_same_state(cache, simulator)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rows_for_hint_gives_each_distinct_row_once_then_padding(backend):
    from tiered_tbe import CacheConfig, Placement, TableSpec, TieredEmbeddingBags
    from tiered_tbe.base.graphs import padded_size
    from tiered_tbe.base.sorting import INT64_MAX

    cached = Placement.HOST_CACHED
    tables = [TableSpec(50, 4, placement=cached), TableSpec(1, 4), TableSpec(30, 4, placement=cached)]
    module = TieredEmbeddingBags(tables, cache=CacheConfig(slots=16, policy="lookahead", associativity=4),
                                 device="cpu", backend=backend)
    # B = 3 bags per table; repeats within a bag and across bags, an empty bag, a one-row table
    # (index 29 there is out of range: clamped to its row 0, global row 50).
    indices = torch.tensor([7, 7, 3, 49, 3, 0, 0, 29, 29, 5, 0])
    offsets = torch.tensor([0, 2, 4, 5, 7, 7, 8, 9, 10, 11])
    rows, count = module.rows_for_hint(indices, offsets)
    expected = sorted({7, 3, 49, 50, 50 + 1 + 29, 50 + 1 + 5, 50 + 1 + 0})
    assert int(count) == len(expected) and rows.shape == (padded_size(indices.numel()),)
    assert rows[: len(expected)].tolist() == expected
    assert (rows[len(expected):] == INT64_MAX).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rows_for_hint_of_batches_changing_size_every_step_equal_a_set_of_their_rows(backend):
    """Hints are padded to a few shapes (batch size and bag lengths drawn anew each step): each batch's
    distinct rows, as a plain set of its lookups' global rows names them, then only padding."""
    from tiered_tbe import CacheConfig, Placement, TableSpec, TieredEmbeddingBags
    from tiered_tbe.base.graphs import padded_size
    from tiered_tbe.base.sorting import INT64_MAX

    generator = torch.Generator().manual_seed(7)
    table_rows = [97, 1, 40, 13]
    tables = [TableSpec(n, 3, placement=Placement.HOST_CACHED) for n in table_rows]
    module = TieredEmbeddingBags(tables, cache=CacheConfig(slots=32, policy="lookahead", associativity=4),
                                 device="cpu", backend=backend)
    starts = [sum(table_rows[:t]) for t in range(len(table_rows))]
    for step in range(6):
        batch_size = int(torch.randint(1, 9, (), generator=generator))
        lengths = torch.randint(0, 7, (len(tables) * batch_size,), generator=generator)
        lengths[0] = 0  # an empty bag every step
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        indices = torch.cat([torch.randint(0, n, (int(lengths[t * batch_size:(t + 1) * batch_size].sum()),),
                                           generator=generator) for t, n in enumerate(table_rows)])
        expected = sorted({starts[t] + int(i) for t in range(len(tables))
                           for i in indices[int(offsets[t * batch_size]):int(offsets[(t + 1) * batch_size])]})
        rows, count = module.rows_for_hint(indices, offsets)
        assert rows.shape == (padded_size(indices.numel()),), step
        assert int(count) == len(expected) and rows[: len(expected)].tolist() == expected, step
        assert (rows[len(expected):] == INT64_MAX).all(), step


def test_hint_upcoming_records_each_batch_once_up_to_max_lookahead():
    from tiered_tbe import CacheConfig, Placement, TableSpec, TieredEmbeddingBags

    module = TieredEmbeddingBags([TableSpec(50, 4, placement=Placement.HOST_CACHED)],
                                 cache=CacheConfig(slots=16, policy="lookahead", associativity=4), device="cpu",
                                 backend="torch")
    cache = module.cache
    module.hint_upcoming([rows_tensor([1]), rows_tensor([2]), rows_tensor([3, 4])])  # steps 2, 3, 4
    assert cache.upcoming_steps == [2, 3, 4]
    bits = cache.window_bits.clone()
    module.hint_upcoming([rows_tensor([7]), rows_tensor([8])])  # steps 2 and 3 again: skipped
    assert torch.equal(cache.window_bits, bits)
    cache.unlock(cache.prefetch(rows_tensor([1, 9])))  # step 1
    module.hint_upcoming([rows_tensor([2]), rows_tensor([3, 4]), rows_tensor([5])])  # only step 5 is new
    assert cache.upcoming_steps == [3, 4, 5]
    # Step 2 (row 1) left the window; steps 3 and 4 kept their first rows, not the ones passed now.
    assert words_of(cache, [1, 2, 3, 5, 7]) == [0, bit(3), bit(4), bit(5), 0]
    with pytest.raises(ValueError, match=f"at most MAX_LOOKAHEAD = {MAX_LOOKAHEAD}"):
        module.hint_upcoming([rows_tensor([1])] * (MAX_LOOKAHEAD + 1))
    assert cache.upcoming_steps == [3, 4, 5]
    module.hint_upcoming([rows_tensor([d]) for d in range(MAX_LOOKAHEAD)])  # the longest window
    assert cache.upcoming_steps == list(range(3, 2 + MAX_LOOKAHEAD + 1))


@pytest.mark.gpu
def test_a_lookahead_pipeline_allocates_no_pinned_host_memory_in_the_steady_state():
    """Each batch entering the window has its distinct rows made on the device and recorded padded: no
    count is copied to the host. Pinned scalars for such copies had come from the pinned allocator,
    which allocated anew every few steps while the host ran ahead of the device."""
    from tiered_tbe import SGD, CacheConfig, Placement, PrefetchPipeline, TableSpec, TieredEmbeddingBags

    cached = Placement.MANAGED_CACHED
    module = TieredEmbeddingBags([TableSpec(5000, 8, placement=cached), TableSpec(300, 4, placement=cached)],
                                 optimizer=SGD(lr=0.1), device="cuda",
                                 cache=CacheConfig(slots=256, associativity=32, policy="lookahead-admit"))
    generator = torch.Generator("cuda").manual_seed(0)
    batch_size, bag = 64, 3
    batches = [(torch.randint(0, 300, (2 * batch_size * bag,), device="cuda", generator=generator),
                torch.arange(0, 2 * batch_size * bag + 1, bag, device="cuda")) for _ in range(80)]
    allocations = []
    for step, (indices, offsets) in enumerate(PrefetchPipeline(module, batches, depth=2, lookahead=16)):
        module(indices, offsets).sum().backward()
        if step in (30, 79):
            torch.cuda.synchronize()
            allocations.append(torch.cuda.host_memory_stats()["num_host_alloc"])
    assert allocations[0] == allocations[1]
    assert module.cache.num_locked() == 0
