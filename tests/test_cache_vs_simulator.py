"""SlotCache against the CPU simulator: the same trace and policy give equal counters and equal slots
after every batch, with rows exact, on every tier (the gpu tests) and with every row mover."""


import numpy as np
import pytest
import torch
from cache_helpers import (
    DEVICE,
    ROW_BYTES,
    TABLE_A,
    TABLE_B,
    TrainingCheck,
    assert_same_state,
    initial_rows,
    is_cached_row,
    make_tables,
    make_trace,
    prefetch,
)

from tiered_tbe.cache import CachedTable, CacheSimulator, SlotCache, policy_kernels
from tiered_tbe.cache.policy import POLICIES

# The policies that rank without the lookahead window (the window's policies agree with the simulator
# in tests/test_lookahead.py, where the cache is told the window).
UNHINTED = [name for name, policy in POLICIES.items() if not policy.reads_window]


@pytest.mark.parametrize("few_asks", [0, 1, policy_kernels.FEW_ASKS])
@pytest.mark.parametrize("policy", UNHINTED)
def test_agrees_with_simulator_hit_for_hit(policy, few_asks, mover, monkeypatch):
    """Same trace, same policy: equal counters after every batch, equal slots, exact rows; whichever rank
    kernel ranks the sets (``few_asks``: 0, a warp every set; else a thread each set asking for at most that)."""
    monkeypatch.setattr(policy_kernels, "FEW_ASKS", few_asks)
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
    """The agreement test would not notice a policy argument that is ignored; this trace tells every
    policy ranked without hints from every other."""
    def run(policy):
        simulator = CacheSimulator(16, 4, policy, lfu_decay_interval=4)
        for batch in make_trace():
            cached = batch[is_cached_row(batch)]
            simulator.run(cached, np.array([0, cached.size]))
        return simulator.stats

    stats = {policy: run(policy) for policy in UNHINTED}
    assert len({repr(s) for s in stats.values()}) == len(stats) >= 2, stats


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["device", "host", "managed"])
@pytest.mark.parametrize("policy", UNHINTED)
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
@pytest.mark.parametrize("few_asks", [0, policy_kernels.FEW_ASKS])
def test_gpu_large_trace_matches_simulator_and_never_syncs(few_asks, mover, monkeypatch):
    """A Zipf trace over a 1M-row table in pinned host memory, a 4096-slot cache: counters and
    slots equal the simulator's, and prefetch / mark_dirty / unlock / lookup never wait for the
    device (the staged mover's threads do, off this thread); with either split of the rank kernels."""
    monkeypatch.setattr(policy_kernels, "FEW_ASKS", few_asks)
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


@pytest.mark.parametrize("policy, refused", [("lfu-admit", 3), ("lfu", 0)])
def test_lfu_admit_reads_a_row_in_place_until_it_is_used_more_than_its_victim(policy, refused, mover):
    """One set of two ways whose rows three batches named: lfu-admit reads a new row in place (slot -1,
    its update in the backing store) for three batches, and lets it in at the fourth, when it has been
    named more often than the least used row; LFU takes a slot at once. The simulator agrees."""
    cache = SlotCache(make_tables(), num_slots=2, associativity=2, policy=policy, mover=mover)
    simulator = CacheSimulator(2, 2, policy, row_bytes=ROW_BYTES)
    check = TrainingCheck(cache)
    trace = [np.array([3, 17, 3])] * 3 + [np.array([42, 42])] * 4
    slots_of_new_row = []
    for batch in trace:
        check.step(batch)
        simulator.run(batch, np.array([0, batch.size]))
        assert cache.stats() == simulator.stats
        assert_same_state(cache, simulator)
        slots_of_new_row.append(int(cache.lookup(torch.tensor([42], device=DEVICE))[0]))
    first_slotted = 3 + refused  # batches 3.. name the new row
    assert slots_of_new_row[:first_slotted] == [-1] * first_slotted and min(slots_of_new_row[first_slotted:]) >= 0
    assert cache.stats().misses_no_slot == refused and cache.stats().evictions == 1
    assert cache.stats().misses_set_full == 0  # refused: the set had a way for it
    check.check_backing_after_flush()


@pytest.mark.parametrize("policy, no_slot", [("lfu-admit", 3), ("lru", 1)])
def test_a_miss_ranked_past_its_sets_unlocked_ways_finds_it_full_whether_or_not_those_before_were_admitted(
        policy, no_slot, mover):
    """One set of two ways holding two rows three batches named, then a batch of three new rows: lfu-admit
    refuses the first two (named once, their victims three times) and the third finds no way left for it;
    LRU fills two ways and the third finds the set full. Both count one miss in ``misses_set_full``, and
    the simulator counts the same."""
    cache = SlotCache(make_tables(), num_slots=2, associativity=2, policy=policy, mover=mover)
    simulator = CacheSimulator(2, 2, policy, row_bytes=ROW_BYTES)
    check = TrainingCheck(cache)
    for batch in [np.array([3, 17])] * 3 + [np.array([40, 41, 42])]:
        check.step(batch)
        simulator.run(batch, np.array([0, batch.size]))
        assert cache.stats() == simulator.stats
        assert_same_state(cache, simulator)
    assert (cache.stats().misses_no_slot, cache.stats().misses_set_full) == (no_slot, 1)
    check.check_backing_after_flush()
