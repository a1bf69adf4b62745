"""The set-associative replacement policy: one definition for the GPU cache and the CPU simulator.

Every function here is written once, in plain Python, and compiled twice: with
``numba.njit`` for the CPU simulator (:mod:`tiered_tbe.cache.simulator`) and with
``numba.cuda.jit(device=True)`` for the prefetch kernels (:mod:`tiered_tbe.cache._kernels`).
The plain Python versions run in the CUDA simulator (except the hash, for which simulated
kernels call the njit version: numpy warns on the uint64 wrap-around it relies on); from
Python, call the compiled ``*_cpu`` versions. Change the policy here and both sides change
together, which is what keeps them agreeing hit for hit.

Specification
=============

Layout
    ``num_slots = num_sets * associativity`` slots. Set ``s`` owns slots
    ``s * associativity + way`` for ``way`` in ``0 .. associativity - 1``. A global row id ``g``
    (int64, ``g >= 0``) lives only in set ``set_of_row(g, num_sets)``: splitmix64 of ``g``
    (golden-ratio increment, then Stafford's variant-13 finalizer, all mod 2**64), modulo
    ``num_sets``. Consecutive row ids spread evenly over the sets.

Per-slot state
    ``tags[slot]``: the global row held, or ``EMPTY`` (-1). ``last_use[slot]``: the step that
    last used the row (LRU). ``use_count[slot]``: batches that used the row since it was filled,
    aged (LFU). ``locks[slot]``: in-flight batches that need the row. ``dirty[slot]``: the slot
    holds updates its backing store lacks. ``next_use[slot]``: the step at which a batch of the
    lookahead window next needs the row, ``NEXT_USE_UNKNOWN`` when none does (read by
    lookahead only; see "Lookahead window").

Step
    One prefetch is one step; steps count 1, 2, 3, ... Every prefetch counts, even one whose
    rows are all outside the cached tables. ``lookup`` (no policy change) is not a step.

One step (prefetch of one batch)
    1. The batch's row ids are deduplicated: each unique row is handled once, however many
       lookups name it.
    2. Hits first, in every set: a unique row found in its set is a hit:
       ``last_use = step``, ``use_count += 1``, ``locks += 1`` (:func:`touch_on_hit`).
       All hits of a batch are resolved before any victim is chosen, so a row the batch uses
       is never evicted to make room for another row of the same batch.
    3. Then the misses of each set, in ascending global row order (``lfu-admit``: see
       "Admission"). Each takes the way
       :func:`choose_victim` returns, among the ways of its set with ``locks == 0``:
       an empty way if there is one (the lowest such way); otherwise the way with the smallest
       ``victim_key`` (ties broken by the lowest way). A dirty victim is written back to its
       backing store, a clean one is dropped. The filled way gets ``tags = row``,
       ``last_use = step``, ``use_count = 1``, ``dirty = 0``, ``locks += 1``
       (:func:`touch_on_fill`), so the next miss of the same set cannot take it.
       A miss that finds no way with ``locks == 0`` gets slot -1 (``misses_no_slot``): its
       lookups read and update the backing store directly, and the cache state is unchanged.
    4. After every ``lfu_decay_interval``-th step (``step % lfu_decay_interval == 0``) every
       ``use_count`` is halved (``>> 1``). Use counts are kept and aged under every policy
       (only ``lfu`` and ``lfu-admit`` rank by them), so the state evolves the same whatever the policy.

Per-row use counts (``lfu-admit`` only)
    ``row_uses[row]`` (int16, one per global row of the cached tables, ``R`` in all): the batches
    that named the row, aged. Each prefetch adds 1 (up to ``ROW_USES_MAX``) to every unique row
    of the batch, hit or miss, before step 2 (:func:`count_use`); the halving of step 4 halves
    them too. A slot's ``use_count`` is then its row's count, set on every hit and fill
    (:func:`take_row_uses`), so ranking the ways of a set needs no look-up per way.

Admission (``lfu-admit``, ``lookahead-admit``)
    In step 3 a set's misses come in descending ``row_uses`` (after this batch's counts), ties
    in ascending row order. A miss takes the victim :func:`choose_victim` returns only if that
    way is empty or its ``use_count`` is below the miss's ``row_uses`` (:func:`admits`). Else the
    miss gets no slot (``misses_no_slot``): its lookups read and update its backing store, as
    with every way locked. Once one miss of a set is refused so is every later one of that set
    (their counts are no larger, their victims' no smaller), so the k-th miss meets the k-th
    victim whether the misses are taken one after another (the simulator) or all at once (the
    GPU kernels). FBGEMM's LFU admits by the same comparison (its counts are lookups, never
    aged, and ties admit); the rule keeps a row used once out of a cache of rows used more,
    which moves far fewer rows where most misses are rows few batches name.

    ``lookahead-admit`` is Belady's rule with bypass over the lookahead window: a set's misses come
    soonest next use first (a miss's next use read from the window as the ways' are; a row no batch
    of the window names, ``NEXT_USE_UNKNOWN``, last), ties in ascending row order, and a miss takes
    its victim only if that way is empty or the miss is needed strictly before the victim's row
    (:func:`admits`). The victims come in lookahead's order, latest next use first, so again a refused
    miss refuses every later one of its set and the k-th miss meets the k-th victim. A row needed
    no sooner than everything it could evict is read in place for this batch instead of moved in:
    on the 12 mixed-dim benchmark tables 16-24% fewer rows crossed the bus than under ``lfu-admit`` at
    windows of 16-64 batches (docs/performance.md). Without hints every next use is unknown and no
    miss takes a full set's way: give the cache its window (``PrefetchPipeline(lookahead=...)``).

Victim keys (smaller is evicted first; compared as a pair, then by way)
    ``lru``: ``(last_use, 0)``: the least recently used row.
    ``lfu``, ``lfu-admit``: ``(use_count, last_use)``: the least used row; among equally used rows
    the least recently used one.
    ``lookahead``: ``(-next_use, last_use)``: rows no batch of the window needs first (their
    ``next_use`` is ``NEXT_USE_UNKNOWN``, the largest value), least recently used first; then
    the row needed latest (Belady's rule over the window), the least recently used on a tie.
    With no hint every ``next_use`` is unknown and lookahead is exactly LRU.

Lookahead window
    The caller tells the cache of each batch of the window once, when it enters the window:
    ``SlotCache.add_upcoming(rows, s)`` with the rows of the batch that will be prefetched at
    step ``s``. Before the prefetch of batch ``j`` (whose step will be ``step + 1``) the batches
    ``j+1 .. j+W`` (fewer at the end of the data) have been recorded, batch ``m`` at step
    ``step + 1 + (m - j)``; ``W`` is at most 64 (``MAX_LOOKAHEAD``), as a step must be in
    ``step + 2 .. step + 65`` when it is recorded. The prefetch at step ``t`` first forgets every
    recorded step ``<= t``; then, in each set, just before its first victim choice, every way
    holding a row gets ``next_use`` = the smallest recorded step in ``t + 1 .. t + 64`` whose batch
    names the row, or ``NEXT_USE_UNKNOWN`` if none does. Rows named but not cached change nothing.
    A row used by batch ``j`` itself is locked (a hit) before any victim is chosen, and the slot a
    miss fills keeps its previous occupant's value, which nothing reads before the next prefetch
    refreshes it (the slot is locked meanwhile). Until the first ``add_upcoming`` the prefetch
    ranks by ``next_use`` as it is (all ``NEXT_USE_UNKNOWN``, i.e. LRU, unless set by hand).

    The cache keeps, per row of the cached tables, a 64-bit word (``window_bits``): bit ``s %
    64`` is set while the recorded batch of step ``s`` names the row. The prefetch at step ``t``
    sees only steps ``t + 1 .. t + 64`` (one per bit) because ``add_upcoming`` forgets step
    ``step + 1`` (the bit that step ``step + 65`` reuses) and every earlier one before recording.

    The simulator (:mod:`tiered_tbe.cache.simulator`, ``lookahead_window=W``) reads the window
    from the trace: each lookup's next batch naming its row is found once, in one backward
    pass; each slot keeps its row's next use, set whenever a batch uses the row (a cached row
    is used by every batch naming it, as a hit); before a miss chooses a victim, the ways of
    its set get ``next_use = that step`` if it is at most ``step + W``, else
    ``NEXT_USE_UNKNOWN``: what the cache decodes from its window bits for them.

Locks
    A prefetch adds one lock to each slot it returns (hit or fill), once per unique row.
    The caller removes it (``SlotCache.unlock``) when the batch no longer needs its rows:
    after backward, or after forward under ``no_grad``. A locked slot is never a victim. In
    serial training (prefetch, forward, backward, unlock) every lock is released before the
    next prefetch; with a prefetch pipeline the rows of every batch in flight stay locked.
    The simulator's ``pipeline_depth=k`` (every policy) releases batch ``j - k`` right after
    the prefetch of batch ``j`` (``mark_dirty`` of its slots first, in training), so the rows
    of the ``k`` batches before batch ``j`` are locked while it is prefetched; ``k = 0`` is
    serial training.

Rows left in the backing store
    A batch reads and updates the rows it got slot -1 for (``misses_no_slot``) in their backing
    stores, from its forward to its backward. So that no later prefetch copies such a row into a
    slot while that batch may still write it (its update would land on the backing store after
    the copy, and be lost), a miss whose row some batch still in flight got no slot for gets no
    slot either: it counts in ``misses_no_slot``, leaves the cache unchanged, and is itself
    barred until its batch finishes. Nothing else about a prefetch depends on the backwards in
    flight, so a pipeline's prefetches need not wait for them (only for the unlocks). In serial
    training no other batch is in flight and this never applies. The GPU cache keeps one count
    per row (``bypass_count``, uint8: batches in flight that left the row in its backing store);
    the simulator keeps the rows of each batch in flight.

Extending the policy
    The registry :data:`POLICIES` is the one list of policies: ``CacheConfig``, the command
    line's choices, the benchmarks and the tests read it. A policy that ranks by the per-slot
    state above (``last_use``, ``use_count``, ``next_use``) is a code below, a branch in
    :func:`victim_key`, and one line in :data:`POLICIES`; the kernels and the simulator call
    ``victim_key`` through :func:`victim_order` (the order of victims) and need no change, and the tests that run
    every registered policy (the simulator against the real cache, hit for hit) cover it.

    A policy that needs new per-slot state needs more than this file:

    - the state itself: a tensor in ``SlotCache.__init__`` (``cache/slot_cache.py``), reset by
      ``invalidate``, passed to the prefetch kernels (``cache/_kernels.py``), and the same
      array in ``CacheSimulator`` (``cache/simulator.py``) with its njit loop;
    - its updates: ``touch_on_hit`` / ``touch_on_fill`` here take the new array (both targets
      call them), and any aging like LFU's halving goes where ``use_count`` is halved in
      ``SlotCache.prefetch`` and the simulator;
    - ``victim_key`` and ``choose_victim`` take the new array as an argument (every caller:
      the kernels, the simulator, ``tests/test_cache_policy.py``);
    - knowledge from outside the slot enters as a per-slot array the prefetch kernel writes
      before it chooses victims, as lookahead's ``next_use`` (decoded from the window bits that
      ``SlotCache.add_upcoming`` records; the simulator derives the same values from the
      trace). A policy with ``reads_window=True`` is told the window the same way: the cache
      and the simulator decode ``next_use`` where :func:`reads_window` says so (``SlotCache``'s
      ``window_bits`` and the simulator's ``hinted``), so a new window policy extends that test;
    - the slot's size: new per-slot state goes in ``slot_layout.SLOT_METADATA``, which
      ``SlotCache`` allocates from and ``slot_layout.slot_bytes`` (how ``CacheConfig(memory=...)``
      becomes slots) counts; new per-row state (as ``lfu-admit``'s ``row_uses``) in
      ``slot_layout.row_bytes``.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import numba
import numpy as np

import tiered_tbe.base.mode  # noqa: F401  (sets the simulation mode before numba.cuda loads)

# Policy codes, as passed to the kernels and the simulator.
POLICY_LRU = 0
POLICY_LFU = 1
POLICY_LOOKAHEAD = 2
POLICY_LFU_ADMIT = 3
POLICY_LOOKAHEAD_ADMIT = 4


@dataclass(frozen=True)
class CachePolicy:
    """One entry of the registry: a policy's name (``CacheConfig(policy=...)``, the command
    line), its code (what the kernels and the simulator branch on) and what it ranks by."""

    name: str
    code: int
    summary: str  # one line for --help and reports
    reads_window: bool = False  # ranks by next_use, told by the lookahead window (hints)
    counts_rows: bool = False  # keeps a use count per row (row_uses) and admits misses by it
    refuses_misses: bool = False  # may leave a miss in its backing store though a way is free (admission)

    @property
    def needs_window(self) -> bool:
        """Admits by the window's next uses: with no window every next use is unknown and no row enters a
        full set, so a caller that gives the cache no batches ahead must refuse the policy."""
        return self.reads_window and self.refuses_misses


# The registry: every policy of the cache, in the order --help lists them.
POLICIES: dict[str, CachePolicy] = {p.name: p for p in (
    CachePolicy("lru", POLICY_LRU, "least recently used row first"),
    CachePolicy("lfu", POLICY_LFU, "least used row first (use counts halved every lfu_decay_interval "
                "prefetches), the least recent among equals"),
    CachePolicy("lookahead", POLICY_LOOKAHEAD, "rows no batch of the lookahead window needs first (least "
                "recent first), then the row needed latest; LRU without hints", reads_window=True),
    CachePolicy("lfu-admit", POLICY_LFU_ADMIT, "LFU that lets a missed row in only if more batches named it "
                "than the row it would evict (counts per row, halved like LFU's); the others are read in place",
                counts_rows=True, refuses_misses=True),
    CachePolicy("lookahead-admit", POLICY_LOOKAHEAD_ADMIT, "lookahead that lets a missed row in only if the "
                "window needs it before the row it would evict (Belady's rule with bypass); the others are read in "
                "place", reads_window=True, refuses_misses=True),
)}
DEFAULT_POLICY = "lru"
POLICY_CODES = {name: p.code for name, p in POLICIES.items()}

EMPTY = -1  # tag of a slot holding no row
ROW_USES_MAX = np.iinfo(np.int16).max  # a row's use count stops here (row_uses is int16)
NO_SLOT = -1  # slot of a row that is not cached (and will not be for this batch)
NEXT_USE_UNKNOWN = np.iinfo(np.int64).max  # next_use of a row that no queued batch needs

# splitmix64 constants (Steele, Lea, Flood 2014; finalizer: Stafford's "Mix13").
_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX_MULTIPLIER_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_MULTIPLIER_2 = np.uint64(0x94D049BB133111EB)
_SHIFT_30 = np.uint64(30)
_SHIFT_27 = np.uint64(27)
_SHIFT_31 = np.uint64(31)


def policy_named(policy: str) -> CachePolicy:
    """The registry entry of ``policy`` (``"lru"``, ...); a ValueError naming the choices otherwise."""
    try:
        return POLICIES[policy]
    except (KeyError, TypeError):
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}") from None


def policy_code(policy: str) -> int:
    """``"lru"`` -> ``POLICY_LRU``, etc.; a clear error for anything else."""
    return policy_named(policy).code


def round_to_sets(rows: int, associativity: int) -> int:
    """Slots of a cache of at least ``rows`` rows: whole sets of ``associativity`` ways, at least one set.

    The one rounding of a cache size: ``CacheConfig`` (the module's cache) and the hit-rate
    benchmark (the simulated ones) both call it, so a size means the same cache in both.
    """
    if associativity < 1:
        raise ValueError(f"associativity must be >= 1, got {associativity}")
    return max(1, -(-int(rows) // associativity)) * associativity


# Most ways a set of the GPU slot cache may have: its policy kernels rank a set's ways with a thread
# per way, 32 a warp, each taking at most two (cache/policy_kernels.py), and a way is an int8.
# The CPU simulator takes any associativity.
MAX_WAYS = 64


def check_gpu_ways(associativity: int) -> None:
    """The one check of :data:`MAX_WAYS` (``CacheConfig`` calls it as it is made, ``SlotCache`` too)."""
    if associativity > MAX_WAYS:
        raise ValueError(f"associativity must be at most {MAX_WAYS} ways a set, got {associativity} (the GPU "
                         "slot cache's policy kernels rank a set's ways with a warp, two ways a thread at most)")


def check_geometry(num_slots: int, associativity: int, lfu_decay_interval: int) -> None:
    """The cache shape both the GPU cache and the simulator accept; a clear error otherwise."""
    if associativity < 1 or num_slots < associativity or num_slots % associativity:
        raise ValueError(f"num_slots ({num_slots}) must be a positive multiple of associativity ({associativity})")
    if lfu_decay_interval < 1:
        raise ValueError(f"lfu_decay_interval must be >= 1, got {lfu_decay_interval}")


def mix64(row):
    """splitmix64 of a non-negative int64: a uint64 whose bits all depend on every bit of ``row``."""
    z = np.uint64(row) + _GOLDEN_GAMMA
    z = (z ^ (z >> _SHIFT_30)) * _MIX_MULTIPLIER_1
    z = (z ^ (z >> _SHIFT_27)) * _MIX_MULTIPLIER_2
    return z ^ (z >> _SHIFT_31)


def set_of_row(row, num_sets):
    """The set (int64 in ``[0, num_sets)``) that global row ``row`` (int64 >= 0) maps to."""
    return np.int64(mix64(row) % np.uint64(num_sets))


def victim_key(policy, slot, last_use, use_count, next_use):
    """Eviction rank of an occupied, unlocked slot: the smallest ``(primary, secondary)`` goes first.

    Ties on the pair are broken by the lowest way (in :func:`choose_victim`). Takes the arrays,
    not their values, so each policy reads only the state it ranks by.
    """
    if policy == POLICY_LFU or policy == POLICY_LFU_ADMIT:
        return np.int64(use_count[slot]), last_use[slot]
    if reads_window(policy):
        return -next_use[slot], last_use[slot]
    return last_use[slot], np.int64(0)


def find_way(tags, first_slot, associativity, row):
    """The slot of set ``[first_slot, first_slot + associativity)`` holding ``row``, or ``NO_SLOT``."""
    for way in range(associativity):
        if tags[first_slot + way] == row:
            return first_slot + way
    return NO_SLOT


def victim_order(policy, slot, tags, last_use, use_count, next_use):
    """``(group, primary, secondary)`` of an unlocked slot: its place in the order of victims, compared
    as a tuple and then by slot (the lower first). Empty slots are group 0 (before every occupied one,
    the lowest first); occupied ones group 1, ranked by :func:`victim_key`.

    The one definition of the order: :func:`choose_victim` takes the first unlocked slot in it; the
    GPU kernels rank a set's unlocked slots by it (:func:`comes_before`) and give its ``k``-th miss
    the ``k``-th slot (``cache/policy_kernels.py``), which is the same, as only fills (which lock)
    change a set meanwhile."""
    # No early return for an empty slot: inlined in choose_victim's loop it ran 3x slower (numba, measured).
    group = np.int64(0) if tags[slot] == EMPTY else np.int64(1)
    primary, secondary = victim_key(policy, slot, last_use, use_count, next_use)
    return group, primary * group, secondary * group  # an empty slot's keys: 0


def comes_before(group, primary, secondary, slot, other_group, other_primary, other_secondary, other):
    """Whether a slot of :func:`victim_order` ``(group, primary, secondary)`` comes before another."""
    if group != other_group:
        return group < other_group
    if primary != other_primary:
        return primary < other_primary
    if secondary != other_secondary:
        return secondary < other_secondary
    return slot < other


def choose_victim(policy, tags, last_use, use_count, next_use, locks, first_slot, associativity):
    """The slot a missed row of this set takes, or ``NO_SLOT`` when every way is locked: the
    first unlocked way in the order of :func:`victim_order` (an empty way wins outright)."""
    best = NO_SLOT
    best_group = np.int64(0)
    best_primary = np.int64(0)
    best_secondary = np.int64(0)
    for way in range(associativity):
        slot = first_slot + way
        if locks[slot] != 0:
            continue
        group, primary, secondary = victim_order(policy, slot, tags, last_use, use_count, next_use)
        if group == 0:
            return slot  # ways are scanned in order, so this is the lowest empty way: first in the order
        if best == NO_SLOT or comes_before(group, primary, secondary, slot, best_group, best_primary, best_secondary,
                                           best):
            best, best_group, best_primary, best_secondary = slot, group, primary, secondary
    return best


def touch_on_hit(slot, step, last_use, use_count):
    """Policy state of a slot whose row a batch uses (the lock is the caller's)."""
    last_use[slot] = step
    use_count[slot] += 1


def touch_on_fill(slot, step, last_use, use_count):
    """Policy state of a slot just filled with a missed row (tag, dirty and lock are the caller's)."""
    last_use[slot] = step
    use_count[slot] = 1


def counts_rows(policy):
    """Whether ``policy`` keeps a use count per row (``row_uses``): ``CachePolicy.counts_rows`` as the
    kernels and the simulator test it (``tests/test_cache_policy.py`` checks the two agree)."""
    return policy == POLICY_LFU_ADMIT


def reads_window(policy):
    """Whether ``policy`` ranks by the lookahead window's next uses: ``CachePolicy.reads_window`` as the
    kernels and the simulator test it (``tests/test_cache_policy.py`` checks the two agree)."""
    return policy == POLICY_LOOKAHEAD or policy == POLICY_LOOKAHEAD_ADMIT


def admits_by_next_use(policy):
    """Whether ``policy`` orders a set's misses by their next use and admits them by it (``lookahead-admit``)."""
    return policy == POLICY_LOOKAHEAD_ADMIT


def count_use(row, row_uses):
    """A batch names ``row`` (once however many of its lookups do): one more use, up to ``ROW_USES_MAX``."""
    if row_uses[row] < ROW_USES_MAX:
        row_uses[row] += 1


def take_row_uses(policy, slot, row, row_uses, use_count):
    """After a hit or fill of ``slot`` by ``row``: a policy that counts rows ranks the slot by its row's count."""
    if counts_rows(policy):
        use_count[slot] = row_uses[row]


def lock_hit(policy, slot, row, step, last_use, use_count, row_uses, locks):
    """A batch's hit of ``row`` in ``slot`` (policy.py, step 2): its policy state, and one lock."""
    touch_on_hit(slot, step, last_use, use_count)
    take_row_uses(policy, slot, row, row_uses, use_count)
    locks[slot] += 1


def fill_slot(policy, slot, row, step, tags, last_use, use_count, row_uses, dirty, locks):
    """``slot`` takes the missed ``row`` (step 3; its victim is the caller's): the tag, the policy state,
    clean, one lock."""
    tags[slot] = row
    touch_on_fill(slot, step, last_use, use_count)
    take_row_uses(policy, slot, row, row_uses, use_count)
    dirty[slot] = 0
    locks[slot] += 1


def admits(policy, row, row_uses, slot, tags, use_count, next_use, miss_next_use):
    """Whether a miss of ``row`` takes ``slot``, the victim :func:`choose_victim` gave it: always, unless
    the slot holds a row and the policy counts rows and that row is used at least as often, or admits by
    next use and the miss (needed at step ``miss_next_use``, ``NEXT_USE_UNKNOWN`` when the window does not
    name it) is not needed strictly sooner than the slot's row (``next_use``). ``row_uses`` is read only by
    a policy that counts rows (others pass a placeholder)."""
    if tags[slot] == EMPTY:
        return True
    if counts_rows(policy):
        return row_uses[row] > use_count[slot]
    if admits_by_next_use(policy):
        return miss_next_use < next_use[slot]
    return True


# ---------------------------------------------------------------------------------------------
# Compiled versions. Functions that call other policy functions are re-bound to the callee's
# version for the same target, so the njit choose_victim calls the njit victim_key, etc.

def _rebind(fn, **callees):
    """``fn`` with some global names replaced: the same code, calling other compiled functions."""
    namespace = dict(fn.__globals__)
    namespace.update(callees)
    return types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)


# --- CPU (numba.njit), for the simulator
# The small leaf functions are inlined into the simulator's loops (a call per way of every miss
# otherwise costs ~25% of the time). The two with loops are not: numba's IR inlining of a loop
# with an early return made choose_victim ten times slower under LRU (measured).
_cpu = numba.njit(cache=True)
_cpu_inlined = numba.njit(cache=True, inline="always")
mix64_cpu = _cpu_inlined(mix64)
set_of_row_cpu = _cpu_inlined(_rebind(set_of_row, mix64=mix64_cpu))
reads_window_cpu = _cpu_inlined(reads_window)
victim_key_cpu = _cpu_inlined(_rebind(victim_key, reads_window=reads_window_cpu))
find_way_cpu = _cpu(find_way)
victim_order_cpu = _cpu_inlined(_rebind(victim_order, victim_key=victim_key_cpu))
comes_before_cpu = _cpu_inlined(comes_before)
choose_victim_cpu = _cpu(_rebind(choose_victim, victim_order=victim_order_cpu, comes_before=comes_before_cpu))
touch_on_hit_cpu = _cpu_inlined(touch_on_hit)
touch_on_fill_cpu = _cpu_inlined(touch_on_fill)
counts_rows_cpu = _cpu_inlined(counts_rows)
count_use_cpu = _cpu_inlined(count_use)
take_row_uses_cpu = _cpu_inlined(_rebind(take_row_uses, counts_rows=counts_rows_cpu))
admits_by_next_use_cpu = _cpu_inlined(admits_by_next_use)
admits_cpu = _cpu_inlined(_rebind(admits, counts_rows=counts_rows_cpu, admits_by_next_use=admits_by_next_use_cpu))
lock_hit_cpu = _cpu_inlined(_rebind(lock_hit, touch_on_hit=touch_on_hit_cpu, take_row_uses=take_row_uses_cpu))
fill_slot_cpu = _cpu_inlined(_rebind(fill_slot, touch_on_fill=touch_on_fill_cpu, take_row_uses=take_row_uses_cpu))

# --- GPU (numba.cuda.jit(device=True)), for the prefetch kernels
from numba import cuda  # noqa: E402  (after tiered_tbe.base.mode, which the import above guarantees)

_device = cuda.jit(device=True)
if numba.config.ENABLE_CUDASIM:
    # The CUDA simulator runs kernels as Python, where numpy uint64 scalars warn on the
    # wrap-around the hash relies on: kernels call the compiled CPU hash instead (same code).
    # (Not SIMULATION: tools/compile_cache_kernels.py compiles for the GPU without one.)
    set_of_row_device = set_of_row_cpu
else:
    set_of_row_device = _device(_rebind(set_of_row, mix64=_device(mix64)))


def compile_for_simulator() -> None:
    """In the CUDA simulator: compile (or load from numba's cache) the CPU hash that the kernels
    call, here, in the calling thread; elsewhere nothing.

    Else the first simulated kernel thread to call it compiles it, while the simulator's main
    thread polls its threads without sleeping: each time the compiler lets go of the GIL (every
    llvmlite call does) it waits out a switch interval to get it back, and the compile took
    ~11 s instead of ~1 s (measured on a 2-core machine). The same code runs either way.
    """
    if numba.config.ENABLE_CUDASIM:
        set_of_row_cpu(np.int64(0), np.int64(1))
reads_window_device = _device(reads_window)
victim_key_device = _device(_rebind(victim_key, reads_window=reads_window_device))
find_way_device = _device(find_way)
victim_order_device = _device(_rebind(victim_order, victim_key=victim_key_device))
comes_before_device = _device(comes_before)
touch_on_hit_device = _device(touch_on_hit)
touch_on_fill_device = _device(touch_on_fill)
counts_rows_device = _device(counts_rows)
count_use_device = _device(count_use)
take_row_uses_device = _device(_rebind(take_row_uses, counts_rows=counts_rows_device))
admits_by_next_use_device = _device(admits_by_next_use)
admits_device = _device(_rebind(admits, counts_rows=counts_rows_device, admits_by_next_use=admits_by_next_use_device))
lock_hit_device = _device(_rebind(lock_hit, touch_on_hit=touch_on_hit_device, take_row_uses=take_row_uses_device))
fill_slot_device = _device(_rebind(fill_slot, touch_on_fill=touch_on_fill_device,
                                   take_row_uses=take_row_uses_device))
