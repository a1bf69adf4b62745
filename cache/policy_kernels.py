"""The policy's Numba CUDA kernels: what each unique row of a prefetch gets (a hit, a filled slot and
its victim, or no slot). Host code: ``SlotCache._assign`` (:mod:`tiered_tbe.cache.slot_cache`); the
policy itself (the order of victims, the touches) is :mod:`tiered_tbe.cache.policy`, which the CPU
simulator runs one miss at a time. Here it runs in six data-parallel passes, none serial per set
(host function: :func:`assign_slots`)::

    find_hits_kernel         a thread per unique row, grouped by set: the hits, locked and
                             touched, and 1 for a miss that will ask its set for a slot (not a
                             row a batch in flight reads in place)
    torch.cumsum             numbers those misses: the k-th of its set asks k-1 before it
    decode_next_use_kernel   lookahead only: a thread per way of each set that will choose a
                             victim: the way's next use, from the window bits
    way_of_rank.fill_(-1)    no rank yet anywhere
    rank_few_ways_kernel     a thread per set asking for at most ``few_asks`` ways: picks them
                             one after another, each the first untaken unlocked way in the
                             order of ``policy.victim_order``
    rank_ways_kernel         a thread per way of each set asking for more: the unlocked ways in
                             that order (a way's rank: how many come before it)
    fill_misses_kernel       a thread per asking miss: the k-th takes the way of rank k, or
                             no slot when its set has fewer unlocked ways (or, lfu-admit, when
                             the way holds a row used at least as often; lookahead-admit, when
                             the way's row is needed no later than the miss)

The ranks are the simulator's choices: a set's misses take slots in ascending row order, each the
first unlocked way in the order, and only the fills (each locks its way) change the set meanwhile,
so the k-th miss takes the k-th way. A thread per set making those choices one after another
took 4.7 ms of a 39 ms step at Zipf 0.6 (H200; 2.6 with the hits a thread per row and bit masks
of the free ways): its loads 32 sets apart across a warp, and as many scans as misses. So a set
asking for many ways is ranked by a warp; one asking for few (``FEW_ASKS``, most sets where most
rows hit) still by a thread, whose few scans cost less than a warp's 32 lanes each counting the
ways before its own.

Thread ``t`` of the per-way kernels takes way ``t % 32`` (and ``t % 32 + 32`` up to
``MAX_WAYS``) of the ``t // 32``-th set the batch touches: a warp is one set, its loads of one
way's state the same address (broadcast) or 32 neighbours. No atomics: each unique row, way and
slot has one writer.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from numba import cuda

from tiered_tbe.cache._kernels import OUTCOME_FILLED, OUTCOME_HIT, OUTCOME_NO_SLOT, OUTCOME_SET_FULL, WINDOW_BITS
from tiered_tbe.cache.batch_kernels import set_starts_of_batch
from tiered_tbe.cache.launch import DEVICE_CALL_THREADS, cached_kernel
from tiered_tbe.cache.policy import (
    EMPTY,
    NEXT_USE_UNKNOWN,
    NO_SLOT,
    admits_by_next_use_device,
    admits_device,
    comes_before_device,
    count_use_device,
    counts_rows_device,
    fill_slot_device,
    find_way_device,
    lock_hit_device,
    victim_order_device,
)

LANES = 32  # threads a set in the per-way kernels (a warp)
# Sets asking for at most this many ways are ranked a thread a set (rank_few_ways_kernel), the rest a warp a set
# (rank_ways_kernel). A warp ranking one set issues as many instructions as a thread per set ranking 32: where
# most sets ask for one or two ways (high hit rates) the warp a set cost the prefetch its time. On an H100
# (c47dc9f) every set a warp took the Criteo prefetch at Zipf 1.2 from 0.98 to 1.11 ms and the ragged lfu-admit
# one from 1.35 to 1.47; thresholds of 1, 2, 8 and 32 ranked within 0.04 ms of 4 (results/measurements.jsonl).
FEW_ASKS = 4


class SlotMetadata(NamedTuple):
    """The slot cache's state as the kernels take it (``KernelLauncher.array`` views): per slot [S]
    ``tags`` int64, ``last_use`` int64, ``use_count`` int32, ``next_use`` int64, ``locks`` int32,
    ``dirty`` uint8; per global row [R] ``bypass_count`` uint8 and ``row_uses`` int16 (a policy that counts
    rows; one element otherwise); and the scratch ``way_of_rank`` int8 [S]."""

    tags: object
    last_use: object
    use_count: object
    next_use: object
    locks: object
    dirty: object
    bypass_count: object
    row_uses: object
    way_of_rank: object


def assign_slots(launcher, unique, set_of_position: torch.Tensor, unique_of_position: torch.Tensor, num_sets: int,
                 associativity: int, step: torch.Tensor, policy: int, slots: SlotMetadata, way_of_rank: torch.Tensor,
                 window_bits=None) -> None:
    """Run the policy over a batch's unique rows: fill ``unique``'s ``slot_of_unique``, ``outcome``,
    ``victim_row`` and ``victim_was_dirty`` (a ``batch_kernels.UniqueRows`` of N entries, initialised),
    and update ``slots``. ``set_of_position`` int32 [N] and ``unique_of_position`` int32 [N]: the unique
    rows sorted by set (stable); ``step`` int64 [1] on the device; ``policy`` a ``POLICY_*`` code;
    ``way_of_rank`` int8 [S]: the tensor behind ``slots.way_of_rank``; ``window_bits`` the lookahead
    window's kernel array when the policy reads it (else None)."""
    n = set_of_position.numel()
    # The batch's count of unique rows, on the device: the per-row kernels stop there instead of walking the
    # padding (~94% of the N positions on the Criteo tables at Zipf 1.2, docs/performance.md).
    num_unique = unique.unique_number[n - 1:]
    needs_slot = torch.empty(n, dtype=torch.int32, device=set_of_position.device)
    launcher.launch(find_hits_kernel, n, unique_of_position, set_of_position, num_unique, unique.unique_rows,
                    associativity, step, policy, slots.tags, slots.last_use, slots.use_count, slots.locks,
                    slots.row_uses, slots.bypass_count, unique.slot_of_unique, unique.outcome, needs_slot)
    set_start, set_number = set_starts_of_batch(launcher, set_of_position, num_sets)
    needs_number = torch.cumsum(needs_slot, 0, dtype=torch.int32)
    # A warp per touched set; few threads in the simulator (launch.DEVICE_CALL_THREADS).
    per_way = launcher.shape_of(min(n, num_sets) * LANES, simulated_threads=DEVICE_CALL_THREADS)
    sets = (set_start, set_of_position, needs_number, associativity)
    if window_bits is not None:
        launcher.launch_configured(decode_next_use_kernel, *per_way, *sets, step, slots.tags, window_bits,
                                   slots.next_use)
    # -1 wherever no rank is written: a rank at or past its set's unlocked ways (no slot for that miss). One
    # memset of S bytes in the graph; counting each set's unlocked ways in every thread of its warp instead cost
    # the rank kernel 0.61 -> 0.79 ms a step on the H200 (mixed dims, bags of 20; results/measurements.jsonl).
    way_of_rank.fill_(-1)
    ranked_state = (policy, slots.tags, slots.last_use, slots.use_count, slots.next_use, slots.locks, slots.way_of_rank)
    if FEW_ASKS > 0:  # a thread per touched set; few in the simulator, as per_way
        per_set = launcher.shape_of(min(n, num_sets), simulated_threads=DEVICE_CALL_THREADS)
        launcher.launch_configured(rank_few_ways_kernel, *per_set, *sets, FEW_ASKS, *ranked_state)
    launcher.launch_configured(rank_ways_kernel, *per_way, *sets, FEW_ASKS, *ranked_state)
    # The misses' own next uses (lookahead-admit) read the window too; without it, a placeholder of its dtype
    # (int64, so one compiled kernel serves both), never read.
    has_window = window_bits is not None
    misses_window = window_bits if has_window else slots.next_use
    launcher.launch(fill_misses_kernel, n, set_start, set_number, set_of_position, unique_of_position, num_unique,
                    needs_slot, needs_number, unique.unique_rows, associativity, step, policy, slots.way_of_rank,
                    slots.tags, slots.last_use, slots.use_count, slots.next_use, slots.dirty, slots.locks,
                    slots.bypass_count, slots.row_uses, misses_window, has_window, unique.slot_of_unique,
                    unique.outcome, unique.victim_row, unique.victim_was_dirty)


