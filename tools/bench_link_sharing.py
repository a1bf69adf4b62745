"""Whether a kernel bound by the host link leaves the GPU to a second stream's work when it runs on few warps.

On the mixed-dim pipelined step the prefetch stream and the training stream were busy together for only
1.3-1.8 ms of an 8.2-8.6 ms step (H100, `tools/trace_step.py --gpu-only`, docs/performance.md): the step
was close to the sum of the two streams' work, whether the training stream's work was mostly reads and
writes of host memory in place (`lfu-admit`: forward and update 5.9 ms) or the prefetch's was mostly
bookkeeping in HBM (`lookahead-admit`: 116 kernels a step). A kernel that reads host memory a row a warp
keeps every SM full of warps that wait on the bus; the prefetch's sorts and ranks, bound by HBM, find no
room beside it. The link needs far fewer warps than that to stay busy (bytes in flight = rate x latency).

This script times a gather of ``--rows`` random rows of host memory (managed memory advised to stay on
the host, as ``Placement.MANAGED``) into HBM by a kernel of ``P`` programs of one warp each, each taking
``--rows-a-step`` rows per iteration of a grid-stride loop; a stable sort of ``--keys`` int32 keys
(``base.sorting.stable_sort``: CUB where it imports, the prefetch's sort) alone; and both at once on two
streams. For each ``P`` (default: the SM count times 1/4 .. 8, and one program a row step, as the kernels
launch today) it prints the gather's rate alone and beside the sort, and how much of the shorter of the two
the overlap saved: near 1, the gather left the SMs to the sort; near 0, the two took turns.

    python tools/bench_link_sharing.py
    python tools/bench_link_sharing.py --dim 64 --rows-a-step 2 4 8 --record results/measurements.jsonl

In simulation the memory is a CPU tensor and the times mean nothing (the logic is tested so).
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from tiered_tbe.base.mode import SIMULATION, describe_mode  # first: picks GPU / simulation mode
from tiered_tbe.base.sorting import stable_sort
from tiered_tbe.benchmarks import common
from tiered_tbe.cache import tiers

SCRIPT = "bench_link_sharing"
UNCAPPED = 0  # a --programs value: one program per step of rows, as the forward and backward launch


@triton.jit
def _strided_gather_kernel(
    table_ptr,  # fp32 [R, DIM]: the rows in host memory, read in place
    rows_ptr,  # int64 [C]: the row each output row reads
    out_ptr,  # fp32 [C, DIM] in HBM: where the rows land
    count,  # C
    programs,  # the grid's size: program p takes steps p, p + programs, ...
    DIM: tl.constexpr,  # fp32 a row
    BLOCK: tl.constexpr,  # the next power of two of DIM
    ROWS: tl.constexpr,  # rows a program reads per step (its loads in flight at once)
):
    p = tl.program_id(0)
    columns = tl.arange(0, BLOCK)
    lanes = tl.arange(0, ROWS)
    for step in range(p, tl.cdiv(count, ROWS), programs):
        positions = step * ROWS + lanes
        valid = positions < count
        rows = tl.load(rows_ptr + positions, mask=valid, other=0)
        inside = valid[:, None] & (columns[None, :] < DIM)
        values = tl.load(table_ptr + rows[:, None] * DIM + columns[None, :], mask=inside)
        tl.store(out_ptr + positions.to(tl.int64)[:, None] * DIM + columns[None, :], values, mask=inside)


def strided_gather(table: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, programs: int, rows_a_step: int) -> None:
    """``out = table[rows]`` by ``programs`` programs of one warp (``UNCAPPED``: one per step of
    ``rows_a_step`` rows). table fp32 [R, D] contiguous; rows int64 [C]; out fp32 [C, D]."""
    steps = triton.cdiv(rows.numel(), rows_a_step)
    grid = steps if programs == UNCAPPED else min(programs, steps)
    if grid == 0:
        return
    dim = table.shape[1]
    _strided_gather_kernel[(grid,)](table, rows, out, rows.numel(), grid, DIM=dim,
                                    BLOCK=triton.next_power_of_2(dim), ROWS=rows_a_step, num_warps=1)


def host_table(nbytes: int) -> tuple[torch.Tensor, object]:
    """A flat fp32 tensor over ``nbytes`` of managed memory that stays on the host (a CPU tensor in
    simulation), written once by the GPU as a module's tables are, and what frees it."""
    if SIMULATION:
        return torch.zeros(nbytes // 4), None
    memory = tiers._managed_memory(nbytes, torch.cuda.current_device())
    flat = torch.as_tensor(memory, device="cuda").view(torch.float32)
    flat.fill_(0.5)
    return flat, memory


def measure(table: torch.Tensor, count: int, keys: int, programs: int, rows_a_step: int, repeats: int,
            seed: int) -> dict[str, float]:
    """Ms of the gather alone, the sort alone and both on two streams (the span)."""
    device = table.device
    generator = torch.Generator(device).manual_seed(seed)
    rows = torch.randint(table.shape[0], (count,), device=device, generator=generator).sort().values
    out = torch.empty(count, table.shape[1], device=device)
    sort_keys = torch.randint(1 << 26, (keys,), device=device, generator=generator, dtype=torch.int32)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def gather():
        strided_gather(table, rows, out, programs, rows_a_step)

    def sort():
        stable_sort(sort_keys)

    def both():  # the gather on a side stream beside the sort
        common.beside(gather, sort, side)

    return {name: common.event_ms(fn, repeats) for name, fn in (("gather", gather), ("sort", sort), ("both", both))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/bench_link_sharing.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=None, help="host memory in GB (default 16; 0.001 in simulation)")
    parser.add_argument("--dim", type=int, default=96, help="fp32 a row (default 96: the mixed shape's mean ~89)")
    parser.add_argument("--rows", type=int, default=None, help="rows gathered (default 370000, the rows the mixed "
                        "shape's forward read in place; 300 in simulation)")
    parser.add_argument("--keys", type=int, default=None, help="int32 keys sorted beside it (default 4194304; 500 "
                        "in simulation)")
    parser.add_argument("--programs", type=int, nargs="+", default=None,
                        help=f"grid sizes to time ({UNCAPPED}: one program a step of rows; default: the SM count "
                             "times 1/4, 1/2, 1, 2, 4, 8, and 0)")
    parser.add_argument("--rows-a-step", type=int, nargs="+", default=[4],
                        help="rows a program reads at once, powers of two (default 4)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    common.add_output_flags(parser)
    args = parser.parse_args(argv)
    if args.dim < 1 or args.repeats < 1 or any(r < 1 or r & (r - 1) for r in args.rows_a_step):
        parser.error("--dim and --repeats must be >= 1, --rows-a-step powers of two")
    if any(p < 0 for p in args.programs or ()) or (args.rows is not None and args.rows < 1) \
            or (args.keys is not None and args.keys < 1):
        parser.error("--programs must be >= 0, --rows and --keys >= 1")
    print(describe_mode())
    if SIMULATION:
        print(common.SIMULATION_NOTE)
    sms = 4 if SIMULATION else torch.cuda.get_device_properties(0).multi_processor_count
    programs = args.programs or [sms // 4, sms // 2, sms, 2 * sms, 4 * sms, 8 * sms, UNCAPPED]
    gb = args.gb if args.gb is not None else (0.001 if SIMULATION else 16.0)
    count = args.rows or (300 if SIMULATION else 370_000)
    keys = args.keys or (500 if SIMULATION else 1 << 22)
    flat, keep = host_table(int(gb * 1e9))
    table = flat[: flat.numel() // args.dim * args.dim].view(-1, args.dim)
    if table.shape[0] < 1:
        parser.error(f"--gb {gb:g} holds no row of {args.dim} fp32")
    gathered_gb = count * 4 * args.dim / 1e9
    lines = [f"{gb:g} GB of managed memory on the host, {count} random rows of {4 * args.dim} B gathered into HBM "
             f"by programs of one warp; beside it a stable sort of {keys} int32 keys on another stream; {sms} SMs; "
             f"median of {args.repeats} (CUDA events). Saved: (gather + sort - both) / the shorter of the two.", "",
             "| programs | rows a step | gather ms | gather GB/s | sort ms | both ms | gather + sort ms | saved |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    results = []
    for rows_a_step in args.rows_a_step:
        for grid in programs:
            ms = measure(table, count, keys, grid, rows_a_step, args.repeats, args.seed)
            serial = ms["gather"] + ms["sort"]
            saved = (serial - ms["both"]) / max(min(ms["gather"], ms["sort"]), 1e-9)
            label = "one a step" if grid == UNCAPPED else str(grid)
            results.append(dict(programs=grid, rows_a_step=rows_a_step, gather_ms=ms["gather"], sort_ms=ms["sort"],
                                both_ms=ms["both"], gather_gbs=gathered_gb / ms["gather"] * 1e3, saved=saved))
            lines.append(f"| {label} | {rows_a_step} | {ms['gather']:.3f} | {gathered_gb / ms['gather'] * 1e3:.1f} | "
                         f"{ms['sort']:.3f} | {ms['both']:.3f} | {serial:.3f} | {saved:.2f} |")
            print(lines[-1], flush=True)
    del table, flat, keep
    measurements = [({"what": "host link shared with a sort", "memory": "managed", "gb": gb, "rows": count,
                      "row_bytes": 4 * args.dim, "keys": keys, "sms": sms, "programs": r["programs"],
                      "rows_a_step": r["rows_a_step"], "repeats": args.repeats},
                     {key: value for key, value in r.items() if key not in ("programs", "rows_a_step")})
                    for r in results]
    common.report(args, SCRIPT, argv if argv is not None else sys.argv[1:], results, lines, measurements)
    return 0


if __name__ == "__main__":
    sys.exit(main())
