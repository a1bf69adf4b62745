"""Can the copy engines move scattered cache rows? ``cuMemcpyBatchAsync`` against the copy kernel.

The slot cache's zero-copy mover moves a batch's missed rows and dirty victims with a copy
kernel whose warps read and write the backing store in place: it needs many SMs to keep the bus
busy (each load waits ~1 us on the bus), so beside the training kernels of a pipelined step
one of the two waits for the other. CUDA 12.8's batched memcpy (``cuMemcpyBatchAsync``: one
call, one descriptor per row, ``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE``) hands the same
copies to the copy engines instead. This script measures, on one backing table in pinned or
managed memory (``--gb``, 128 fp32 weights a row, distinct random rows in ascending order, HBM
rows at random):

- each way to move ``--rows`` rows host -> HBM (a fill) and HBM -> host (a write-back): the
  copy kernel in place, and the batched DMA with 512-byte descriptors (weights alone) and
  516-byte ones (weights and a row-wise state word stored with the row);
- fill and write-back at once (two streams);
- the host's cost of one batched call (building nothing: the arrays are ready);
- a memory-bound kernel of the training step's size alone, beside the copy kernel and beside
  the batched DMA: which mover leaves the SMs to training.

Medians of ``--repeats`` (CUDA events). GPU only: in simulation it says so and exits 0.

    python benchmarks/bench_batched_dma.py --placement host --gb 17 --rows 72000
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time

import numpy as np
import torch

from tiered_tbe.base.codes import Placement
from tiered_tbe.base.mode import SIMULATION, default_device, describe_mode  # before triton / numba: picks the mode
from tiered_tbe.benchmarks import common
from tiered_tbe.benchmarks.bench_bus import on_two_streams
from tiered_tbe.cache import _kernels, tiers
from tiered_tbe.cache.launch import KernelLauncher
from tiered_tbe.cache.tables import CachedTable
from tiered_tbe.cache.zero_copy import ZeroCopyMover

SCRIPT = "bench_batched_dma"
DIM = 128


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]  # CUmemLocation


class _CopyAttributes(ctypes.Structure):
    _fields_ = [("src_access_order", ctypes.c_int), ("src_location", _Location),  # CUmemcpyAttributes
                ("dst_location", _Location), ("flags", ctypes.c_uint)]


ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1  # CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE


class BatchedCopy:
    """``cuMemcpyBatchAsync`` through ctypes: numpy arrays of pointers and sizes go straight in."""

    def __init__(self, flags: int = FLAG_PREFER_OVERLAP_WITH_COMPUTE):
        driver = ctypes.CDLL("libcuda.so.1")
        self.v2 = hasattr(driver, "cuMemcpyBatchAsync_v2")  # CUDA 13: no failIdx argument
        self.call = driver.cuMemcpyBatchAsync_v2 if self.v2 else driver.cuMemcpyBatchAsync
        self.attributes = _CopyAttributes(ACCESS_ORDER_STREAM, _Location(0, 0), _Location(0, 0), flags)
        self.first = (ctypes.c_size_t * 1)(0)
        self.fail = ctypes.c_size_t(0)

    def __call__(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> None:
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        args = [dsts.ctypes.data_as(ctypes.c_void_p), srcs.ctypes.data_as(ctypes.c_void_p),
                sizes.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(len(sizes)), ctypes.byref(self.attributes),
                self.first, ctypes.c_size_t(1)]
        args += [stream] if self.v2 else [ctypes.byref(self.fail), stream]
        result = self.call(*args)
        if result != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync failed: CUresult {result} (stream {stream.value}, v2 {self.v2})")


def measure(args) -> list[tuple[str, float, int]]:
    """(what, ms, bytes moved) of every measurement."""
    device = default_device()
    placement = Placement.MANAGED if args.placement == "managed" else Placement.HOST
    row_bytes = 4 * (DIM + 1)
    num_rows = max(int(args.gb * 1e9) // row_bytes, 4 * args.rows)
    # Rows of 129 words: 128 weights and the state word beside them (state_layout="with_rows").
    table = tiers.allocate(placement, num_rows * (DIM + 1), torch.float32, device).tensor.view(num_rows, DIM + 1)
    table.zero_()
    slots = 2 * args.rows
    cache = torch.randn(slots, DIM + 1, device=device)
    cached = CachedTable(0, num_rows, DIM, table[:, :DIM], table[:, DIM:])
    mover = ZeroCopyMover(cache[:, :DIM], cache[:, DIM:], [cached], device, KernelLauncher(device), num_rows)
    generator = torch.Generator().manual_seed(0)
    rows = torch.randperm(num_rows, generator=generator)
    slot_order = torch.randperm(slots, generator=generator)
    fill_rows, back_rows = rows[: args.rows].sort().values, rows[args.rows: slots].sort().values
    fill_slots, back_slots = slot_order[: args.rows], slot_order[args.rows:]
    count = torch.tensor([args.rows], device=device)
    on_device = [t.to(device) for t in (fill_rows, back_rows, fill_slots, back_slots)]

    def kernel_fill():
        mover.copy_rows(on_device[0], _kernels.COPY_EVERY_ROW, on_device[0], on_device[2], to_backing=False,
                        num_entries=count)

    def kernel_back():
        mover.copy_rows(on_device[1], _kernels.COPY_EVERY_ROW, on_device[1], on_device[3], to_backing=True,
                        num_entries=count)

    copy = BatchedCopy()

    def pointers(base: int, index: torch.Tensor) -> np.ndarray:
        return (base + index.numpy().astype(np.uint64) * np.uint64(row_bytes)).astype(np.uint64)

    table_base, cache_base = table.data_ptr(), cache.data_ptr()
    descriptors = {}
    for size in (4 * DIM, row_bytes):
        sizes = np.full(args.rows, size, dtype=np.uint64)
        descriptors[size] = (
            (pointers(cache_base, fill_slots), pointers(table_base, fill_rows), sizes),  # fill: host -> HBM
            (pointers(table_base, back_rows), pointers(cache_base, back_slots), sizes))  # write-back
    results = []
    fill_bytes = args.rows * row_bytes
    measured = [("copy kernel: fill", kernel_fill, fill_bytes), ("copy kernel: write-back", kernel_back, fill_bytes),
                ("copy kernel: both, two streams", on_two_streams(kernel_fill, kernel_back), 2 * fill_bytes)]
    for size, (fill, back) in descriptors.items() if not args.skip_batched else ():
        nbytes = args.rows * size
        measured += [(f"batched DMA {size} B: fill", lambda f=fill: copy(*f), nbytes),
                     (f"batched DMA {size} B: write-back", lambda b=back: copy(*b), nbytes),
                     (f"batched DMA {size} B: both, two streams",
                      on_two_streams(lambda f=fill: copy(*f), lambda b=back: copy(*b)), 2 * nbytes)]
    contiguous = torch.empty(args.rows, DIM + 1, pin_memory=True)
    hbm = torch.empty(args.rows, DIM + 1, device=device)
    measured += [("one contiguous DMA (pinned -> HBM)", lambda: hbm.copy_(contiguous, non_blocking=True), fill_bytes),
                 ("one contiguous DMA (HBM -> pinned)", lambda: contiguous.copy_(hbm, non_blocking=True), fill_bytes)]
    for what, fn, nbytes in measured:
        results.append((what, common.event_ms(fn, args.repeats, warmup=2), nbytes))

    if not args.skip_batched:
        # Correctness of the batched copy: the filled slots hold their rows.
        table[fill_rows.to(device)] = torch.randn(args.rows, DIM + 1, device=device)
        copy(*descriptors[row_bytes][0])
        torch.cuda.synchronize()
        same = torch.equal(cache[fill_slots.to(device)], table[fill_rows.to(device)])
        print(f"batched fill lands every row bitwise: {same}")

        # Host cost of one batched call of args.rows copies.
        host = []
        for _ in range(args.repeats):
            begin = time.perf_counter()
            copy(*descriptors[row_bytes][0])
            host.append((time.perf_counter() - begin) * 1e3)
        torch.cuda.synchronize()
        results.append((f"host ms of one batched call ({args.rows} descriptors)", common.median(host), 0))

    # What each mover leaves to training: a memory-bound kernel (4 x a 256 MB copy) beside it, on
    # a stream of equal or higher priority (a PrefetchPipeline runs the steps on a high one).
    source = torch.randn(args.work_mb * (1 << 20) // 4, device=device)
    target = torch.empty_like(source)

    def work():
        for _ in range(4):
            target.copy_(source)

    results.append((f"HBM copy x4, {args.work_mb} MB, alone", common.event_ms(work, args.repeats), 0))
    movers = [(f"copy kernel, {blocks} blocks", blocks, lambda: (kernel_back(), kernel_fill()))
              for blocks in args.blocks]
    if not args.skip_batched:
        fill, back = descriptors[row_bytes]
        movers.append(("batched DMA", None, lambda: (copy(*back), copy(*fill))))
    side = torch.cuda.Stream()
    for priority in ("equal", "high"):
        training = torch.cuda.Stream(priority=-1 if priority == "high" else 0)
        for what, blocks, mover_fn in movers:
            if blocks is not None:
                mover.copy_blocks = blocks
            times, mover_times = [], []
            for _ in range(args.repeats + 2):
                torch.cuda.synchronize()
                marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
                with torch.cuda.stream(side):
                    marks[2].record()
                    mover_fn()
                    marks[3].record()
                with torch.cuda.stream(training):
                    marks[0].record()
                    work()
                    marks[1].record()
                torch.cuda.synchronize()
                times.append(marks[0].elapsed_time(marks[1]))
                mover_times.append(marks[2].elapsed_time(marks[3]))
            results.append((f"HBM copy x4 beside {what} (fill + write-back), {priority} priority",
                            common.median(times[2:]), 0))
            results.append((f"  {what} (fill + write-back) beside it", common.median(mover_times[2:]), 2 * fill_bytes))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--placement", choices=("host", "managed"), default="host",
                        help="backing memory (default host: pinned)")
    parser.add_argument("--gb", type=float, default=17.0, help="backing table size in GB (default 17)")
    parser.add_argument("--rows", type=int, default=72000, help="rows filled and rows written back (default 72000)")
    parser.add_argument("--repeats", type=int, default=10, help="timed repeats (default 10)")
    parser.add_argument("--work-mb", type=int, default=256, help="size of the memory-bound kernel's buffers")
    parser.add_argument("--blocks", type=int, nargs="+", default=[16384, 528, 132, 66],
                        help="grid caps of the copy kernel beside the memory-bound kernel")
    parser.add_argument("--skip-batched", action="store_true", help="leave the batched DMA out (it is slow)")
    common.add_output_flags(parser)
    args = parser.parse_args(argv)
    print(f"{SCRIPT}: {describe_mode()}")
    if SIMULATION:
        print("bench_batched_dma: the copy engines exist only on a GPU; nothing measured.")
        return 0
    # cuMemcpyBatchAsync refuses the legacy default stream: everything runs on a stream of its own.
    with torch.cuda.stream(torch.cuda.Stream()):
        results = measure(args)
    rows = [[what, common.fmt(ms), common.fmt(nbytes / ms / 1e6, ".1f") if nbytes else "-"]
            for what, ms, nbytes in results]
    from tiered_tbe import records

    table = records.markdown_table(["what", "ms", "GB/s"], rows)
    common.report(args, SCRIPT, sys.argv[1:] if argv is None else argv, results, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
