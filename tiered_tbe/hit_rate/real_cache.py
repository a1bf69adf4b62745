"""The real-cache driver (``--real-cache``): :class:`~tiered_tbe.cache.SlotCache` over the same trace.

It drives the real cache (its Numba kernels: on the GPU, or in the Numba CUDA simulator on a
CPU, where only small traces finish) as training does, for every policy of the cache's registry
and every size the simulator ran, so the two can be compared counter for counter.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence

from tqdm import tqdm

from tiered_tbe.base.mode import SIMULATION
from tiered_tbe.cache.policy import POLICIES as CACHE_POLICIES
from tiered_tbe.cache.stats import CacheStats
from tiered_tbe.hit_rate.runs import (
    Measurement,
    SimOptions,
    base_policy,
    difference,
    no_bar,
    reads_window,
    resolve_policy,
)
from tiered_tbe.traces import Trace

REAL_CACHE_POLICIES = tuple(CACHE_POLICIES)  # the bounds have no real cache
# In the Numba CUDA simulator the cache moves a few thousand lookups a second: small traces only.
REAL_CACHE_SIMULATION_MAX_LOOKUPS = 200_000


def check_real_cache_trace(trace: Trace) -> None:
    """``ValueError`` when ``--real-cache`` would take too long: a large trace in CPU simulation."""
    if SIMULATION and trace.num_lookups > REAL_CACHE_SIMULATION_MAX_LOOKUPS:
        raise ValueError(
            f"--real-cache without a GPU runs SlotCache's kernels in the Numba CUDA simulator (a few thousand "
            f"lookups per second): give a trace of at most {REAL_CACHE_SIMULATION_MAX_LOOKUPS:,} lookups "
            f"(this one has {trace.num_lookups:,}; use fewer --batches or a smaller --batch-size), or run on a GPU")


def check_real_cache_windows(policies: Sequence[str], options: SimOptions) -> None:
    """``ValueError`` when a lookahead window of ``policies`` is longer than the real cache's hints
    reach (``MAX_LOOKAHEAD`` batches after the one prefetched); the simulator has no such limit."""
    from tiered_tbe.cache import MAX_LOOKAHEAD

    windows = sorted({resolve_policy(name, options)[1].lookahead_window for name in policies if reads_window(name)})
    if windows and windows[-1] > MAX_LOOKAHEAD:
        raise ValueError(f"--real-cache: lookahead window {windows[-1]} is longer than the real cache's hints "
                         f"reach (MAX_LOOKAHEAD = {MAX_LOOKAHEAD} batches after the one prefetched)")


@contextlib.contextmanager
def _one_simulated_thread():
    """One CUDA-simulator thread per cache-kernel launch (each is a Python thread); the kernels are
    grid-stride loops, so the result is the same with any count. No effect on a GPU."""
    from tiered_tbe.cache import launch

    threads = launch.SIMULATED_THREADS
    launch.SIMULATED_THREADS = 1
    try:
        yield
    finally:
        launch.SIMULATED_THREADS = threads


def run_slot_cache(trace: Trace, policy: str, num_slots: int, options: SimOptions) -> CacheStats:
    """Drive a real :class:`~tiered_tbe.cache.SlotCache` of ``num_slots`` slots over ``trace`` as training
    with a prefetch pipeline of depth ``options.pipeline_depth`` does (0: serial), and return its
    counters (comparable to ``POLICIES[policy].run``'s, counter for counter).

    Per batch ``j`` (of the batches run, ``options.batches_run(trace)``): (a policy that reads the
    window) ``add_upcoming`` of each batch of ``j+1 .. j+W`` not told yet (``W =
    options.lookahead_window``, at most ``MAX_LOOKAHEAD``; up to the end of the trace, its future
    batches included), at the step of its batch's prefetch, as :class:`~tiered_tbe.PrefetchPipeline`
    does; ``prefetch``; then batch ``j - depth`` finishes: ``mark_dirty`` when training, ``unlock``.
    The counters of the ``options.warmup_batches`` first batches are subtracted.

    The cached table has one fp32 column per row: which rows hit depends on the policy, not on
    the row width, and a narrow row keeps the copies cheap. ``bytes_in`` / ``bytes_out`` are
    rescaled to ``options.row_bytes`` per row.
    """
    import torch

    from tiered_tbe.base.mode import default_device
    from tiered_tbe.cache import CachedTable, SlotCache

    _, options = resolve_policy(policy, options)
    window = options.lookahead_window if reads_window(policy) else 0
    policy = base_policy(policy)
    if policy not in REAL_CACHE_POLICIES:
        raise ValueError(f"no real cache for {policy!r}: only {', '.join(REAL_CACHE_POLICIES)}")
    options.check(trace)
    check_real_cache_windows([policy], options)
    device = default_device()
    weights = torch.zeros(trace.num_rows, 1, dtype=torch.float32, device=device)
    cache = SlotCache([CachedTable(0, trace.num_rows, 1, weights)], num_slots, options.associativity, policy=policy,
                      lfu_decay_interval=options.lfu_decay_interval, device=device)
    rows = torch.from_numpy(trace.rows).to(device)
    offsets = trace.batch_offsets.tolist()
    known_batches = trace.num_batches  # the window sees the future batches too
    in_flight: list[torch.Tensor] = []  # slot_of_index of the batches prefetched and not finished
    next_to_hint = 1  # the first batch not yet told to the cache (add_upcoming)
    before = CacheStats()
    with _one_simulated_thread():
        for j in range(options.batches_run(trace)):
            if j == options.warmup_batches and j:
                before = cache.stats()
            if window:  # each batch once, as it enters the window j+1 .. j+W, at the step of its prefetch
                for k in range(next_to_hint, min(j + window, known_batches - 1) + 1):
                    cache.add_upcoming(rows[offsets[k]:offsets[k + 1]], cache.step + 1 + (k - j))
                next_to_hint = max(next_to_hint, j + window + 1)
            in_flight.append(cache.prefetch(rows[offsets[j]:offsets[j + 1]]))
            if len(in_flight) > options.pipeline_depth:  # the batch prefetched depth steps ago finishes
                cache.unlock(in_flight.pop(0), mark_dirty=options.training)
    stats = difference(cache.stats(), before)
    stats.bytes_in = stats.bytes_in // 4 * options.row_bytes  # 4 bytes per row in this cache
    stats.bytes_out = stats.bytes_out // 4 * options.row_bytes
    return stats


def run_real_cache(trace: Trace, results: Sequence[Measurement], options: SimOptions,
                   progress: bool | None = None) -> list[Measurement]:
    """Set ``real_stats`` of every set-associative measurement in ``results``; return those."""
    chosen = [m for m in results if base_policy(m.policy) in REAL_CACHE_POLICIES]
    with tqdm(total=len(chosen), desc="real cache", unit="run", disable=no_bar(progress), file=sys.stderr) as bar:
        for m in chosen:
            bar.set_postfix_str(f"{m.policy} @ {m.size_label}")
            m.real_stats = run_slot_cache(trace, m.policy, m.num_slots, options)
            bar.update()
    return chosen


def real_cache_device() -> str:
    if SIMULATION:
        return "the Numba CUDA simulator (CPU)"
    import torch

    return torch.cuda.get_device_name()


def disagreements(m: Measurement) -> str:
    """``lookup_hits 120 vs 121, ...``: the counters where the real cache differs (simulator first)."""
    if m.real_stats is None or m.real_cache_agrees:
        return ""
    simulated, real = m.stats.as_dict(), m.real_stats.as_dict()
    return ", ".join(f"{name} {simulated[name]} vs {real[name]}" for name in simulated if simulated[name] != real[name])
