"""The simulator's core: batches of a trace through the policy, one ``numba.njit`` loop.

:class:`~tiered_tbe.cache.simulator.CacheSimulator` keeps the state and calls :func:`run_batches`; the loop
runs the functions of :mod:`tiered_tbe.cache.policy` that the GPU kernels run, one miss at a time (the
order and the choices of that module's specification).
"""

from __future__ import annotations

import numba
import numpy as np

from tiered_tbe.cache.policy import (
    EMPTY,
    NEXT_USE_UNKNOWN,
    NO_SLOT,
    admits_by_next_use_cpu,
    admits_cpu,
    choose_victim_cpu,
    count_use_cpu,
    counts_rows_cpu,
    fill_slot_cpu,
    find_way_cpu,
    lock_hit_cpu,
    reads_window_cpu,
    set_of_row_cpu,
)

# Counters of the njit core, in the order it stores them (bytes follow from row_bytes in Python).
COUNTERS = ("lookups", "lookup_hits", "unique_hits", "unique_misses", "misses_no_slot", "misses_set_full",
            "evictions", "write_backs")

# Not cache=True: numba's on-disk cache is keyed on this file alone, and would keep running the
# policy of an older policy.py after an edit there. Compiling takes about a second per process.
@numba.njit
def run_batches(rows, batch_offsets, num_batches, first_step, num_sets, associativity, policy,
                 lfu_decay_interval, training, lookahead_window, next_batch_of_lookup, tags, last_use,
                 use_count, next_use, next_step, locks, dirty, row_uses, in_flight_slots, in_flight_counts,
                 in_flight_bypassed, in_flight_bypassed_counts, counters):
    """Advance the cache state over the first ``num_batches`` batches of ``batch_offsets`` (see
    CacheSimulator.run); the batches after them are only the future that lookahead sees.

    ``next_batch_of_lookup`` (int32 [len(rows)], lookahead with a window only, else empty): the
    next batch (index into ``batch_offsets``) naming each lookup's row, ``batch_offsets.size - 1``
    when none does. ``in_flight_slots`` (int32 [depth + 1, capacity]) / ``in_flight_counts``
    (int64 [depth + 1]): a ring of the slots each batch in flight locked, batch of step ``s`` in
    row ``s % (depth + 1)``; ``in_flight_bypassed`` / ``in_flight_bypassed_counts``, the same ring
    of the rows each batch got no slot for (policy.py, "Rows left in the backing store").
    ``row_uses`` (int16, past the largest row id; a policy that counts rows only): each row's use count.
    """
    hinted = reads_window_cpu(policy) and lookahead_window > 0
    by_next_use = admits_by_next_use_cpu(policy)
    counting = counts_rows_cpu(policy)
    known_batches = batch_offsets.size - 1
    ring = in_flight_counts.size  # pipeline_depth + 1
    longest = 0
    for b in range(num_batches):
        longest = max(longest, batch_offsets[b + 1] - batch_offsets[b])
    missed = np.empty(longest, dtype=np.int64)  # rows of this batch not found at prefetch
    missed_next = np.empty(longest if hinted else 0, dtype=np.int64)  # their next use (step)
    missed_uses = np.empty(longest if counting else 0, dtype=np.int64)  # minus their use count (its order)
    # Per set, in this batch: the step it was first asked for a way at, the unlocked ways it had then (after
    # the batch's hits locked theirs), and the misses that asked it so far. The k-th asking miss of a set
    # finds it full when k >= those ways, whether or not the misses before it were admitted: the GPU kernel
    # ranks a set's asking misses against its unlocked ways (policy_kernels.fill_misses_kernel).
    asked_at = np.full(num_sets, -1, dtype=np.int64)
    room = np.zeros(num_sets, dtype=np.int32)
    asked = np.zeros(num_sets, dtype=np.int32)
    # Counted in locals (registers), stored once at the end.
    lookups = lookup_hits = unique_hits = unique_misses = misses_no_slot = misses_set_full = evictions = 0
    write_backs = 0

    for b in range(num_batches):
        step = first_step + b + 1
        held = in_flight_slots[step % ring]  # the slots this batch locks
        num_held = 0
        num_missed = 0
        # Hits of every set first (policy.py, step 2). A hit or fill sets last_use = step, so a
        # slot already used at this step was hit earlier in this batch (other batches in flight
        # may hold locks on it too: locks count batches).
        for i in range(batch_offsets[b], batch_offsets[b + 1]):
            row = rows[i]
            first_slot = set_of_row_cpu(row, num_sets) * associativity
            slot = find_way_cpu(tags, first_slot, associativity, row)
            if slot == NO_SLOT:
                missed[num_missed] = row
                if hinted:
                    missed_next[num_missed] = _step_of_batch(next_batch_of_lookup[i], known_batches, first_step)
                num_missed += 1
                continue
            lookup_hits += 1
            if last_use[slot] != step:
                unique_hits += 1
                if counting:
                    count_use_cpu(row, row_uses)
                lock_hit_cpu(policy, slot, row, step, last_use, use_count, row_uses, locks)
                held[num_held] = slot
                num_held += 1
                if hinted:
                    next_step[slot] = _step_of_batch(next_batch_of_lookup[i], known_batches, first_step)
        lookups += batch_offsets[b + 1] - batch_offsets[b]

        # Then misses in ascending row order (policy.py, step 3). Sets are independent, so one
        # pass in global row order is each set's misses in ascending order.
        horizon = step + lookahead_window  # the last step whose batch the window shows
        if hinted:  # keep each missed row's next use beside it (repeats of a row share it)
            order = np.argsort(missed[:num_missed])
            if by_next_use:  # soonest needed within the window first, then ascending rows (policy.py, "Admission")
                seen = np.minimum(missed_next[:num_missed][order], horizon + 1)  # past the horizon: unknown
                order = order[np.argsort(seen, kind="mergesort")]
            missed[:num_missed] = missed[:num_missed][order]
            missed_next[:num_missed] = missed_next[:num_missed][order]
        else:
            missed[:num_missed].sort()
        if counting:  # count each missed row's use, then take them most used first (policy.py, "Admission")
            num_missed = _unique_sorted(missed, num_missed)
            for k in range(num_missed):
                count_use_cpu(missed[k], row_uses)
                missed_uses[k] = -np.int64(row_uses[missed[k]])
            order = np.argsort(missed_uses[:num_missed], kind="mergesort")  # stable: ascending rows on a tie
            missed[:num_missed] = missed[:num_missed][order]
        for k in range(num_missed):
            row = missed[k]
            if not counting and k > 0 and row == missed[k - 1]:
                continue
            unique_misses += 1
            first_slot = set_of_row_cpu(row, num_sets) * associativity
            if hinted:  # what the cache decodes from its window bits, for the ways of this set
                for slot in range(first_slot, first_slot + associativity):
                    next_use[slot] = next_step[slot] if next_step[slot] <= horizon else NEXT_USE_UNKNOWN
            slot = NO_SLOT
            if not _bypassed_in_flight(row, step, in_flight_bypassed, in_flight_bypassed_counts):
                the_set = first_slot // associativity
                if asked_at[the_set] != step:
                    asked_at[the_set] = step
                    asked[the_set] = 0
                    room[the_set] = _unlocked_ways(locks, first_slot, associativity)
                full = asked[the_set] >= room[the_set]
                asked[the_set] += 1
                if full:
                    misses_set_full += 1
                else:
                    slot = choose_victim_cpu(policy, tags, last_use, use_count, next_use, locks, first_slot,
                                             associativity)
                miss_next_use = NEXT_USE_UNKNOWN  # what the cache decodes from its window bits for this row
                if hinted and missed_next[k] <= horizon:
                    miss_next_use = missed_next[k]
                if slot != NO_SLOT and not admits_cpu(policy, row, row_uses, slot, tags, use_count, next_use,
                                                      miss_next_use):
                    slot = NO_SLOT
            if slot == NO_SLOT:
                misses_no_slot += 1
                bypassed = in_flight_bypassed[step % ring]
                bypassed[in_flight_bypassed_counts[step % ring]] = row
                in_flight_bypassed_counts[step % ring] += 1
                continue
            if tags[slot] != EMPTY:
                evictions += 1
                if dirty[slot]:
                    write_backs += 1
            fill_slot_cpu(policy, slot, row, step, tags, last_use, use_count, row_uses, dirty, locks)
            held[num_held] = slot
            num_held += 1
            if hinted:
                next_step[slot] = missed_next[k]
        in_flight_counts[step % ring] = num_held
        # Sorted, so that later batches find a row among them by bisection (_bypassed_in_flight).
        in_flight_bypassed[step % ring, :in_flight_bypassed_counts[step % ring]].sort()

        # The batch prefetched pipeline_depth steps ago finishes (this one, when serial): its
        # backward updated every row it used (dirty), then it unlocks them.
        finished = (step + 1) % ring  # == (step - pipeline_depth) % ring
        for k in range(in_flight_counts[finished]):
            slot = in_flight_slots[finished, k]
            locks[slot] -= 1
            if training:
                dirty[slot] = 1
        in_flight_counts[finished] = 0
        in_flight_bypassed_counts[finished] = 0
        if step % lfu_decay_interval == 0:
            for slot in range(use_count.size):
                use_count[slot] >>= 1
            if counting:
                for row in range(row_uses.size):
                    row_uses[row] >>= 1
    for k, value in enumerate((lookups, lookup_hits, unique_hits, unique_misses, misses_no_slot, misses_set_full,
                               evictions, write_backs)):
        counters[k] += value