@cached_kernel
def find_hits_kernel(
    unique_of_position,  # int32 [N]: the unique row at each position, grouped by set (set_of_position's order)
    set_of_position,  # int32 [N]: the set of each position (ascending; the padding's sorts last)
    num_unique,  # int32 [1]: the batch's count of unique rows: positions from it on are padding
    unique_rows,  # int64 [N]: the batch's unique rows, ascending; NOT_CACHED past the last
    associativity,  # int64: ways per set
    step_of_prefetch,  # int64 [1]: this prefetch's step (a tensor: one CUDA graph serves every step)
    policy,  # int64: POLICY_* code
    tags,  # int64 [S]: row per slot, EMPTY if none
    last_use,  # int64 [S]
    use_count,  # int32 [S]
    locks,  # int32 [S]
    row_uses,  # int16 [R] in/out: per global row, its use count (a policy that counts rows; else unread)
    bypass_count,  # uint8 [R]: per global row, the batches in flight that got no slot for it
    slot_of_unique,  # int32 [N] out (pre-filled with NO_SLOT): the slot of each unique row found cached
    outcome,  # int8 [N] out (pre-filled with OUTCOME_NONE): OUTCOME_HIT where found
    needs_slot,  # int32 [N] out: 1 where the position's row is a miss that asks its set for a slot; 0 elsewhere
):
    """Every hit of the batch, locked before any victim is chosen (the policy's step 2), and, for a
    policy that counts rows, every unique row's use. The rows are distinct, so are their slots.

    A miss asks for a slot unless a batch in flight reads its row in place (a fill would hide that
    batch's update): then it gets none, whatever its set holds. The padding's 0s are written unread (their
    prefix sum is read at the last touched set's end, N). A thread per position, in set order: the
    touched sets' ways are read in ascending addresses."""
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    step = step_of_prefetch[0]
    count = num_unique[0]
    for p in range(start, unique_of_position.shape[0], stride):
        if p >= count:
            needs_slot[p] = 0
            continue
        u = unique_of_position[p]
        row = unique_rows[u]
        if counts_rows_device(policy):
            count_use_device(row, row_uses)
        slot = find_way_device(tags, set_of_position[p] * associativity, associativity, row)
        if slot != NO_SLOT:
            lock_hit_device(policy, slot, row, step, last_use, use_count, row_uses, locks)
            slot_of_unique[u] = slot
            outcome[u] = OUTCOME_HIT
            needs_slot[p] = 0
        else:
            needs_slot[p] = 1 if bypass_count[row] == 0 else 0


