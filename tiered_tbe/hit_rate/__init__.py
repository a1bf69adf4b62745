"""``tiered-tbe bench hit-rate``: how large must the slot cache be, and what does it move?

Runs a lookup trace (:mod:`tiered_tbe.traces`) through the exact CPU simulator of the slot
cache (:class:`tiered_tbe.cache.simulator.CacheSimulator`) for every policy and cache size asked for
(every policy of the cache's registry, :data:`tiered_tbe.cache.policy.POLICIES`: LRU, LFU, and
lookahead told the rows of the next ``--lookahead-window`` batches, by default 64 as
:class:`~tiered_tbe.PrefetchPipeline` tells the cache; a comma-separated list of windows gives one
``lookahead(W)`` policy per window),
beside two bounds (:mod:`tiered_tbe.cache.bounds`): fully associative LRU (no set conflicts)
and offline Belady (knows the whole future). Prints a table; writes CSV, JSON and a PNG plot
on request; ``--target-hit-rate`` finds the smallest cache reaching a hit rate, per policy;
``--record PATH`` appends one JSON line per policy and size to ``PATH`` (:mod:`tiered_tbe.records`).

Steady state of a prefetch pipeline:

- ``--pipeline-depth D`` (default 0, serial training): the rows of the ``D`` batches prefetched
  before the one being prefetched stay locked, as :class:`~tiered_tbe.PrefetchPipeline` with
  ``depth=D`` holds them until their backward (the simulator's ``pipeline_depth``), for LRU, LFU
  and lookahead alike. The bounds ignore it (they lock only the batch being prefetched).
- ``--warmup N`` (default 0): the first ``N`` batches run but are not counted: every counter
  (hit rates, rows moved and bytes per batch) is over the batches after them, for every policy
  and both bounds. The policies count the two parts in one run of the simulator; a bound runs
  over the whole trace and over its first ``N`` batches and the counts are subtracted, which is
  exact: fully associative LRU after ``N`` batches does not depend on the batches after them,
  and Belady's prefix run is given the next uses of the whole trace, so it makes the same
  choices as the whole run over those batches.
- ``--full-window``: the trace gets ``max(--lookahead-window)`` more batches (zipf, drift,
  criteo; a file's last batches instead) that no policy or bound runs, only lookahead's window
  and Belady's next uses see. It changes Belady's traffic (without a future, Belady reads the
  rows it will "never" use again in place instead of caching them, so its rows moved over the
  last batches are too low), hardly the policies' counters: lookahead evicts rows unused in its
  window first, then the row needed latest, so a shrunk window changes which rows not needed
  before the trace's end go first, not how many rows miss, move or are written back; which
  needed rows stay can differ only where the lowest way breaks a tie between rows of the same
  next and last use (Criteo at Zipf 1.05, W=64: 1 lookup hit of 34M, every other counter equal).

``--real-cache`` also drives the real cache, :class:`tiered_tbe.cache.SlotCache` (its Numba
kernels: on the GPU, or in the Numba CUDA simulator on a CPU, where only small traces finish),
over the same trace for every set-associative policy and size, as training does (per
batch: lookahead's ``add_upcoming`` of the batch that enters the window of the next
``--lookahead-window`` batches, at most ``MAX_LOOKAHEAD`` = 64; ``prefetch``;
then the batch prefetched ``--pipeline-depth`` batches earlier: ``mark_dirty`` when training,
``unlock``), prints both, and exits with status 1 if any counter
differs from the simulator's.

Columns of the table:

- ``hit% lookup``: lookups whose row was cached when their batch was prefetched;
  ``hit% unique``: the same per unique row of a batch (what the prefetch sees).
- ``moved/batch``: rows copied into the cache plus dirty rows written back, per batch;
  ``moved/lru``: the same relative to set-associative LRU's at the same size (when LRU ran).
- ``bus/batch``: bytes over the host bus per batch: rows (and optimizer state) copied in and
  written back, plus the rows of misses that found no slot, read in place by forward and read
  and written in place by backward (training).
- ``vs belady``: lookup hit rate divided by Belady's at the same size.

Modules, one job each:

- :mod:`~tiered_tbe.hit_rate.runs`: the policies and bounds (``POLICIES``), ``SimOptions``,
  ``measure`` and ``sweep``;
- :mod:`~tiered_tbe.hit_rate.capacity`: cache sizes and ``find_smallest_cache``;
- :mod:`~tiered_tbe.hit_rate.real_cache`: the ``--real-cache`` driver of ``SlotCache``;
- :mod:`~tiered_tbe.hit_rate.report`, :mod:`~tiered_tbe.hit_rate.plot`: tables, CSV, JSON, records
  (through :mod:`tiered_tbe.records`, as the GPU benchmarks), the figure;
- :mod:`~tiered_tbe.hit_rate.command`: the command line (``build_parser``, ``run``).

Example::

    tiered-tbe bench hit-rate --trace zipf --alpha 1.05 --rows 1000000 --cache-sizes 1%,5%,20% \\
        --policies lru,lfu,lookahead,fa-lru,belady --lookahead-window 8 --target-hit-rate 0.9 \\
        --csv out.csv --plot out.png

or from Python (the names below are importable from ``tiered_tbe.hit_rate``)::

    trace = zipf_trace(num_rows=1_000_000, alpha=1.05, batch_size=2048, bag_size=20, num_batches=100)
    options = SimOptions(associativity=32)
    results = sweep(trace, ["lru", "belady"], [("5%", 50_016)], options)
    print(format_results(results))
    print(find_smallest_cache(trace, "lru", 0.8, options, known=results).found.num_slots)
"""

from tiered_tbe.hit_rate.capacity import find_smallest_cache
from tiered_tbe.hit_rate.command import build_parser, run
from tiered_tbe.hit_rate.report import format_results
from tiered_tbe.hit_rate.runs import POLICIES, SimOptions, measure, sweep

__all__ = ["POLICIES", "SimOptions", "build_parser", "find_smallest_cache", "format_results", "measure", "run", "sweep"]
