"""What shares the bus when cache rows cross it: in-place copies, copy-engine DMA, host copies.

The slot cache's prefetch fills missed rows into slots and writes dirty victims back. This
script measures, on one backing table in pinned host or managed memory (516-byte rows: 128
fp32 weights and one fp32 of row-wise Adagrad state, distinct random rows in ascending order,
slots at random), each way those bytes can move and which of them overlap:

- the copy kernel (``ZeroCopyMover.copy_rows``, SMs reading and writing the table in place):
  a fill of ``--fill-rows`` rows, a write-back of ``--back-rows`` others, one after the other,
  and at once on two streams, at each grid cap of ``--blocks``;
- a DMA of ``--back-rows`` staged rows (HBM to pinned memory, the copy engines), alone and
  beside the fill;
- the host scatter of ``--back-rows`` rows into the table (``HostRows``, the staged mover's
  host side, ``--threads`` threads), each repeat on rows it has not written before (the
  first host touch of a page is what a training step pays), alone and beside two fills.

The table is written by the GPU first, as a module initialises it, so the host has not touched
its pages (``--host-touch``: the host writes every page too, first). Medians of ``--repeats``
(CUDA events for device work, wall clock for host work).

    python benchmarks/bench_bus.py --placement managed --gb 17 --record
"""

from __future__ import annotations

import argparse
import itertools
import sys
import threading
import time

import torch

from tiered_tbe.base.codes import Placement
from tiered_tbe.base.mode import SIMULATION, default_device, describe_mode  # before triton / numba: picks the mode
from tiered_tbe.benchmarks import common
from tiered_tbe.cache import _kernels, tiers
from tiered_tbe.cache.host_rows import HostRows, set_copy_threads
from tiered_tbe.cache.launch import KernelLauncher
from tiered_tbe.cache.tables import CachedTable
from tiered_tbe.cache.zero_copy import ZeroCopyMover

DIM = 128
ROW_BYTES = 4 * (DIM + 1)
SCRIPT = "bench_bus"


def on_two_streams(first, second):
    """Run ``first()`` and ``second()`` on two side streams after the current one, joined back."""
    if SIMULATION:
        return lambda: (first(), second())
    streams = torch.cuda.Stream(), torch.cuda.Stream()

    def both():
        current = torch.cuda.current_stream()
        for stream, work in zip(streams, (first, second)):
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                work()
        for stream in streams:
            current.wait_stream(stream)

    return both


