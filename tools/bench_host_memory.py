"""How fast the GPU's SMs read and write scattered rows of host memory in place, by how the memory was made.

The zero-copy row mover (``cache/zero_copy.py``) and the kernels' reads of rows left in the backing
store reach host memory row by row. On the H200 machine 512-byte rows scattered over a 17 GB
table moved ~3x faster out of managed memory than out of ``cudaHostAlloc`` memory, and the ragged
shape's copy kernel moved the same rows 1.76 ms a batch in one process and 2.14-2.32 ms in others
(docs/performance.md). A GPU reaches host pages through its own page tables, one translation a
page: a 2 MiB page covers 512 times the rows of a 4 KiB one. This script times, for each kind of
memory, a gather of ``--rows`` random rows into HBM, a scatter of as many back, and both one after
the other (a prefetch's fills and write-backs), both at once on two streams, and both interleaved in
one kernel (each program writes one row back and reads another in, the order of the zero-copy mover's
``move_rows_kernel``), for several row widths, and reports how much of the host's memory the kernel
backs with transparent huge pages after the allocation. The last two ask whether the SMs' reads and
writes of host memory add up when they cross the bus at the same time, as a copy engine's each way do:
if the interleaved kernel moves more than the gather and the scatter one after the other, a backward that
wrote its rows read in place while reading the next batch's would gain (docs/performance.md).

- ``host_alloc``: ``cudaHostAlloc`` (``Placement.HOST`` today);
- ``registered``, ``registered_huge_pages``: memory this process maps, advised into 4 KiB or 2 MiB
  pages, pinned with ``cudaHostRegister`` (``TIERED_TBE_HOST_MEMORY`` selects them for ``HOST``);
- ``managed``: ``cudaMallocManaged`` advised to stay on the host (``Placement.MANAGED``), its pages placed
  as the GPU first writes them (as a module's tables are); ``managed_prefetched``: the same, every page
  placed on the host first in one ``cudaMemPrefetchAsync``; ``managed_host_written``: written by the host
  first (the driver then places pages as the CPU faults them).

    python tools/bench_host_memory.py                        # 16 GB a kind, 262144 rows
    python tools/bench_host_memory.py --gb 32 --kinds registered_huge_pages managed --record results/measurements.jsonl

In simulation every kind is a CPU tensor and the times mean nothing (the logic is tested so).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch
import triton
import triton.language as tl

from tiered_tbe.base.host_memory import meminfo_bytes, transparent_huge_pages
from tiered_tbe.base.mode import SIMULATION, describe_mode  # first: picks GPU / simulation mode
from tiered_tbe.benchmarks import common
from tiered_tbe.cache import tiers

SCRIPT = "tools/bench_host_memory.py"
MANAGED_KINDS = ("managed", "managed_prefetched", "managed_host_written")
KINDS = (*tiers.HOST_MEMORY_KINDS, *MANAGED_KINDS)
WAYS = ("gather", "scatter", "gather + scatter", "two streams", "interleaved")
MOVES_TWICE = ("gather + scatter", "two streams", "interleaved")  # ways that move twice the rows


def host_memory(kind: str, nbytes: int) -> tuple[torch.Tensor, object]:
    """A flat float32 tensor over ``nbytes`` of ``kind`` memory that the GPU reads and writes in place (a
    CPU tensor in simulation), and the object that frees the memory when it goes."""
    if SIMULATION:
        return torch.empty(nbytes // 4), None
    if kind not in MANAGED_KINDS:
        memory = tiers._pinned_host_memory(nbytes, kind)
        return torch.as_tensor(memory, device="cuda").view(torch.float32), memory
    memory = tiers._managed_memory(nbytes, torch.cuda.current_device())
    flat = torch.as_tensor(memory, device="cuda").view(torch.float32)
    if kind == "managed_prefetched":
        tiers.prefetch_managed_to_host(memory.pointer, nbytes)
    elif kind == "managed_host_written":
        tiers.host_view(flat).fill_(0.25)
    return flat, memory


@triton.jit
def _interleaved_kernel(
    table_ptr,  # fp32 [R, DIM]: the rows in host memory, read and written in place
    filled_ptr,  # int64 [C]: the rows each program reads in
    staged_ptr,  # fp32 [C, DIM] in HBM: where they land
    written_ptr,  # int64 [C]: the rows each program writes back
    leaving_ptr,  # fp32 [C, DIM] in HBM: what it writes
    DIM: tl.constexpr,  # fp32 a row
    BLOCK: tl.constexpr,  # the next power of two of DIM
):
    """Program p writes ``leaving[p]`` to row ``written[p]``, then reads row ``filled[p]`` into ``staged[p]``:
    both directions of the bus in one warp, as a prefetch's write-back and fill of one slot."""
    p = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    inside = columns < DIM
    written = tl.load(written_ptr + p)
    filled = tl.load(filled_ptr + p)
    tl.store(table_ptr + written * DIM + columns, tl.load(leaving_ptr + p * DIM + columns, mask=inside), mask=inside)
    tl.store(staged_ptr + p * DIM + columns, tl.load(table_ptr + filled * DIM + columns, mask=inside), mask=inside)