@cuda.jit(device=True, inline=True)
def asking_before_set(touched, set_start, needs_number):
    """``(first position, asking misses before it, asking misses in it)`` of the ``touched``-th set
    the batch touches; a first position of N (no such set) when ``touched`` is past them."""
    n = needs_number.shape[0]
    begin = set_start[touched]
    if begin >= n:
        return begin, 0, 0
    end = set_start[touched + 1] if touched + 1 < n else n
    before = needs_number[begin - 1] if begin > 0 else 0
    return begin, before, needs_number[end - 1] - before


@cached_kernel
def decode_next_use_kernel(
    set_start,  # int32 [N]: first position of each set the batch touches, in order, then N
    set_of_position,  # int32 [N]: the set of each position (ascending)
    needs_number,  # int32 [N]: inclusive prefix sum of find_hits_kernel's needs_slot
    associativity,  # int64: ways per set
    step_of_prefetch,  # int64 [1]: this prefetch's step
    tags,  # int64 [S]
    window_bits,  # int64 [R]: per global row, bit s % WINDOW_BITS set when the hinted batch of step s names it
    next_use,  # int64 [S] out: of each way holding a row, in every set that will choose a victim
):
    """Lookahead: a set's ways get their next use just before its first victim choice (its rows are
    then those of before this prefetch, and a slot filled later keeps the value: it is locked, so
    no choice reads it). Sets that choose none keep theirs, as in the simulator."""
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    n = set_start.shape[0]
    step = step_of_prefetch[0]
    for t in range(start, n * LANES, stride):
        begin, _, asking = asking_before_set(t // LANES, set_start, needs_number)
        if begin >= n:
            break  # past the touched sets
        if asking == 0:
            continue
        first_slot = set_of_position[begin] * associativity
        for way in range(t % LANES, associativity, LANES):
            row = tags[first_slot + way]
            if row != EMPTY:
                next_use[first_slot + way] = soonest_hinted_step(window_bits[row], step)


@cached_kernel
def rank_few_ways_kernel(
    set_start,  # int32 [N]: first position of each set the batch touches, in order, then N
    set_of_position,  # int32 [N]: the set of each position (ascending)
    needs_number,  # int32 [N]: inclusive prefix sum of find_hits_kernel's needs_slot
    associativity,  # int64: ways per set (at most MAX_WAYS: the taken ways are the bits of an int64)
    few_asks,  # int64: this kernel ranks the sets asking for 1 to few_asks ways; rank_ways_kernel the others
    policy,  # int64: POLICY_* code
    tags,  # int64 [S]
    last_use,  # int64 [S]
    use_count,  # int32 [S]
    next_use,  # int64 [S]
    locks,  # int32 [S]: the hits of this batch are locked already
    way_of_rank,  # int8 [S] in/out: -1 on entry; as in rank_ways_kernel, for the sets this kernel ranks
):
    """rank_ways_kernel's ranks for the sets asking for few ways, a thread a set: rank k is the first
    unlocked way in the order of victims among those not given ranks 0..k-1 (one pass over the ways a
    rank). The sets of a warp are 32 touched sets, as in the policy kernel before the ranks."""
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    n = set_start.shape[0]
    for t in range(start, n, stride):
        begin, _, asking = asking_before_set(t, set_start, needs_number)
        if begin >= n:
            break
        if asking == 0 or asking > few_asks:
            continue
        first_slot = set_of_position[begin] * associativity
        taken = np.int64(0)  # bit w: way w has a rank
        for rank in range(asking):
            best = -1
            best_group = np.int64(0)
            best_primary = np.int64(0)
            best_secondary = np.int64(0)
            for way in range(associativity):
                slot = first_slot + way
                if (taken >> way) & 1 != 0 or locks[slot] != 0:
                    continue
                group, primary, secondary = victim_order_device(policy, slot, tags, last_use, use_count, next_use)
                if best < 0 or comes_before_device(group, primary, secondary, slot, best_group, best_primary,
                                                   best_secondary, first_slot + best):
                    best, best_group, best_primary, best_secondary = way, group, primary, secondary
            if best < 0:
                break  # fewer unlocked ways than asking misses: the later ranks stay -1
            way_of_rank[first_slot + rank] = best
            taken |= np.int64(1) << best


@cached_kernel
def rank_ways_kernel(
    set_start,  # int32 [N]: first position of each set the batch touches, in order, then N
    set_of_position,  # int32 [N]: the set of each position (ascending)
    needs_number,  # int32 [N]: inclusive prefix sum of find_hits_kernel's needs_slot
    associativity,  # int64: ways per set (at most MAX_WAYS)
    few_asks,  # int64: sets asking for at most this many ways are rank_few_ways_kernel's, skipped here
    policy,  # int64: POLICY_* code
    tags,  # int64 [S]
    last_use,  # int64 [S]
    use_count,  # int32 [S]
    next_use,  # int64 [S]
    locks,  # int32 [S]: the hits of this batch are locked already
    way_of_rank,  # int8 [S] in/out: -1 on entry (assign_slots); in each set that will choose a victim, at
    #               index k below its asking misses: the way of rank k among the unlocked ways
    #               (policy.victim_order); left -1 at ranks past the last unlocked way
):
    """The order in which a set's asking misses take its unlocked ways, in the sets asking for more than
    ``few_asks``. Each thread ranks its way by counting the unlocked ways that come before it, up to the
    set's count of asking misses (only ranks below it are read), and writes its way at its rank (ranks
    are distinct: one writer each)."""
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    n = set_start.shape[0]
    for t in range(start, n * LANES, stride):
        begin, _, asking = asking_before_set(t // LANES, set_start, needs_number)
        if begin >= n:
            break
        if asking <= few_asks:
            continue  # none asked, or rank_few_ways_kernel's
        first_slot = set_of_position[begin] * associativity
        for way in range(t % LANES, associativity, LANES):
            slot = first_slot + way
            if locks[slot] != 0:
                continue
            group, primary, secondary = victim_order_device(policy, slot, tags, last_use, use_count, next_use)
            rank = 0
            for other in range(first_slot, first_slot + associativity):
                if locks[other] != 0 or other == slot:
                    continue
                other_group, other_primary, other_secondary = victim_order_device(
                    policy, other, tags, last_use, use_count, next_use)
                if comes_before_device(other_group, other_primary, other_secondary, other, group, primary,
                                       secondary, slot):
                    rank += 1
                    if rank >= asking:
                        break  # no miss of this batch takes this way: its rank is not needed
            if rank < asking:
                way_of_rank[first_slot + rank] = way


@cached_kernel
def fill_misses_kernel(
    set_start,  # int32 [N]: first position of each set the batch touches, in order, then N
    set_number,  # int32 [N]: 1-based number of each position's set among those touched
    set_of_position,  # int32 [N]: the set of each position (ascending)
    unique_of_position,  # int32 [N]: the unique row at each position
    num_unique,  # int32 [1]: the batch's count of unique rows: positions from it on are padding (not read)
    needs_slot,  # int32 [N]: find_hits_kernel's
    needs_number,  # int32 [N]: its inclusive prefix sum
    unique_rows,  # int64 [N]: the unique rows, NOT_CACHED past the last
    associativity,  # int64: ways per set
    step_of_prefetch,  # int64 [1]: this prefetch's step
    policy,  # int64: POLICY_* code
    way_of_rank,  # int8 [S]: rank_ways_kernel's
    tags,  # int64 [S]
    last_use,  # int64 [S]
    use_count,  # int32 [S]
    next_use,  # int64 [S]: each way's next use, as decode_next_use_kernel left it (a policy that reads the window)
    dirty,  # uint8 [S]
    locks,  # int32 [S]
    bypass_count,  # uint8 [R]: each row given no slot is counted here (see SlotCache)
    row_uses,  # int16 [R]: per global row, its use count with this batch's (a policy that counts rows)
    window_bits,  # int64 [R]: per global row, the lookahead window's bits (if has_window; else a placeholder)
    has_window,  # bool: the cache holds a window (a policy that reads it, after add_upcoming)
    slot_of_unique,  # int32 [N] in/out: the hits' slots; the fills' are written here
    outcome,  # int8 [N] in/out: OUTCOME_HIT; OUTCOME_FILLED, OUTCOME_SET_FULL or OUTCOME_NO_SLOT written for the misses
    victim_row,  # int64 [N] out (pre-filled with EMPTY): the row a fill evicts
    victim_was_dirty,  # uint8 [N] out (pre-filled with 0): 1 when that row must be written back
):
    """The k-th asking miss of a set (ascending rows; a policy that counts rows: most used first; one that
    admits by next use: soonest needed first) takes the way of rank k, if the policy admits it there; one
    past the set's unlocked ways gets no slot, as does every miss that did not ask. Admission refuses a
    suffix of a set's misses (policy.py, "Admission"), so the ways that the admitted ones take are the
    ranks a one-by-one pass gives them."""
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    step = step_of_prefetch[0]
    for p in range(start, num_unique[0], stride):
        u = unique_of_position[p]
        row = unique_rows[u]
        if outcome[u] == OUTCOME_HIT:
            continue
        way = -1
        no_slot = OUTCOME_NO_SLOT  # barred by a batch in flight, or refused by admission
        first_slot = set_of_position[p] * associativity
        if needs_slot[p] != 0:
            begin, before, _ = asking_before_set(set_number[p] - 1, set_start, needs_number)
            miss_next_use = NEXT_USE_UNKNOWN
            if has_window and admits_by_next_use_device(policy):
                miss_next_use = soonest_hinted_step(window_bits[row], step)
            if counts_rows_device(policy):
                rank = asking_misses_used_more(p, begin, set_of_position, unique_of_position, unique_rows, needs_slot,
                                               row_uses)
            elif admits_by_next_use_device(policy):
                rank = asking_misses_needed_sooner(p, begin, miss_next_use, set_of_position, unique_of_position,
                                                   unique_rows, needs_slot, window_bits, has_window, step)
            else:
                rank = needs_number[p] - 1 - before
            if rank < associativity:
                way = way_of_rank[first_slot + rank]
            if way < 0:
                no_slot = OUTCOME_SET_FULL  # ranked past the set's unlocked ways
            elif not admits_device(policy, row, row_uses, first_slot + way, tags, use_count, next_use, miss_next_use):
                way = -1
        if way < 0:
            outcome[u] = no_slot
            bypass_count[row] += 1  # unique rows: one writer each
            continue
        slot = first_slot + way
        evicted = tags[slot]
        if evicted != EMPTY:
            victim_row[u] = evicted
            victim_was_dirty[u] = dirty[slot]
        fill_slot_device(policy, slot, row, step, tags, last_use, use_count, row_uses, dirty, locks)
        slot_of_unique[u] = slot
        outcome[u] = OUTCOME_FILLED


@cuda.jit(device=True, inline=True)
def asking_misses_used_more(p, begin, set_of_position, unique_of_position, unique_rows, needs_slot, row_uses):
    """The rank of position ``p``'s miss among its set's asking misses (which start at position ``begin``) in
    the order of a policy that counts rows: more uses first, then the lower row (the lower position: the
    rows of a set are in ascending order). A set holds few of a batch's rows, so a scan of them is short."""
    uses = row_uses[unique_rows[unique_of_position[p]]]
    the_set = set_of_position[p]
    rank = 0
    q = begin
    while q < set_of_position.shape[0] and set_of_position[q] == the_set:
        if q != p and needs_slot[q] != 0:
            other = row_uses[unique_rows[unique_of_position[q]]]
            if other > uses or (other == uses and q < p):
                rank += 1
        q += 1
    return rank


@cuda.jit(device=True, inline=True)
def asking_misses_needed_sooner(p, begin, next_use_of_p, set_of_position, unique_of_position, unique_rows, needs_slot,
                                window_bits, has_window, step):
    """The rank of position ``p``'s miss (needed at step ``next_use_of_p``) among its set's asking misses (from
    position ``begin``) in the order of a policy that admits by next use: the soonest needed first, then the
    lower row (position). Without a window every next use is unknown: the ascending rows alone."""
    the_set = set_of_position[p]
    rank = 0
    q = begin
    while q < set_of_position.shape[0] and set_of_position[q] == the_set:
        if q != p and needs_slot[q] != 0:
            other = NEXT_USE_UNKNOWN
            if has_window:
                other = soonest_hinted_step(window_bits[unique_rows[unique_of_position[q]]], step)
            if other < next_use_of_p or (other == next_use_of_p and q < p):
                rank += 1
        q += 1
    return rank


@cuda.jit(device=True, inline=True)
def soonest_hinted_step(word, step):
    """The smallest step ``s`` in ``step + 1 .. step + WINDOW_BITS`` whose bit ``s % WINDOW_BITS``
    is set in ``word`` (a row's int64 window bits), or ``NEXT_USE_UNKNOWN`` when none is."""
    if word == 0:
        return NEXT_USE_UNKNOWN  # the common case: no batch of the window names the row
    first_bit = (step + 1) % WINDOW_BITS  # the bit of step + 1
    # Bits first_bit .. 63 are steps step + 1 onwards. The shift is arithmetic: copies of bit 63
    # land above its own new place, never below, so the lowest set bit is still the soonest step.
    from_first = word >> first_bit
    if from_first != 0:
        return step + 1 + _lowest_set_bit(from_first)
    # Only bits 0 .. first_bit - 1 are set: steps past the next multiple of WINDOW_BITS.
    return step + 1 + (WINDOW_BITS - first_bit) + _lowest_set_bit(word)


@cuda.jit(device=True, inline=True)
def _lowest_set_bit(word):
    """Index (0 .. 63) of the lowest set bit of a nonzero int64, by halving the search six times.
    Not ``cuda.ffs``: the CUDA simulator's reads only the low 32 bits."""
    index = 0
    for width in (32, 16, 8, 4, 2, 1):
        if (word & ((1 << width) - 1)) == 0:
            index += width
            word >>= width
    return index
