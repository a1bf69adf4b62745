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

``--partition N`` asks the other way round: the SMs split in two disjoint groups, ``N`` for the sort and the
rest for the gather, each the green context of a stream (``cuDevSmResourceSplitByCount``; the driver may round
``N`` up to its partition granularity). Neither stream can then take the other's SMs, whatever its grid. If
the sort on a few SMs keeps most of its speed and the gather on the rest keeps the link's rate, a prefetch
stream on a partition of its own can run beside training kernels that hold every other SM. The rows also
say whether Triton's launches and the sort run on a green context's stream at all (the gather's output is
checked).

    python tools/bench_link_sharing.py
    python tools/bench_link_sharing.py --dim 64 --rows-a-step 2 4 8 --record results/measurements.jsonl
    python tools/bench_link_sharing.py --programs 0 --partition 8 16 32

In simulation the memory is a CPU tensor and the times mean nothing (the logic is tested so).
"""

from __future__ import annotations

import argparse
import sys
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tiered_tbe.base.mode import SIMULATION, describe_mode  # first: picks GPU / simulation mode
from tiered_tbe.base.sorting import stable_sort
from tiered_tbe.benchmarks import common
from tiered_tbe.cache import tiers

SCRIPT = "tools/bench_link_sharing.py"
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


def _driver_call(result):
    """The value of a ``cuda.bindings.driver`` call's ``(error, *values)``; raises on an error."""
    from cuda.bindings import driver

    error, *values = result
    if error != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {error}")
    return values[0] if len(values) == 1 else values


class SmPartition(NamedTuple):
    """Two streams on disjoint groups of SMs: each stream's kernels run on its group only."""

    first: torch.cuda.Stream | None  # None in simulation
    second: torch.cuda.Stream | None
    first_sms: int
    second_sms: int


