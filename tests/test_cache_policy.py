"""The policy functions of tiered_tbe.cache.policy, as plain Python and as njit-compiled code."""

import numpy as np
import pytest

from tiered_tbe.cache import policy
from tiered_tbe.cache.policy import (
    EMPTY,
    NEXT_USE_UNKNOWN,
    NO_SLOT,
    POLICIES,
    POLICY_LFU,
    POLICY_LFU_ADMIT,
    POLICY_LOOKAHEAD,
    POLICY_LOOKAHEAD_ADMIT,
    POLICY_LRU,
)

CHOOSE_VICTIM = {"python": policy.choose_victim, "njit": policy.choose_victim_cpu}


def _set_state(tags, last_use=None, use_count=None, locks=None, next_use=None):
    """Per-slot arrays of one set (first_slot 0), defaults: unused, unlocked, next use unknown."""
    ways = len(tags)
    return dict(
        tags=np.array(tags, dtype=np.int64),
        last_use=np.array(last_use if last_use is not None else [0] * ways, dtype=np.int64),
        use_count=np.array(use_count if use_count is not None else [0] * ways, dtype=np.int32),
        next_use=np.array(next_use if next_use is not None else [NEXT_USE_UNKNOWN] * ways, dtype=np.int64),
        locks=np.array(locks if locks is not None else [0] * ways, dtype=np.int32),
    )


def _victim(implementation, policy_code, state, first_slot=0, associativity=None):
    ways = associativity if associativity is not None else state["tags"].size
    return int(CHOOSE_VICTIM[implementation](policy_code, state["tags"], state["last_use"], state["use_count"],
                                             state["next_use"], state["locks"], first_slot, ways))


def test_mix64_is_splitmix64():
    # First outputs of splitmix64 seeded with 0 (the reference generator adds the gamma first).
    assert int(policy.mix64_cpu(0)) == 0xE220A8397B1DCDAF
    assert int(policy.mix64_cpu(0x9E3779B97F4A7C15 - (1 << 64))) == 0x6E789E6AA1B965F4  # seed gamma, as int64
    with np.errstate(over="ignore"):
        assert int(policy.mix64(0)) == 0xE220A8397B1DCDAF


def test_set_of_row_range_agreement_and_spread():
    rows = np.arange(0, 65536, dtype=np.int64) * 3 + (1 << 40)  # strided ids far from 0
    num_sets = 61
    sets = np.array([policy.set_of_row_cpu(r, num_sets) for r in rows])
    assert sets.min() >= 0 and sets.max() < num_sets
    with np.errstate(over="ignore"):
        assert [int(policy.set_of_row(r, num_sets)) for r in rows[:200]] == sets[:200].tolist()
    # Modulo alone would map this stride onto the sets in lockstep; the mix spreads them evenly.
    counts = np.bincount(sets, minlength=num_sets)
    expected = rows.size / num_sets
    assert np.abs(counts - expected).max() < 0.15 * expected
    # Consecutive rows land in unrelated sets (a modulo would give runs of +1).
    consecutive = np.array([policy.set_of_row_cpu(r, 1024) for r in range(1000)])
    assert np.mean(np.diff(consecutive) == 1) < 0.01


def test_policy_code_names():
    assert policy.policy_code("lru") == POLICY_LRU
    assert policy.policy_code("lfu") == POLICY_LFU
    assert policy.policy_code("lookahead") == POLICY_LOOKAHEAD
    with pytest.raises(ValueError, match="policy must be one of"):
        policy.policy_code("fifo")


@pytest.mark.parametrize("implementation", sorted(CHOOSE_VICTIM))
@pytest.mark.parametrize("code", [POLICY_LRU, POLICY_LFU, POLICY_LOOKAHEAD])
def test_empty_ways_first_lowest_and_locked_never(implementation, code):
    state = _set_state([5, EMPTY, 7, EMPTY], last_use=[1, 0, 2, 0])
    assert _victim(implementation, code, state) == 1
    state["locks"][:] = [1, 0, 1, 0]  # empty ways hold no locks; the lowest empty one still wins
    assert _victim(implementation, code, state) == 1
    full = _set_state([5, 6, 7, 8], last_use=[1, 2, 3, 4], use_count=[1, 1, 1, 1], locks=[1, 1, 0, 1])
    assert _victim(implementation, code, full) == 2  # the only unlocked way, whatever its rank
    full["locks"][2] = 3
    assert _victim(implementation, code, full) == NO_SLOT