def measure(args) -> list[tuple[str, int, int, float, int]]:
    """(what, blocks, rows, ms, bytes moved) of every measurement."""
    device = default_device()
    num_rows = max(int(args.gb * 1e9) // ROW_BYTES, 4 * (args.fill_rows + args.back_rows))
    placement = Placement.MANAGED if args.placement == "managed" else Placement.HOST
    weights = tiers.allocate(placement, num_rows * DIM, torch.float32, device).tensor.view(num_rows, DIM)
    state = tiers.allocate(placement, num_rows, torch.float32, device).tensor.view(num_rows, 1)
    weights.zero_()  # written by the device, as a module initialises its tables
    state.zero_()
    if args.host_touch:  # then written by the host too: does a page the host has touched scatter faster?
        common.synchronize()
        for view in (tiers.host_view(weights), tiers.host_view(state)):
            for begin in range(0, view.shape[0], 1 << 20):
                view[begin: begin + (1 << 20)].zero_()
    slots = args.fill_rows + args.back_rows
    cache_weights, cache_state = torch.randn(slots, DIM, device=device), torch.randn(slots, 1, device=device)
    table = CachedTable(0, num_rows, DIM, weights, state)
    mover = ZeroCopyMover(cache_weights, cache_state, [table], device, KernelLauncher(device), num_rows)
    generator = torch.Generator().manual_seed(0)
    rows = torch.randperm(num_rows, generator=generator)
    slot_order = torch.randperm(slots, generator=generator).to(device)
    fill_rows = rows[: args.fill_rows].sort().values.to(device)
    back_rows = rows[args.fill_rows: slots].sort().values.to(device)
    fill_slots, back_slots = slot_order[: args.fill_rows], slot_order[args.fill_rows:]
    fill_count = torch.tensor([args.fill_rows], device=device)
    back_count = torch.tensor([args.back_rows], device=device)

    def fill():
        mover.copy_rows(fill_rows, _kernels.COPY_EVERY_ROW, fill_rows, fill_slots, to_backing=False,
                        num_entries=fill_count)

    def write_back():
        mover.copy_rows(back_rows, _kernels.COPY_EVERY_ROW, back_rows, back_slots, to_backing=True,
                        num_entries=back_count)

    fill_bytes, back_bytes = args.fill_rows * ROW_BYTES, args.back_rows * ROW_BYTES
    results = []
    for blocks in args.blocks:
        mover.copy_blocks = blocks
        for what, fn, nbytes in (("fill in place", fill, fill_bytes), ("write-back in place", write_back, back_bytes),
                                 ("fill, then write-back", lambda: (write_back(), fill()), fill_bytes + back_bytes),
                                 ("fill and write-back on two streams", on_two_streams(write_back, fill),
                                  fill_bytes + back_bytes)):
            results.append((what, blocks, args.fill_rows if "fill" in what else args.back_rows,
                            common.event_ms(fn, args.repeats), nbytes))
    mover.copy_blocks = max(args.blocks)

    # The write-back staged: its rows in HBM, a DMA to pinned memory, a host scatter.
    staged_weights, staged_state = cache_weights[back_slots], cache_state[back_slots]
    pinned = dict(pin_memory=not SIMULATION)
    pinned_weights, pinned_state = torch.empty(args.back_rows, DIM, **pinned), torch.empty(args.back_rows, 1, **pinned)

    def dma():
        pinned_weights.copy_(staged_weights, non_blocking=True)
        pinned_state.copy_(staged_state, non_blocking=True)

    results.append(("DMA of staged rows to pinned memory", 0, args.back_rows, common.event_ms(dma, args.repeats),
                    back_bytes))
    results.append(("DMA beside the fill, on two streams", 0, args.fill_rows + args.back_rows,
                    common.event_ms(on_two_streams(dma, fill), args.repeats), fill_bytes + back_bytes))

    host = HostRows([table], "numba")
    unwritten = rows[slots:]  # rows neither copy above touched, a fresh set for every scatter
    scatters = itertools.cycle([unwritten[i * args.back_rows: (i + 1) * args.back_rows].sort().values
                                for i in range(max(len(unwritten) // args.back_rows, 1))])

    def scatter():
        host.scatter(next(scatters), pinned_weights, pinned_state)

    for threads in args.threads:
        set_copy_threads(threads)
        scatter()  # numba compiles here
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            scatter()
            times.append((time.perf_counter() - start) * 1e3)
        results.append((f"host scatter, fresh rows, {threads} threads", 0, args.back_rows, common.median(times),
                        back_bytes))
        beside = []
        for _ in range(args.repeats):
            common.synchronize()
            took = []

            def timed_scatter(threads=threads, took=took):
                set_copy_threads(threads)
                took.append(time.perf_counter())
                scatter()
                took.append(time.perf_counter())

            worker = threading.Thread(target=timed_scatter)
            worker.start()
            fill()
            fill()
            common.synchronize()
            worker.join()
            beside.append((took[1] - took[0]) * 1e3)
        results.append((f"host scatter beside two fills, {threads} threads", 0, args.back_rows, common.median(beside),
                        back_bytes))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--placement", choices=("host", "managed"), default="managed",
                        help="backing memory (default managed, as Placement.MANAGED_CACHED)")
    parser.add_argument("--gb", type=float, default=None,
                        help="backing table size in GB (default 17; tiny in simulation)")
    parser.add_argument("--fill-rows", type=int, default=None, help="rows filled (default 72000; 40 in simulation)")
    parser.add_argument("--back-rows", type=int, default=None,
                        help="rows written back (default 55000; 30 in simulation)")
    parser.add_argument("--blocks", type=int, nargs="+", default=None,
                        help="grid caps of the copy kernel (default 16384 528 132 66; 16384 in simulation)")
    parser.add_argument("--threads", type=int, nargs="+", default=None, help="host scatter threads (default 16 8)")
    parser.add_argument("--host-touch", action="store_true",
                        help="write every page of the table from the host too, before measuring")
    parser.add_argument("--repeats", type=int, default=None,
                        help="repeats per measurement (default 10; 2 in simulation)")
    common.add_output_flags(parser)
    args = parser.parse_args(argv)
    args.results_file = args.results_file or common.RESULTS
    args.gb = args.gb if args.gb is not None else (0.0 if SIMULATION else 17.0)
    args.fill_rows = args.fill_rows or (40 if SIMULATION else 72000)
    args.back_rows = args.back_rows or (30 if SIMULATION else 55000)
    args.blocks = args.blocks or ([16384] if SIMULATION else [16384, 528, 132, 66])
    args.threads = args.threads or ([2] if SIMULATION else [16, 8])
    args.repeats = args.repeats or (2 if SIMULATION else 10)
    print(describe_mode())
    results = measure(args)
    written = "the device, then the host" if args.host_touch else "the device"
    lines = [f"Backing table: {args.placement}, {args.gb:g} GB of 516-byte rows (128 fp32 + 1 fp32 state), written "
             f"by {written} first; distinct random rows ascending; medians of {args.repeats}.", "",
             "| what | copy blocks (most) | rows | ms | GB/s |", "| --- | ---: | ---: | ---: | ---: |"]
    for what, blocks, rows, ms, nbytes in results:
        lines.append(f"| {what} | {blocks or '-'} | {rows:,} | {ms:.3f} | {nbytes / ms / 1e6:.1f} |")
    records = [dict(what=w, blocks=b, rows=r, ms=ms, gbs=n / ms / 1e6) for w, b, r, ms, n in results]
    common.report(args, SCRIPT, argv if argv is not None else sys.argv[1:], records, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