def sm_partition(first_sms: int, device_index: int = 0) -> SmPartition:
    """Split the device's SMs in two disjoint groups, at least ``first_sms`` SMs in the first (as the
    driver rounds it) and the rest in the second, and a stream in the green context of each. The
    contexts live as long as the process. In simulation: no streams, the counts as asked of 4 SMs."""
    if SIMULATION:
        return SmPartition(None, None, first_sms, max(4 - first_sms, 0))
    from cuda.bindings import driver

    device = _driver_call(driver.cuDeviceGet(device_index))
    every_sm = _driver_call(driver.cuDeviceGetDevResource(device, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    groups, made, rest = _driver_call(driver.cuDevSmResourceSplitByCount(1, every_sm, 0, first_sms))
    if made < 1 or rest.sm.smCount < 1:
        raise RuntimeError(f"no split of {every_sm.sm.smCount} SMs gives {first_sms} to one group and some to another")
    streams = []
    for group in (groups[0], rest):
        description = _driver_call(driver.cuDevResourceGenerateDesc([group], 1))
        context = _driver_call(driver.cuGreenCtxCreate(
            description, device, int(driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM)))
        handle = _driver_call(driver.cuGreenCtxStreamCreate(
            context, int(driver.CUstream_flags.CU_STREAM_NON_BLOCKING), 0))
        streams.append(torch.cuda.ExternalStream(int(handle), device=torch.device("cuda", device_index)))
    return SmPartition(streams[0], streams[1], groups[0].sm.smCount, rest.sm.smCount)


def run_on(stream: torch.cuda.Stream | None, fn) -> None:
    """``fn()`` on ``stream`` after the current stream's work, the current stream then waiting for it
    (``fn()`` on the current stream where ``stream`` is None): ``beside`` with nothing on the current one."""
    common.beside(fn, lambda: None, stream)


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
            seed: int, partition: SmPartition | None = None) -> dict[str, float]:
    """Ms of the gather alone, the sort alone and both on two streams (the span). With a ``partition``,
    the sort runs on its first group's stream and the gather on its second's, alone and together.
    Raises ``AssertionError`` if the gather's output is not ``table[rows]``."""
    device = table.device
    generator = torch.Generator(device).manual_seed(seed)
    rows = torch.randint(table.shape[0], (count,), device=device, generator=generator).sort().values
    out = torch.full((count, table.shape[1]), float("nan"), device=device)
    sort_keys = torch.randint(1 << 26, (keys,), device=device, generator=generator, dtype=torch.int32)
    sort_stream, gather_stream = (partition.first, partition.second) if partition else (None, None)
    side = gather_stream or (torch.cuda.Stream(device) if device.type == "cuda" else None)

    def gather_here():
        strided_gather(table, rows, out, programs, rows_a_step)

    def gather():
        run_on(gather_stream, gather_here)

    def sort():
        run_on(sort_stream, lambda: stable_sort(sort_keys))

    def both():  # the gather on a side stream (or its partition's) beside the sort
        common.beside(gather_here, sort, side)

    times = {name: common.event_ms(fn, repeats) for name, fn in (("gather", gather), ("sort", sort), ("both", both))}
    assert torch.equal(out, table[rows]), "the gather's output is not the rows it read"
    return times


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
    parser.add_argument("--partition", type=int, nargs="+", default=[], metavar="SMS",
                        help="also time each grid with the SMs split in two: SMS for the sort, the rest for the "
                             "gather (green contexts; default: none)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    common.add_output_flags(parser)
    args = parser.parse_args(argv)
    if args.dim < 1 or args.repeats < 1 or any(r < 1 or r & (r - 1) for r in args.rows_a_step):
        parser.error("--dim and --repeats must be >= 1, --rows-a-step powers of two")
    if any(p < 0 for p in args.programs or ()) or (args.rows is not None and args.rows < 1) \
            or (args.keys is not None and args.keys < 1) or any(n < 1 for n in args.partition):
        parser.error("--programs must be >= 0, --rows, --keys and --partition >= 1")
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
    partitions: list[SmPartition | None] = [None]  # None: both streams on every SM
    for first_sms in args.partition:
        try:
            partitions.append(sm_partition(first_sms, torch.cuda.current_device() if not SIMULATION else 0))
        except (ImportError, RuntimeError, AttributeError) as error:  # an old driver or cuda-bindings: say so
            print(f"no partition of {first_sms} SMs: {error!r}", flush=True)
    lines = [f"{gb:g} GB of managed memory on the host, {count} random rows of {4 * args.dim} B gathered into HBM "
             f"by programs of one warp; beside it a stable sort of {keys} int32 keys on another stream; {sms} SMs, "
             "shared by both streams or split between them (sort / gather); "
             f"median of {args.repeats} (CUDA events). Saved: (gather + sort - both) / the shorter of the two.", "",
             "| SMs | programs | rows a step | gather ms | gather GB/s | sort ms | both ms | gather + sort ms "
             "| saved |",
             "| :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    results = []
    for rows_a_step in args.rows_a_step:
        for grid in programs:
            for partition in list(partitions):
                try:
                    ms = measure(table, count, keys, grid, rows_a_step, args.repeats, args.seed, partition)
                except RuntimeError as error:  # a launch a green context's stream refused: say so, go on without it
                    if partition is None:
                        raise
                    print(f"the partition of {partition.first_sms} SMs failed: {error!r}", flush=True)
                    partitions.remove(partition)
                    continue
                serial = ms["gather"] + ms["sort"]
                saved = (serial - ms["both"]) / max(min(ms["gather"], ms["sort"]), 1e-9)
                label = "one a step" if grid == UNCAPPED else str(grid)
                split = "shared" if partition is None else f"{partition.first_sms} / {partition.second_sms}"
                results.append(dict(programs=grid, rows_a_step=rows_a_step,
                                    sort_sms=partition.first_sms if partition else None,
                                    gather_sms=partition.second_sms if partition else None,
                                    gather_ms=ms["gather"], sort_ms=ms["sort"], both_ms=ms["both"],
                                    gather_gbs=gathered_gb / ms["gather"] * 1e3, saved=saved))
                lines.append(f"| {split} | {label} | {rows_a_step} | {ms['gather']:.3f} | "
                             f"{gathered_gb / ms['gather'] * 1e3:.1f} | {ms['sort']:.3f} | {ms['both']:.3f} | "
                             f"{serial:.3f} | {saved:.2f} |")
                print(lines[-1], flush=True)
    del table, flat, keep
    configuration_keys = ("programs", "rows_a_step", "sort_sms", "gather_sms")
    measurements = [({"what": "host link shared with a sort", "memory": "managed", "gb": gb, "rows": count,
                      "row_bytes": 4 * args.dim, "keys": keys, "sms": sms, "repeats": args.repeats,
                      **{key: r[key] for key in configuration_keys}},
                     {key: value for key, value in r.items() if key not in configuration_keys})
                    for r in results]
    common.report(args, SCRIPT, argv if argv is not None else sys.argv[1:], results, lines, measurements)
    return 0


if __name__ == "__main__":
    sys.exit(main())
