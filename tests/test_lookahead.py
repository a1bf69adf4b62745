"""The lookahead policy and pipelined locking: SlotCache.set_next_use, the simulator's window and
pipeline depth against the cache, Belady's rule within the window, and what lookahead saves.

The SlotCache tests run the Numba kernels in the CUDA simulator (tiny caches, short traces);
the simulator-only tests use larger Zipf traces.
"""

import numpy as np
import pytest
import torch
from test_cache import (
    DEVICE,
    ROW_BYTES,
    initial_rows,
    is_cached_row,
    make_tables,
    make_trace,
    rows_of_set,
    rows_tensor,
)

from tiered_tbe.cache import CachedTable, CacheSimulator, SlotCache, simulate
from tiered_tbe.cache.bounds import belady
from tiered_tbe.cache.policy import NEXT_USE_UNKNOWN
from tiered_tbe.traces import zipf_trace


def window_hint(batches, j, window, step_before):
    """What the pipeline passes to set_next_use before prefetching batch ``j``: the rows of batches
    ``j+1 .. j+window`` (int64 [M]) and the step of each one's prefetch (int64 [M])."""
    rows, uses_at = [], []
    for later in range(j + 1, min(j + window, len(batches) - 1) + 1):
        rows.append(batches[later])
        uses_at.append(np.full(batches[later].size, step_before + 1 + (later - j), dtype=np.int64))
    if not rows:
        return rows_tensor([]), rows_tensor([])
    return torch.from_numpy(np.concatenate(rows)).to(DEVICE), torch.from_numpy(np.concatenate(uses_at)).to(DEVICE)


class PipelinedDriver:
    """Drives a SlotCache as a prefetch pipeline of depth ``depth`` does, batch by batch.

    Before batch j: the lookahead hint of batches j+1..j+window (lookahead only); then its
    prefetch; then batch j - depth finishes: mark_dirty of its slots (training), unlock.
    """

    def __init__(self, cache: SlotCache, batches, window: int, depth: int, hints: bool = True):
        self.cache, self.batches, self.window, self.depth, self.hints = cache, batches, window, depth, hints
        self.in_flight: list[torch.Tensor] = []

    def hint(self, j: int) -> None:
        """The lookahead hint before batch j's prefetch (nothing for other policies)."""
        if self.hints:
            self.cache.set_next_use(*window_hint(self.batches, j, self.window, self.cache.step))

    def prefetch(self, j: int) -> torch.Tensor:
        """Batch j's prefetch, then batch j - depth finishes."""
        cache = self.cache
        rows = torch.from_numpy(self.batches[j]).to(DEVICE)
        slot_of_index = cache.prefetch(rows)
        hit = slot_of_index >= 0
        assert torch.equal(cache.tags[slot_of_index[hit].long()], rows[hit])
        self.in_flight.append(slot_of_index)
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
        slot_of_index = self.in_flight.pop(0)
        self.cache.mark_dirty(slot_of_index)
        self.cache.unlock(slot_of_index)


def assert_same_state(cache: SlotCache, simulator: CacheSimulator):
    for name in ("tags", "last_use", "use_count", "dirty", "locks"):
        np.testing.assert_array_equal(getattr(cache, name).cpu().numpy(), getattr(simulator, name), err_msg=name)


def test_set_next_use_takes_the_soonest_use_of_each_cached_row():
    cache = SlotCache(make_tables(), num_slots=16, associativity=4, policy="lookahead")
    cache.unlock(cache.prefetch(rows_tensor([3, 17, 42, 260, 301])))
    slot = {int(row): s for s, row in enumerate(cache.tags.tolist()) if row >= 0}
    cache.next_use[:] = 99  # stale hints are dropped
    # Row 17 at steps 5 and 3 (3 wins); row 260 at 4; row 42 twice at 6; uncached rows (1, 210,
    # 10**12, -1) change nothing; rows 3 and 301 are not named.
    hint = rows_tensor([17, 1, 260, 42, 210, 17, 42, 10**12, -1]), rows_tensor([5, 2, 4, 6, 2, 3, 6, 2, 2])
    want = torch.full((16,), NEXT_USE_UNKNOWN, dtype=torch.int64)
    want[slot[17]], want[slot[260]], want[slot[42]] = 3, 4, 6
    for horizon in (None, 5, 6, 1000):  # int64 keys, then int32 keys of 3, 3 and 10 use bits
        cache.set_next_use(*hint, horizon=horizon)
        assert torch.equal(cache.next_use.cpu(), want), horizon
    cache.set_next_use(*hint, horizon=3)  # uses past step + 3 = 4 count as 4: row 42 gets 4
    want[slot[42]] = 4
    assert torch.equal(cache.next_use.cpu(), want)
    with pytest.raises(ValueError, match="horizon"):
        cache.set_next_use(*hint, horizon=0)
    cache.set_next_use(rows_tensor([]), rows_tensor([]))  # no hint: every next use unknown
    assert (cache.next_use == NEXT_USE_UNKNOWN).all()
    with pytest.raises(TypeError, match="uses_at"):
        cache.set_next_use(rows_tensor([3, 17]), rows_tensor([4]))
    with pytest.raises(TypeError, match="int64"):
        cache.set_next_use(rows_tensor([3], torch.int32), rows_tensor([4]))