def interleave_rows(table: torch.Tensor, filled: torch.Tensor, staged: torch.Tensor, written: torch.Tensor,
                    leaving: torch.Tensor) -> None:
    """``table[written] = leaving`` and ``staged = table[filled]`` in one launch, a program a row pair
    (``filled`` and ``written`` distinct: a row in both is a race). table fp32 [R, D] contiguous; filled,
    written int64 [C]; staged, leaving fp32 [C, D]."""
    dim = table.shape[1]
    _interleaved_kernel[(filled.numel(),)](table, filled, staged, written, leaving, DIM=dim,
                                           BLOCK=triton.next_power_of_2(dim), num_warps=1)


def measure(flat: torch.Tensor, dim: int, count: int, repeats: int, seed: int) -> dict[str, float]:
    """Ms of each way of moving ``count`` random rows of ``dim`` fp32 between the table over ``flat`` and
    HBM (disjoint row sets for the gather and the scatter, each in ascending order, as a prefetch's)."""
    table = flat[: flat.numel() // dim * dim].view(-1, dim)
    device = table.device
    generator = torch.Generator(device).manual_seed(seed)
    # Even rows read, odd rows written: the two sets never share a row (the interleaved kernel's race).
    rows = 2 * torch.randint(table.shape[0] // 2, (2 * count,), device=device, generator=generator)
    filled, written = rows[:count].sort().values, (rows[count:] + 1).sort().values
    staged = torch.empty(count, dim, device=device)
    leaving = torch.rand(count, dim, device=device, generator=generator)

    def gather():
        torch.index_select(table, 0, filled, out=staged)

    def scatter():
        table.index_copy_(0, written, leaving)

    def both():
        scatter()
        gather()

    side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def two_streams():  # the scatter on a side stream beside the gather
        common.beside(scatter, gather, side)

    def interleaved():
        interleave_rows(table, filled, staged, written, leaving)

    return {way: common.event_ms(fn, repeats) for way, fn in zip(WAYS, (gather, scatter, both, two_streams,
                                                                        interleaved))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/bench_host_memory.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=None, help="memory of each kind in GB (default 16; 0.01 "
                        "in simulation)")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--dims", type=int, nargs="+", default=[16, 32, 64, 128],
                        help="fp32 elements a row (default 16 32 64 128: 64- to 512-byte rows)")
    parser.add_argument("--rows", type=int, default=None, help="rows a copy moves (default 262144; 500 in "
                        "simulation)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    common.add_output_flags(parser)
    args = parser.parse_args(argv)
    if any(dim < 1 for dim in args.dims) or (args.rows is not None and args.rows < 1) or args.repeats < 1:
        parser.error("--dims, --rows and --repeats must be >= 1")
    print(describe_mode())
    if SIMULATION:
        print(common.SIMULATION_NOTE)
    gb = args.gb if args.gb is not None else (0.01 if SIMULATION else 16.0)
    count = args.rows or (500 if SIMULATION else 262144)
    nbytes = int(gb * 1e9)
    if nbytes < 2 * 4 * max(args.dims):
        parser.error(f"--gb {gb:g} holds fewer than two rows of {max(args.dims)} fp32")
    pages = transparent_huge_pages() or "unknown"
    lines = [f"{gb:g} GB of each kind, written once by the GPU; {count} random rows a copy (ascending), fp32; "
             f"GB/s of rows moved (both ways at once move twice the rows), median of {args.repeats} (CUDA "
             f"events); transparent huge pages: {pages}.", "",
             "| memory | huge pages GB | row bytes | " + " | ".join(f"{way} GB/s" for way in WAYS) + " | made in s |",
             "| --- | ---: | ---: | " + " | ".join("---:" for _ in WAYS) + " | ---: |"]
    results = []
    for kind in args.kinds:
        huge_before = meminfo_bytes("AnonHugePages")
        started = time.perf_counter()
        flat, keep = host_memory(kind, nbytes)
        flat.fill_(0.5)  # every page touched, by the GPU (a module fills its tables on the device too)
        common.synchronize()
        made_s = time.perf_counter() - started
        huge_after = meminfo_bytes("AnonHugePages")
        huge_gb = None if huge_before is None or huge_after is None else max(huge_after - huge_before, 0) / 1e9
        for dim in args.dims:
            ms = measure(flat, dim, count, args.repeats, args.seed)
            row_bytes = 4 * dim
            gbs = {way: (2 if way in MOVES_TWICE else 1) * count * row_bytes / ms[way] / 1e6 for way in WAYS}
            results.append(dict(kind=kind, row_bytes=row_bytes, huge_page_gb=huge_gb, made_s=made_s,
                                **{f"{way}_ms": ms[way] for way in WAYS}, **{f"{way}_gbs": gbs[way] for way in WAYS}))
            huge = "-" if huge_gb is None else f"{huge_gb:.1f}"
            lines.append(f"| {kind} | {huge} | {row_bytes} | " + " | ".join(f"{gbs[way]:.1f}" for way in WAYS)
                         + f" | {made_s:.1f} |")
            print(lines[-1], flush=True)
        del flat, keep
        gc.collect()
        if not SIMULATION:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    measurements = [({"what": "host memory in place", "memory": r["kind"], "gb": gb, "rows": count,
                      "row_bytes": r["row_bytes"], "repeats": args.repeats, "transparent_huge_pages": pages},
                     {key: value for key, value in r.items() if key not in ("kind", "row_bytes")}) for r in results]
    common.report(args, SCRIPT, argv if argv is not None else sys.argv[1:], results, lines, measurements)
    return 0


if __name__ == "__main__":
    sys.exit(main())