@pytest.mark.parametrize("implementation", sorted(CHOOSE_VICTIM))
def test_lru_evicts_least_recent_lowest_way_on_tie(implementation):
    state = _set_state([10, 11, 12, 13], last_use=[7, 3, 5, 3], use_count=[1, 9, 1, 1])
    assert _victim(implementation, POLICY_LRU, state) == 1  # last_use 3 at ways 1 and 3: way 1
    state["locks"][1] = 1
    assert _victim(implementation, POLICY_LRU, state) == 3
    # A set in the middle of the cache: slots are first_slot + way.
    wide = _set_state([1, 2, 3, 4, 20, 21, 22, 23], last_use=[0, 0, 0, 0, 9, 8, 9, 8])
    assert _victim(implementation, POLICY_LRU, wide, first_slot=4, associativity=4) == 5


@pytest.mark.parametrize("implementation", sorted(CHOOSE_VICTIM))
def test_lfu_evicts_least_used_then_least_recent_then_lowest_way(implementation):
    state = _set_state([10, 11, 12, 13], last_use=[1, 9, 8, 9], use_count=[5, 2, 2, 2])
    assert _victim(implementation, POLICY_LFU, state) == 2  # count 2 at ways 1-3, way 2 oldest
    state["last_use"][2] = 9
    assert _victim(implementation, POLICY_LFU, state) == 1  # counts and last uses tied: lowest way
    state["use_count"][0] = 0
    state["last_use"][0] = 10
    assert _victim(implementation, POLICY_LFU, state) == 0  # least used wins, though the most recent


@pytest.mark.parametrize("implementation", sorted(CHOOSE_VICTIM))
def test_lookahead_evicts_unneeded_first_then_needed_latest(implementation):
    unknown = NEXT_USE_UNKNOWN
    state = _set_state([10, 11, 12, 13], last_use=[4, 1, 2, 3], next_use=[20, 30, unknown, unknown])
    assert _victim(implementation, POLICY_LOOKAHEAD, state) == 2  # unneeded rows, least recent first
    state["next_use"][2:] = [25, 21]
    assert _victim(implementation, POLICY_LOOKAHEAD, state) == 1  # every row needed: the latest
    state["next_use"][:] = unknown
    assert _victim(implementation, POLICY_LOOKAHEAD, state) == _victim(implementation, POLICY_LRU, state) == 1


def test_compiled_policy_tests_agree_with_the_registry():
    """What the kernels and the simulator branch on (a policy code) says what the registry says."""
    for entry in POLICIES.values():
        for counts_rows, reads_window in ((policy.counts_rows, policy.reads_window),
                                          (policy.counts_rows_cpu, policy.reads_window_cpu)):
            assert bool(counts_rows(entry.code)) == entry.counts_rows, entry.name
            assert bool(reads_window(entry.code)) == entry.reads_window, entry.name
    assert [name for name, entry in POLICIES.items() if policy.admits_by_next_use_cpu(entry.code)] == \
        ["lookahead-admit"]
    # A policy refuses misses when it admits by use counts or by next use.
    assert all(entry.refuses_misses == bool(policy.counts_rows(entry.code) or policy.admits_by_next_use(entry.code))
               for entry in POLICIES.values())


ADMITS = {"python": policy.admits, "njit": policy.admits_cpu}


@pytest.mark.parametrize("implementation", sorted(ADMITS))
def test_lookahead_admit_takes_a_way_only_for_a_row_needed_sooner(implementation):
    """An empty way always; a full one only when the miss is needed strictly before the way's row (an unknown
    next use comes after every known one, and ties refuse); the other policies admit as before."""
    admits = ADMITS[implementation]
    unknown = NEXT_USE_UNKNOWN
    state = _set_state([EMPTY, 11, 12, 13], use_count=[0, 3, 3, 3], next_use=[unknown, 9, unknown, 12])
    row_uses = np.array([0, 3, 5, 1], dtype=np.int16)

    def admitted(code, slot, miss_next_use, row=2):
        return bool(admits(code, row, row_uses, slot, state["tags"], state["use_count"], state["next_use"],
                           np.int64(miss_next_use)))

    assert admitted(POLICY_LOOKAHEAD_ADMIT, 0, unknown)  # an empty way
    assert admitted(POLICY_LOOKAHEAD_ADMIT, 1, 8) and not admitted(POLICY_LOOKAHEAD_ADMIT, 1, 9)
    assert not admitted(POLICY_LOOKAHEAD_ADMIT, 1, unknown)
    assert admitted(POLICY_LOOKAHEAD_ADMIT, 2, 100) and not admitted(POLICY_LOOKAHEAD_ADMIT, 2, unknown)
    assert all(admitted(code, slot, unknown)
               for code in (POLICY_LRU, POLICY_LFU, POLICY_LOOKAHEAD) for slot in range(4))
    assert admitted(POLICY_LFU_ADMIT, 1, unknown, row=2) and not admitted(POLICY_LFU_ADMIT, 1, unknown, row=3)