@pytest.mark.parametrize("policy, window, depth", [
    ("lookahead", 1, 0), ("lookahead", 3, 0), ("lookahead", 1, 2), ("lookahead", 3, 2),
    ("lru", 0, 2), ("lfu", 0, 2),
])
def test_slot_cache_agrees_with_simulator(policy, window, depth):
    """Same trace, hints and pipeline: equal counters and per-slot state (locks included) after every
    batch, and after the batches still in flight finish."""
    batches = make_trace(num_batches=24, num_sets=8, seed=11)
    cached_batches = [batch[is_cached_row(batch)] for batch in batches]
    cache = SlotCache(make_tables(), num_slots=32, associativity=4, policy=policy, lfu_decay_interval=4)
    simulator = CacheSimulator(32, 4, policy, lfu_decay_interval=4, row_bytes=ROW_BYTES, lookahead_window=window,
                               pipeline_depth=depth)
    driver = PipelinedDriver(cache, batches, window, depth, hints=policy == "lookahead")
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
    assert stats.evictions > 10 and stats.write_backs > 0 and stats.unique_hits > 20
    if depth:
        assert stats.misses_no_slot > 0  # the trace fills sets with the locks of batches in flight


def test_lookahead_without_hints_is_lru():
    batches = make_trace(num_batches=16, num_sets=4, seed=2)
    lookahead = SlotCache(make_tables(), num_slots=16, associativity=4, policy="lookahead")
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
    checked). Asserts the cache's next_use equals the window's soonest use, and that no locked
    row is evicted.
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
        assert cache.next_use.tolist() == [soonest.get(row, NEXT_USE_UNKNOWN) for row in tags_before]
        driver.prefetch(j)
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
    violations, checked = eviction_check("lookahead", window=3, depth=depth, seed=depth)
    assert violations == 0 and checked > 20
    lru_violations, _ = eviction_check("lru", window=3, depth=depth, seed=depth)
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
def test_gpu_lookahead_pipeline_matches_simulator_and_never_syncs():
    """A Zipf trace over a 1M-row table, 4096 slots, window 4, depth 2: counters and slots equal the
    simulator's, and set_next_use / prefetch / mark_dirty / unlock never wait for the device."""
    num_rows, dim, window, depth = 1 << 20, 16, 4, 2
    table = CachedTable(0, num_rows, dim, torch.randn(num_rows, dim, device="cuda"), None)
    cache = SlotCache([table], num_slots=4096, associativity=32, policy="lookahead", device="cuda")
    simulator = CacheSimulator(4096, 32, "lookahead", row_bytes=dim * 4, lookahead_window=window,
                               pipeline_depth=depth)
    rng = np.random.default_rng(0)
    batches = [(rng.zipf(1.1, 20000) - 1) % num_rows for _ in range(24)]
    in_flight = []
    for j, batch in enumerate(batches):
        later = batches[j + 1 : j + 1 + window]
        hint_rows = torch.from_numpy(np.concatenate(later) if later else np.zeros(0, np.int64)).cuda()
        uses_at = torch.from_numpy(np.concatenate([np.full(b.size, cache.step + 2 + d) for d, b in enumerate(later)])
                                   if later else np.zeros(0, np.int64)).cuda()
        rows = torch.from_numpy(batch).cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            cache.set_next_use(hint_rows, uses_at)
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


def test_rows_for_hint_gives_each_distinct_row_once_then_padding():
    from tiered_tbe import CacheConfig, Placement, TableSpec, TieredEmbeddingBags
    from tiered_tbe._sorting import INT64_MAX
    from tiered_tbe.pipeline import _HintRows

    cached = Placement.HOST_CACHED
    tables = [TableSpec(50, 4, placement=cached), TableSpec(1, 4), TableSpec(30, 4, placement=cached)]
    module = TieredEmbeddingBags(tables, cache=CacheConfig(slots=16, policy="lookahead", associativity=4),
                                 device="cpu", backend="torch")
    # B = 3 bags per table; repeats within a bag and across bags, an empty bag, a one-row table
    # (index 29 there is out of range: clamped to its row 0, global row 50).
    indices = torch.tensor([7, 7, 3, 49, 3, 0, 0, 29, 29, 5, 0])
    offsets = torch.tensor([0, 2, 4, 5, 7, 7, 8, 9, 10, 11])
    rows, count = module.rows_for_hint(indices, offsets)
    expected = sorted({7, 3, 49, 50, 50 + 1 + 29, 50 + 1 + 5, 50 + 1 + 0})
    assert int(count) == len(expected) and rows.shape == indices.shape
    assert rows[: len(expected)].tolist() == expected
    assert (rows[len(expected):] == INT64_MAX).all()
    assert _HintRows(rows, count).rows().tolist() == expected  # on the CPU the count is known at once