@numba.njit
def _unique_sorted(values, count):
    """Drop repeats from the sorted ``values[:count]`` in place; returns how many are left."""
    kept = 0
    for k in range(count):
        if k == 0 or values[k] != values[k - 1]:
            values[kept] = values[k]
            kept += 1
    return kept


@numba.njit
def _bypassed_in_flight(row, step, in_flight_bypassed, in_flight_bypassed_counts):
    """Whether a batch in flight other than this step's got no slot for ``row``: a bisection of each
    one's rows, sorted when its prefetch ended. A linear scan took 128 s a batch on 12 mixed-dim tables
    under ``lfu-admit``, which leaves ~400K rows a batch in place (0.7 s before the cache filled)."""
    ring = in_flight_bypassed_counts.size
    for entry in range(ring):
        count = in_flight_bypassed_counts[entry]
        if entry == step % ring or count == 0:
            continue
        rows = in_flight_bypassed[entry, :count]
        k = np.searchsorted(rows, row)
        if k < count and rows[k] == row:
            return True
    return False


@numba.njit(inline="always")
def _unlocked_ways(locks, first_slot, associativity):
    """The ways of the set starting at ``first_slot`` that no batch holds a lock on."""
    count = 0
    for slot in range(first_slot, first_slot + associativity):
        if locks[slot] == 0:
            count += 1
    return count


@numba.njit(inline="always")
def _step_of_batch(batch, known_batches, first_step):
    """The step of batch ``batch`` of this run, ``NEXT_USE_UNKNOWN`` past the known batches."""
    return first_step + batch + 1 if batch < known_batches else NEXT_USE_UNKNOWN