def test_touch_on_hit_and_fill():
    last_use = np.zeros(3, dtype=np.int64)
    use_count = np.array([0, 4, 0], dtype=np.int32)
    policy.touch_on_hit_cpu(1, 9, last_use, use_count)
    assert last_use.tolist() == [0, 9, 0] and use_count.tolist() == [0, 5, 0]
    policy.touch_on_fill_cpu(1, 10, last_use, use_count)
    assert last_use.tolist() == [0, 10, 0] and use_count.tolist() == [0, 1, 0]


@pytest.mark.parametrize("code", [POLICY_LRU, POLICY_LFU, POLICY_LOOKAHEAD])
@pytest.mark.parametrize("ways", [1, 7, 32, 64])
def test_ranking_by_victim_order_repeats_choose_victim(code, ways):
    """The GPU kernels give a set's k-th asking miss its k-th unlocked way in the order of
    victim_order (rank: how many unlocked ways come before it, by comes_before). On fresh random sets (locked,
    empty, tied keys, another set around it) that is the way choose_victim gives miss after miss,
    each fill locking its way, until every way is locked."""
    rng = np.random.default_rng(1000 * code + ways)
    for _ in range(30):
        first_slot = int(rng.integers(0, 3)) * ways
        size = first_slot + 2 * ways
        state = _set_state(
            tags=np.where(rng.random(size) < 0.2, EMPTY, rng.integers(0, 10**6, size)),
            last_use=rng.integers(0, 4, size), use_count=rng.integers(0, 4, size),
            locks=np.where(rng.random(size) < 0.3, rng.integers(1, 3, size), 0),
            next_use=np.where(rng.random(size) < 0.5, NEXT_USE_UNKNOWN, rng.integers(5, 9, size)),
        )
        slots = range(first_slot, first_slot + ways)
        unlocked = [s for s in slots if state["locks"][s] == 0]
        args = (state["tags"], state["last_use"], state["use_count"], state["next_use"])
        order = {s: tuple(policy.victim_order_cpu(code, s, *args)) for s in unlocked}
        rank = {s: sum(bool(policy.comes_before_cpu(*order[o], o, *order[s], s)) for o in unlocked if o != s)
                for s in unlocked}
        assert sorted(rank.values()) == list(range(len(unlocked)))  # a strict order
        by_rank = sorted(unlocked, key=rank.get)
        chosen = []
        while (slot := _victim("njit", code, state, first_slot, ways)) != NO_SLOT:
            chosen.append(slot)
            state["locks"][slot] += 1  # the fill locks it (its tag changes too; nothing reads it again)
            state["tags"][slot] = 10**7 + len(chosen)
        assert chosen == by_rank


def test_gpu_cache_takes_at_most_max_ways(device):
    """The policy kernels rank a set's ways with a warp, two ways a thread at most: more than
    MAX_WAYS ways is refused, naming the limit; MAX_WAYS itself is a cache."""
    import torch

    from tiered_tbe.cache.policy import MAX_WAYS
    from tiered_tbe.cache.slot_cache import CachedTable, SlotCache

    table = CachedTable(0, 200, 4, torch.zeros(200, 4, device=device))
    with pytest.raises(ValueError, match=f"at most {MAX_WAYS} ways"):
        SlotCache([table], num_slots=2 * (MAX_WAYS + 1), associativity=MAX_WAYS + 1, device=device)
    assert SlotCache([table], num_slots=MAX_WAYS, associativity=MAX_WAYS, device=device).num_sets == 1
