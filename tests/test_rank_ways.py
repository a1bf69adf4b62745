"""The two kernels that rank a set's unlocked ways for its asking misses (cache/policy_kernels.py):
``rank_ways_kernel`` (the default) and ``rank_ways_staged_kernel`` (``TIERED_TBE_RANK_WAYS=staged``: the ways'
keys staged in shared memory, a warp a set, barriers between rounds), against a plain-Python reference of the
order of victims (``policy.victim_order``, then the way) on blocks of whole warps as on a GPU (several warps a
block, several blocks, more touched sets than a round covers, and the sets past them), and the staged one
inside a whole cache against the CPU simulator."""

import sys

import numpy as np
import pytest
import torch
from cache_helpers import ROW_BYTES, TrainingCheck, assert_same_state, is_cached_row, make_tables, make_trace

from tiered_tbe.cache import CacheSimulator, SlotCache, policy_kernels
from tiered_tbe.cache.launch import KernelLauncher
from tiered_tbe.cache.policy import EMPTY, MAX_WAYS, POLICIES, POLICY_CODES, victim_order_cpu
from tiered_tbe.cache.policy_kernels import LANES, rank_ways_kernel, rank_ways_staged_kernel


def _batch(generator, num_sets, associativity, touched_sets, most_asking):
    """The rank kernels' inputs for misses in ``touched_sets`` (ascending), and the cache's slot state."""
    sets_of_position, needs = [], []
    for the_set in touched_sets:
        count = int(torch.randint(1, most_asking + 2, (1,), generator=generator))
        sets_of_position += [the_set] * count
        needs += torch.randint(0, 4, (count,), generator=generator).clamp(max=1).tolist()  # 3 in 4 ask
    n = len(sets_of_position)
    starts = [p for p in range(n) if p == 0 or sets_of_position[p] != sets_of_position[p - 1]]
    set_start = torch.tensor(starts + [n] * (n - len(starts)), dtype=torch.int32)
    slots = num_sets * associativity
    small = dict(generator=generator, dtype=torch.int64)
    tags = torch.where(torch.rand(slots, generator=generator) < 0.2, EMPTY, torch.randint(0, 10**6, (slots,), **small))
    state = dict(tags=tags,
                 last_use=torch.randint(0, 4, (slots,), **small),  # few values: ties, broken by the way
                 use_count=torch.randint(0, 3, (slots,), generator=generator, dtype=torch.int32),
                 next_use=torch.randint(-1, 4, (slots,), **small),
                 locks=(torch.rand(slots, generator=generator) < 0.3).to(torch.int32))
    return (set_start, torch.tensor(sets_of_position, dtype=torch.int32),
            torch.cumsum(torch.tensor(needs, dtype=torch.int32), 0, dtype=torch.int32)), state


def _reference(inputs, state, associativity, policy):
    """int8 [S]: at index k of each set asking for m ways, the way of rank k < m among its unlocked ways."""
    set_start, set_of_position, needs_number = (t.tolist() for t in inputs)
    n = len(set_of_position)
    arrays = {name: value.numpy() for name, value in state.items()}
    way_of_rank = np.full(len(arrays["tags"]), -1, dtype=np.int8)
    for touched, begin in enumerate(set_start):
        if begin >= n:
            break
        end = set_start[touched + 1] if touched + 1 < n else n
        asking = needs_number[end - 1] - (needs_number[begin - 1] if begin > 0 else 0)
        first = set_of_position[begin] * associativity
        order = sorted((tuple(int(v) for v in victim_order_cpu(policy, first + way, arrays["tags"],
                                                                arrays["last_use"], arrays["use_count"],
                                                                arrays["next_use"])), way)
                       for way in range(associativity) if arrays["locks"][first + way] == 0)
        for rank, (_, way) in enumerate(order[:asking]):
            way_of_rank[first + rank] = way
    return torch.from_numpy(way_of_rank)


@pytest.fixture
def quick_handoffs():
    """The simulator's threads hand its device-call lock over at every device-function call: let them switch
    quickly while a block of 32 of them runs."""
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(switch)


@pytest.mark.parametrize("policy", list(POLICY_CODES))
@pytest.mark.parametrize("associativity", [4, MAX_WAYS])
def test_both_rank_kernels_give_the_reference_ranks(policy, associativity, quick_handoffs):
    generator = torch.Generator().manual_seed(associativity + POLICY_CODES[policy])
    num_sets = 9
    touched = [0, 2, 3, 5, 6, 8]  # 6 sets: two rounds of 2 blocks of 2 warps, and sets past them
    inputs, state = _batch(generator, num_sets, associativity, touched, most_asking=associativity // 2 + 3)
    code = POLICY_CODES[policy]
    expected = _reference(inputs, state, associativity, code)
    launcher = KernelLauncher(torch.device("cpu"))
    for kernel, grid, block in ((rank_ways_kernel, 1, 2), (rank_ways_staged_kernel, 2, 2 * LANES)):
        way_of_rank = torch.full((num_sets * associativity,), -1, dtype=torch.int8)  # as assign_slots leaves it
        launcher.launch_configured(kernel, grid, block, *inputs, associativity, code, state["tags"],
                                   state["last_use"], state["use_count"], state["next_use"], state["locks"],
                                   way_of_rank)
        assert torch.equal(way_of_rank, expected), kernel.py_func.__name__
    assert (expected >= 0).any() and (expected < 0).any()  # some ranks given, some left past the unlocked ways


@pytest.mark.parametrize("policy", [name for name, policy in POLICIES.items() if not policy.reads_window])
def test_a_cache_ranking_with_the_staged_kernel_agrees_with_the_simulator(policy, monkeypatch, quick_handoffs):
    """The whole prefetch with rank_ways_staged_kernel (a warp a block in the simulator): equal counters and
    slots to the CPU simulator after every batch, rows exact, as tests/test_cache_vs_simulator.py asks of
    the default kernel."""
    monkeypatch.setattr(policy_kernels, "RANK_WAYS", "staged")
    cache = SlotCache(make_tables(), num_slots=16, associativity=4, policy=policy, lfu_decay_interval=4)
    simulator = CacheSimulator(16, 4, policy, lfu_decay_interval=4, row_bytes=ROW_BYTES)
    check = TrainingCheck(cache)
    for batch in make_trace(num_batches=12):
        check.step(batch)
        cached = batch[is_cached_row(batch)]
        simulator.run(cached, np.array([0, cached.size]))
        assert cache.stats() == simulator.stats
        assert_same_state(cache, simulator)
    assert cache.stats().evictions > 5 and cache.stats().misses_no_slot > 0
    check.check_backing_after_flush()


def test_an_unknown_rank_kernel_is_refused_at_import():
    assert policy_kernels.rank_ways_setting("staged") == "staged"
    with pytest.raises(ValueError, match="TIERED_TBE_RANK_WAYS must be 'staged' or 'loads', got 'fastest'"):
        policy_kernels.rank_ways_setting("fastest")
