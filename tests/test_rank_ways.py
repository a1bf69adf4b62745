"""The kernels that rank a set's unlocked ways for its asking misses (``rank_few_ways_kernel``, a thread a set
asking for few, and ``rank_ways_kernel``, a warp a set asking for more; cache/policy_kernels.py) against a
plain-Python reference of the order of victims (``policy.victim_order``, then the way): touched sets with and
without asking misses, locked ways, ties, and the positions past the sets."""

import numpy as np
import pytest
import torch

from tiered_tbe.cache.launch import DEVICE_CALL_THREADS, KernelLauncher
from tiered_tbe.cache.policy import EMPTY, MAX_WAYS, POLICY_CODES, victim_order_cpu
from tiered_tbe.cache.policy_kernels import LANES, rank_few_ways_kernel, rank_ways_kernel


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


@pytest.mark.parametrize("policy", list(POLICY_CODES))
@pytest.mark.parametrize("associativity", [4, MAX_WAYS])
@pytest.mark.parametrize("split", ["warps", "both", "threads"])
def test_rank_kernels_give_the_reference_ranks(policy, associativity, split, device):
    """On the device of the run (the CUDA simulator here, the GPU there): the warps' kernel one block of two
    warps and the threads' one block of DEVICE_CALL_THREADS, so each warp or thread ranks more than one set (the
    grid-stride loops). ``few_asks`` splits the sets between the kernels: 0, the warps rank every set;
    MAX_WAYS, the threads; the median set's asking misses, each ranks some."""
    generator = torch.Generator().manual_seed(associativity + POLICY_CODES[policy])
    num_sets = 9
    touched = [0, 2, 3, 5, 6, 8]  # 6 of the 9 sets, then the positions past them
    inputs, state = _batch(generator, num_sets, associativity, touched, most_asking=associativity // 2 + 3)
    code = POLICY_CODES[policy]
    expected = _reference(inputs, state, associativity, code)
    asking = sorted(_asking_of_touched_sets(inputs))
    few_asks = {"warps": 0, "both": asking[len(asking) // 2], "threads": MAX_WAYS}[split]
    on_device = {name: value.to(device) for name, value in state.items()}
    way_of_rank = torch.full((num_sets * associativity,), -1, dtype=torch.int8, device=device)  # as assign_slots
    arguments = (*(t.to(device) for t in inputs), associativity, few_asks, code, on_device["tags"],
                 on_device["last_use"], on_device["use_count"], on_device["next_use"], on_device["locks"], way_of_rank)
    launcher = KernelLauncher(device)
    launcher.launch_configured(rank_few_ways_kernel, 1, DEVICE_CALL_THREADS, *arguments)  # one ranks several sets
    launcher.launch_configured(rank_ways_kernel, 1, 2 * LANES, *arguments)
    assert torch.equal(way_of_rank.cpu(), expected)
    assert (expected >= 0).any() and (expected < 0).any()  # some ranks given, some left past the unlocked ways
    if split == "both":  # each kernel had sets to rank
        assert any(0 < a <= few_asks for a in asking) and any(a > few_asks for a in asking)


def _asking_of_touched_sets(inputs):
    """The asking misses of each touched set (as the kernels count them)."""
    set_start, _, needs_number = (t.tolist() for t in inputs)
    n = len(needs_number)
    begins = [b for b in set_start if b < n] + [n]
    return [needs_number[end - 1] - (needs_number[begin - 1] if begin > 0 else 0)
            for begin, end in zip(begins, begins[1:])]
