"""How fast the host CPU gathers and scatters cache rows: the staged mover's host side.

The staged row mover (``cache/staged.py``) gathers a batch's missed rows (weights and
optimizer state) from the backing store into pinned staging buffers, and scatters written-back
rows from them, in its own host threads, through ``cache/host_rows.HostRows``. In training on
the H200 machine those copies ran at 8.5 / 6.3 GB/s, where one ``torch.index_select`` of the
weights alone had measured 42-59 GB/s. This script measures each copy the way the mover runs
it (in a worker thread that set its intra-op threads), for each implementation
(``HostRows(copy=...)``) and thread count:

- gather and scatter of ``--rows`` distinct random rows in ascending order, 128 fp32 weights
  and one fp32 of row-wise Adagrad state per row (516 bytes, the benchmark tables' rows);
- both at once, from two threads (the mover's fill and write-back threads), on different rows;
- for ``torch``: the weights alone and the state alone, to show which part costs.

    python tools/bench_host_rows.py                   # 8 GB pinned table, 32K and 72K rows
    python tools/bench_host_rows.py --gb 17 --threads 16 8 4 --record results/measurements.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numba
import torch

from tiered_tbe.base.mode import SIMULATION, describe_mode  # first: picks GPU / simulation mode
from tiered_tbe.benchmarks import common
from tiered_tbe.cache import tiers
from tiered_tbe.cache.host_rows import HOST_COPIES, HostRows, set_copy_threads
from tiered_tbe.cache.tables import CachedTable

DIM = 128
SCRIPT = "tools/bench_host_rows.py"


def backing_table(gb: float, placement: str) -> tuple[CachedTable, object]:
    """One table of ``gb`` GB of 128-dim fp32 rows and its fp32 [rows, 1] state, random values:
    on the CPU (simulation, or ``placement="cpu"``), else in pinned host or managed memory as
    the cache's tiers allocate it. Returns the table and what keeps its memory alive."""
    num_rows = max(int(gb * 1e9) // (4 * (DIM + 1)), 1)
    if placement == "cpu" or SIMULATION:
        weights, state, keep = torch.empty(num_rows, DIM), torch.empty(num_rows, 1), None
    else:
        allocate = tiers._pinned_host_memory if placement == "host" else lambda n: tiers._managed_memory(n, 0)
        memory = allocate(num_rows * 4 * (DIM + 1))
        flat = tiers.host_view(torch.as_tensor(memory, device="cuda").view(torch.float32))
        weights, state = flat[: num_rows * DIM].view(num_rows, DIM), flat[num_rows * DIM:].view(num_rows, 1)
        keep = memory
    generator = torch.Generator().manual_seed(0)
    for begin in range(0, num_rows, 1 << 20):  # touch every page, in chunks (no 17 GB temporary)
        end = min(begin + (1 << 20), num_rows)
        weights[begin:end].uniform_(generator=generator)
        state[begin:end].uniform_(generator=generator)
    return CachedTable(0, num_rows, DIM, weights, state), keep


def in_thread(fn, threads: int):
    """Run ``fn()`` in a new thread that first sets torch's and numba's threads, as the mover's
    threads do; return its result (exceptions re-raised)."""
    result = {}

    def body():
        try:
            set_copy_threads(threads)
            result["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - re-raised below
            result["error"] = error

    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up (numba compiles here)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * common.median(times)


def measure(table: CachedTable, copy: str, threads: int, count: int, repeats: int) -> list[tuple[str, float, int]]:
    """(what, ms, bytes moved) of each copy, each run in threads that set ``threads``."""
    generator = torch.Generator().manual_seed(count)
    chosen = torch.randperm(table.num_rows, generator=generator)[: 2 * count]
    rows, other_rows = chosen[:count].sort().values, chosen[count:].sort().values
    host = HostRows([table], copy)
    staged_weights, staged_state = torch.empty(count, DIM), torch.empty(count, 1)
    other_weights, other_state = torch.rand(count, DIM), torch.rand(count, 1)
    row_bytes = 4 * (DIM + 1)

    def gather():
        host.gather(rows, staged_weights, staged_state)

    def scatter():
        host.scatter(other_rows, other_weights, other_state)

    def both():  # the fill thread's gather beside the write-back thread's scatter
        scatter_thread = threading.Thread(target=lambda: in_thread(scatter, threads))
        scatter_thread.start()
        gather()
        scatter_thread.join()

    results = [("gather", in_thread(lambda: median_ms(gather, repeats), threads), count * row_bytes),
               ("scatter", in_thread(lambda: median_ms(scatter, repeats), threads), count * row_bytes),
               ("gather + scatter at once", in_thread(lambda: median_ms(both, repeats), threads),
                2 * count * row_bytes)]
    if copy == "torch":
        def weights_alone():
            torch.index_select(table.weights, 0, rows, out=staged_weights)

        def state_alone():
            torch.index_select(table.state, 0, rows, out=staged_state)

        results.append(("gather, weights alone", in_thread(lambda: median_ms(weights_alone, repeats), threads),
                        count * 4 * DIM))
        results.append(("gather, state alone", in_thread(lambda: median_ms(state_alone, repeats), threads), count * 4))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/bench_host_rows.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=None,
                        help="backing table size in GB (default 8; 0.05 in simulation)")
    parser.add_argument("--placement", choices=("host", "managed", "cpu"), default="host",
                        help="backing memory (default host: pinned, as Placement.HOST)")
    parser.add_argument("--rows", type=int, nargs="+", default=None,
                        help="rows per copy (default 32768 72000; 1000 in simulation)")
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="threads per copy (default: all cores and half of them)")
    parser.add_argument("--copies", nargs="+", choices=HOST_COPIES, default=list(HOST_COPIES))
    parser.add_argument("--repeats", type=int, default=7)
    common.add_output_flags(parser)
    args = parser.parse_args(argv)
    print(describe_mode())
    cores = os.cpu_count() or 1
    gb = args.gb if args.gb is not None else (0.05 if SIMULATION else 8.0)
    counts = args.rows or ([1000] if SIMULATION else [32768, 72000])
    thread_counts = args.threads or sorted({cores, max(cores // 2, 1)}, reverse=True)
    started = time.perf_counter()
    table, keep = backing_table(gb, args.placement)
    print(f"{args.placement} table of {table.num_rows:,} rows ({gb:g} GB) ready in "
          f"{time.perf_counter() - started:.1f} s; {cores} cores; numba threads {numba.config.NUMBA_NUM_THREADS}")
    lines = [f"Backing table: {args.placement}, {table.num_rows:,} rows of 128 fp32 + 1 fp32 state ({gb:g} GB); "
             f"distinct random rows in ascending order; each copy in a worker thread with that many threads; "
             f"wall-clock medians of {args.repeats}.", "",
             "| copy | threads | rows | what | ms | GB/s |", "| --- | ---: | ---: | --- | ---: | ---: |"]
    results = []
    for copy in args.copies:
        for threads in thread_counts:
            for count in counts:
                for what, ms, nbytes in measure(table, copy, threads, count, args.repeats):
                    gbs = nbytes / ms / 1e6
                    results.append(dict(copy=copy, threads=threads, rows=count, what=what, ms=ms, gbs=gbs))
                    lines.append(f"| {copy} | {threads} | {count:,} | {what} | {ms:.3f} | {gbs:.1f} |")
                    print(lines[-1], flush=True)
    try:
        lines.append(f"\nnumba threading layer: {numba.threading_layer()}")
    except ValueError:
        pass
    del keep
    measurements = [({"what": r["what"], "copy": r["copy"], "threads": r["threads"], "rows": r["rows"],
                      "table_rows": table.num_rows, "placement": args.placement, "repeats": args.repeats},
                     {"ms": r["ms"], "gbs": r["gbs"]}) for r in results]
    common.report(args, SCRIPT, argv if argv is not None else sys.argv[1:], results, lines, measurements)
    return 0


if __name__ == "__main__":
    sys.exit(main())
