"""Time the slot cache on a DLRM-like model: prefetch, forward and backward of each batch, against all-HBM.

The model: the 26 tables of the Criteo Kaggle data set (``tiered_tbe.traces``; ``--row-cap``
caps each, ``--tables N`` takes the first N, ``--rows R`` makes every table R rows instead), dim
128 fp32 (``--dim``, ``--dtype``), row-wise Adagrad, every table ``HOST_CACHED`` (pinned host
memory behind a slot cache holding ``--cache-fraction`` of all rows, ``--policy``), batches of
B=65536 samples with one lookup per table (``--bag-size``), Zipf(alpha) over a random
permutation of each table's rows, drawn on the GPU. Measured in one run:

- for each row mover (``--mover zero_copy staged``: copy kernels reading host memory in place,
  or host threads + pinned staging + the copy engines), after ``--warmup`` batches (a
  steady-state cache), the time of ``emb.prefetch``, forward and ``out.backward(grad)`` of each
  of ``--batches`` batches (CUDA events; medians), and the cache counters over those batches:
  hit rates, rows and bytes copied in and written back;
- the same batches trained through ``PrefetchPipeline(depth=--depth)`` (the embedding layer
  alone: wall clock per step), against the all-HBM step through the same pipeline;
- each mover moving a batch's worth of rows alone: fill, write-back and both at once, in GB/s
  and as a fraction of the pinned ``memcpy`` measured in the same run, and how much of the
  write-back hides behind the fill when both run;
- the serial step (prefetch + forward + backward) against the same model with every table in
  HBM (``DEVICE``), measured in the same run;
- with ``--big-table-gb N --cache-gb M``, instead: one ``HOST_CACHED`` table of N GB with an M GB
  cache trains ``--big-steps`` steps (a table larger than the GPU memory given to the module);
  step time and hit rate. The host needs N GB free for pinned memory.

Without a GPU (CPU simulation) it runs at a tiny size to prove it works; its times mean nothing.

    tiered-tbe bench cache                                    # 26 tables, Zipf 1.05 and 1.2
    tiered-tbe bench cache --row-cap 1000000 --record r.jsonl # smaller tables; one JSON line a measurement
    tiered-tbe bench cache --tables 8 --rows 2000000 --dtype fp16 --policy lfu
    tiered-tbe bench cache --big-table-gb 60 --cache-gb 8
    tiered-tbe bench cache --mover staged --mover-threads 16 --staging-rows 65536
    python benchmarks/bench_cache.py ...                      # the same, from a checkout
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import torch

from tiered_tbe import records
from tiered_tbe.base.mode import SIMULATION, default_device, describe_mode  # first: picks GPU / simulation mode
from tiered_tbe.benchmarks import common, sampling
from tiered_tbe.benchmarks.models import build_module
from tiered_tbe.cache.mover import MOVERS
from tiered_tbe.cache.policy import POLICIES
from tiered_tbe.memory import host_available_bytes
from tiered_tbe.module import TieredEmbeddingBags
from tiered_tbe.pipeline import PrefetchPipeline
from tiered_tbe.specs import CacheConfig, Placement

SCRIPT = "bench_cache.py"
# Sizes used when none is given: the target workload on a GPU, a toy one in simulation.
GPU_DEFAULTS = dict(tables=26, row_cap=0, dim=128, batch_size=65536, bag_size=1, warmup=20, batches=20,
                    memcpy_gib=1.0, big_steps=12)
SIMULATION_DEFAULTS = dict(tables=3, row_cap=1000, dim=16, batch_size=8, bag_size=1, warmup=2, batches=2,
                           memcpy_gib=0.001, big_steps=3)
COPY_BULK_ROWS = 262_144  # rows of the bulk copy measured beside the rows a batch moves


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add this benchmark's flags to ``parser`` (a new one if None): ``tiered-tbe bench cache`` and the script."""
    parser = parser or argparse.ArgumentParser(prog="python benchmarks/bench_cache.py")
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    common.add_table_flags(parser, GPU_DEFAULTS, SIMULATION_DEFAULTS)
    common.add_cache_flags(parser, list(POLICIES))
    run = parser.add_argument_group("run")
    run.add_argument("--warmup", type=int, help="batches before timing, per alpha (default 20; 2 in simulation)")
    run.add_argument("--batches", type=int, help="timed batches per alpha (default 20; 2 in simulation)")
    run.add_argument("--bounds-check", default="off", choices=["off", "raise"],
                     help="the module's bounds_check ('raise' adds a host sync per batch); default off")
    run.add_argument("--no-hbm", action="store_true", help="skip the all-HBM baseline")
    run.add_argument("--mover", nargs="+", default=list(MOVERS), choices=MOVERS,
                     help="row movers to measure, each a cached model of its own (default: both)")
    run.add_argument("--mover-threads", type=int,
                     help="staged mover: torch intra-op threads per host copy (default: torch's)")
    run.add_argument("--staging-rows", type=int, help="staged mover: rows per staging buffer (default: the mover's)")
    run.add_argument("--depth", type=int, default=2,
                     help="PrefetchPipeline depth of the pipelined runs, 0 to skip them (default 2)")
    run.add_argument("--mover-repeats", type=int, default=5,
                     help="timed repeats of each mover-alone copy (default 5)")
    run.add_argument("--copy-blocks", type=int, nargs="+",
                     help="zero-copy mover: time its copy kernels with at most these many thread blocks each "
                          "(default: the cache's, tiered_tbe.cache.zero_copy.DEFAULT_COPY_BLOCKS)")
    run.add_argument("--memcpy-gib", type=float, help="GiB copied to measure the pinned memcpy bandwidth (default 1)")
    run.add_argument("--rep-ms", type=float, default=200.0,
                     help="do_bench repetition time of the memcpy, ms (default 200)")
    run.add_argument("--seed", type=int, default=0, help="seed of the weights and the lookups")
    big = parser.add_argument_group("big-table mode")
    big.add_argument("--big-table-gb", type=float,
                     help="one HOST_CACHED table of this many GB (1e9 bytes), e.g. 60")
    big.add_argument("--cache-gb", type=float, default=8.0,
                     help="slot cache size in GB, rows and optimizer state (default 8)")
    big.add_argument("--big-steps", type=int, help="training steps (default 12; 3 in simulation)")
    big.add_argument("--big-bag-size", type=int, default=26,
                     help="lookups per sample into the one table (default 26, the lookups of the 26-table model)")
    common.add_output_flags(parser)
    return parser


def check_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the sizes left unset (GPU or simulation defaults); ``ValueError`` for flags that do not fit."""
    common.check_table_args(args, GPU_DEFAULTS, SIMULATION_DEFAULTS)
    if args.warmup < 0 or args.batches < 1 or args.big_steps < 1:
        raise ValueError("--warmup must be >= 0, --batches and --big-steps >= 1")
    if not 0 <= args.depth <= 8 or args.mover_repeats < 1:
        raise ValueError("--depth must be between 0 and 8, --mover-repeats >= 1")
    for name in ("mover_threads", "staging_rows"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    return args


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return check_args(args)
    except ValueError as error:
        parser.error(str(error))


def train_steps(emb: TieredEmbeddingBags, batches, grad: torch.Tensor, warmup: int) -> dict:
    """Prefetch, forward, backward every batch; time those after the first ``warmup``.

    Returns the per-phase median milliseconds (``prefetch``, ``forward``, ``backward``,
    ``step``), the total prefetch milliseconds and the cache counters of the timed batches.
    """
    timer = common.StepTimer()
    host = None
    for i, (indices, offsets) in enumerate(batches):
        if i == warmup:
            common.synchronize()
            emb.reset_cache_stats()
            host = mover_host_stats(emb)
        timed = i >= warmup
        if timed:
            timer.start()
        emb.prefetch(indices, offsets)
        if timed:
            timer.mark("prefetch")
        out = emb(indices, offsets)
        if timed:
            timer.mark("forward")
        out.backward(grad)
        if timed:
            timer.mark("backward")
        del out
    phases = timer.phases()
    result = {name: common.median(times) for name, times in phases.items()}
    result["prefetch_total_ms"] = sum(phases["prefetch"])
    result["stats"] = emb.cache_stats().as_dict()
    result.update(host_copy_rates(emb, host))
    return result


def mover_host_stats(emb: TieredEmbeddingBags) -> dict | None:
    """A snapshot of the staged mover's counters (rows moved, host seconds), or None."""
    mover = emb.cache.mover if emb.cache is not None else None
    if mover is None or mover.name != "staged":
        return None
    emb.cache.drain()
    return dict(mover.stats)


def host_copy_rates(emb: TieredEmbeddingBags, before: dict | None) -> dict:
    """GB/s of the staged mover's host gathers and scatters since ``before`` (rows x row bytes /
    host seconds inside the copy calls), measured in training."""
    after = mover_host_stats(emb)
    if after is None or before is None:
        return {}
    row_bytes = emb.cache._uniform_row_bytes or 0
    rates = {}
    for name, rows, seconds in (("host_gather_gbs", "rows_filled", "gather_s"),
                                ("host_scatter_gbs", "rows_written", "scatter_s")):
        moved, spent = after[rows] - before[rows], after[seconds] - before[seconds]
        rates[name] = moved * row_bytes / spent / 1e9 if spent > 0 else None
    return rates


def pipelined_steps(emb: TieredEmbeddingBags, batches, grad: torch.Tensor, warmup: int, depth: int) -> dict:
    """The embedding layer alone (forward, backward) through ``PrefetchPipeline(depth)``: wall
    clock per step over the steps after the first ``warmup``, synchronized at both ends."""
    start, timed = None, 0
    for i, (indices, offsets) in enumerate(PrefetchPipeline(emb, batches, depth=depth)):
        if i == warmup:
            common.synchronize()
            start = time.perf_counter()
        emb(indices, offsets).backward(grad)
        timed += i >= warmup
    common.synchronize()
    return {"pipelined_step": (time.perf_counter() - start) * 1e3 / max(timed, 1) if start else None}


def mover_bandwidth(cache, counts, repeats: int, block_caps=(None,)) -> list[dict]:
    """GB/s of the cache's row mover alone, as a prefetch uses it: ``count`` distinct random rows
    of the cached tables (ascending) filled into distinct random slots, ``count`` other rows
    written back from the same slots (a victim leaves the slot its replacement takes), and both
    at once, weights and optimizer state; wall clock, synchronized. Clobbers the cache's rows
    and the tables: call it on a module about to be dropped."""
    device, mover = cache.device, cache.mover
    generator = torch.Generator(device=device).manual_seed(0)
    results = []
    for count in counts:
        count = max(1, min(count, cache.num_slots, cache._rows_end // 2))
        chosen = torch.randperm(cache._rows_end, device=device, generator=generator)[: 2 * count]
        fill_rows, back_rows = chosen[:count].sort().values, chosen[count:].sort().values
        slots = torch.randperm(cache.num_slots, device=device, generator=generator)[:count]
        nbytes = int(cache._bytes_of(fill_rows, torch.ones(count, dtype=torch.uint8, device=device)))
        if mover.name == "zero_copy":
            selected = torch.ones(count, dtype=torch.uint8, device=device)
            default_blocks = mover.copy_blocks
            for blocks in block_caps:
                mover.copy_blocks = blocks or default_blocks
                fill = functools.partial(mover.copy_rows, selected, 1, fill_rows, slots, to_backing=False)
                back = functools.partial(mover.copy_rows, selected, 1, back_rows, slots, to_backing=True)
                results += _time_moves(fill, back, lambda: (back(), fill()), count, nbytes, repeats,  # noqa: B023
                                       mover.name, mover.copy_blocks)
            mover.copy_blocks = default_blocks
        else:
            none = torch.empty(0, dtype=torch.int64, device=device)
            results += _time_moves(lambda: mover.move_rows(fill_rows, slots, none, none),  # noqa: B023
                                   lambda: mover.move_rows(none, none, back_rows, slots),  # noqa: B023
                                   lambda: mover.move_rows(fill_rows, slots, back_rows, slots),  # noqa: B023
                                   count, nbytes, repeats, mover.name, None)
    return results


def _time_moves(fill, back, both, count, nbytes, repeats, mover, blocks) -> list[dict]:
    times = {name: common.wall_ms(fn, repeats) for name, fn in (("fill", fill), ("write-back", back), ("both", both))}
    results = []
    for direction, ms in times.items():
        moved = 2 * nbytes if direction == "both" else nbytes
        results.append(dict(kind="copy", mover=mover, direction=direction, rows=count, row_bytes=nbytes // count,
                            ms=ms, gbs=moved / ms / 1e6, blocks=blocks))
    # How much of the write-back hides behind the fill when both run (1: all of it; 0: none).
    hidden = (times["fill"] + times["write-back"] - times["both"]) / times["write-back"]
    results[-1]["write_back_hidden"] = hidden
    print(f"  {mover} mover, {count:,} rows of {nbytes // count} bytes"
          + (f", at most {blocks} blocks" if blocks else "") + ": "
          + ", ".join(f"{r['direction']} {r['ms']:.3f} ms ({r['gbs']:.1f} GB/s)" for r in results)
          + f"; write-back hidden behind the fill: {hidden:.2f}", flush=True)
    return results


def run(args: argparse.Namespace) -> list[dict]:
    device = default_device()
    table_rows = common.table_rows_of(args)
    results = []
    bandwidth = common.pinned_copy_bandwidth(args.memcpy_gib, args.rep_ms)
    results.append(dict(kind="memcpy", **bandwidth))
    print(f"pinned memcpy: host->device {bandwidth['h2d_gbs']:.1f} GB/s, device->host {bandwidth['d2h_gbs']:.1f} GB/s",
          flush=True)

    num_batches = args.warmup + args.batches
    batches = {alpha: sampling.ZipfBatches(table_rows, alpha, args.batch_size, args.bag_size, device,
                                         seed=args.seed).batches(num_batches)
               for alpha in args.alpha}
    grad = torch.randn(args.batch_size, len(table_rows) * args.dim, device=device,
                       generator=torch.Generator(device=device).manual_seed(args.seed))

    config = CacheConfig(fraction=args.cache_fraction, policy=args.policy, associativity=args.associativity)
    models = [("host_cached", Placement.HOST_CACHED, config, mover) for mover in args.mover]
    if not args.no_hbm:
        models.append(("all HBM", Placement.DEVICE, None, None))
    for label, placement, cache, mover in models:
        start = time.perf_counter()
        emb = build_module(table_rows, args.dim, placement, cache, args, mover=mover)
        setup_s = time.perf_counter() - start
        slots = emb.cache.num_slots if emb.cache is not None else 0
        print(f"{label}" + (f" ({mover} mover)" if mover else "") + f": built in {setup_s:.1f} s"
              + (f", {slots:,} cache slots" if slots else ""), flush=True)
        for alpha in args.alpha:
            measured = train_steps(emb, batches[alpha], grad, args.warmup)
            if args.depth:
                measured.update(pipelined_steps(emb, batches[alpha], grad, args.warmup, args.depth))
            results.append(dict(kind="model", model=label, mover=mover or "-", alpha=alpha, slots=slots, **measured))
            print(f"  zipf {alpha:g}: serial step {measured['step']:.3f} ms"
                  + (f", pipelined step {measured['pipelined_step']:.3f} ms" if args.depth else ""), flush=True)
        if emb.cache is not None:  # last use of this module: the copies below clobber its rows
            moved = [r["stats"]["rows_copied_in"] // max(r["stats"]["batches"], 1) for r in results
                     if r.get("model") == label and r.get("mover") == mover]
            for copy in mover_bandwidth(emb.cache, sorted({*moved, COPY_BULK_ROWS}), args.mover_repeats,
                                        args.copy_blocks or (None,)):
                memcpy = {"fill": bandwidth["h2d_gbs"], "write-back": bandwidth["d2h_gbs"],
                          "both": bandwidth["h2d_gbs"] + bandwidth["d2h_gbs"]}[copy["direction"]]
                copy["vs_memcpy"] = copy["gbs"] / memcpy
                results.append(copy)
            emb.cache.close()
        del emb
        common.free()

    hbm = {r["alpha"]: r for r in results if r.get("model") == "all HBM"}
    row_bytes = args.dim * common.DTYPES[args.dtype].itemsize
    for r in results:
        if r["kind"] != "model":
            continue
        stats, n = r["stats"], max(r["stats"]["batches"], 1)
        r["rows_in_per_batch"] = stats["rows_copied_in"] / n
        r["mb_in_per_batch"] = stats["bytes_in"] / n / 1e6
        r["mb_out_per_batch"] = stats["bytes_out"] / n / 1e6
        r["prefetch_gbs"] = stats["bytes_in"] / r["prefetch_total_ms"] / 1e6 if stats["bytes_in"] else None
        base = hbm.get(r["alpha"])
        r["step_vs_hbm"] = r["step"] / base["step"] if base else None
        # Pipelined against the all-HBM model through the same pipeline (both wall clock).
        r["pipelined_vs_hbm"] = (r["pipelined_step"] / base["pipelined_step"]
                                 if base and r.get("pipelined_step") and base.get("pipelined_step") else None)
        r["row_bytes"] = row_bytes
    return results


def format_table(results: list[dict], args) -> list[str]:
    memcpy = next(r for r in results if r["kind"] == "memcpy")
    header = ["model", "mover", "lookups", "prefetch ms", "forward ms", "backward ms", "step ms", "hit rate (lookups)",
              "hit rate (unique rows)", "rows in / batch", "MB in / batch", "MB out / batch", "prefetch GB/s",
              "step / all-HBM", "pipelined step ms", "pipelined / all-HBM"]
    rows = []
    for r in (r for r in results if r["kind"] == "model"):
        cached = r["model"] != "all HBM"
        stats = r["stats"]
        rows.append([
            r["model"], r["mover"], f"zipf {r['alpha']:g}", common.fmt(r["prefetch"]), common.fmt(r["forward"]),
            common.fmt(r["backward"]), common.fmt(r["step"]),
            common.fmt(stats["hit_rate_by_lookup"], ".4f") if cached else "-",
            common.fmt(stats["hit_rate_by_unique"], ".4f") if cached else "-",
            common.fmt(r["rows_in_per_batch"], ",.0f") if cached else "-",
            common.fmt(r["mb_in_per_batch"], ".1f") if cached else "-",
            common.fmt(r["mb_out_per_batch"], ".1f") if cached else "-",
            common.fmt(r["prefetch_gbs"], ".1f"),
            common.fmt(r["step_vs_hbm"], ".2f") if cached else "1.00",
            common.fmt(r.get("pipelined_step")),
            common.fmt(r["pipelined_vs_hbm"], ".2f") if cached else "1.00",
        ])
    lines = records.markdown_table(header, rows, "lll" + "r" * (len(header) - 3))
    lines.append("")
    lines.append(f"Pinned memcpy in the same run: host->device {memcpy['h2d_gbs']:.1f} GB/s, "
                 f"device->host {memcpy['d2h_gbs']:.1f} GB/s. Prefetch GB/s = bytes copied in (rows and their "
                 f"Adagrad state) / prefetch time (device time of the prefetch call: the lookup and, for the zero-copy "
                 f"mover, the copies; the staged mover's copies run behind it, until the forward waits for them). "
                 f"Pipelined: PrefetchPipeline(depth={args.depth}), forward + backward of the embedding layer alone, "
                 f"wall clock per step; all-HBM through the same pipeline.")
    for r in (r for r in results if r["kind"] == "model" and r.get("host_gather_gbs") is not None):
        lines.append(f"- staged mover in training, zipf {r['alpha']:g}: host gather {r['host_gather_gbs']:.1f} GB/s, "
                     f"host scatter {common.fmt(r.get('host_scatter_gbs'), '.1f')} GB/s (inside the copy calls)")
    copies = [r for r in results if r["kind"] == "copy"]
    if copies:
        lines.append("")
        lines.append("Each mover alone (distinct random rows in ascending order, random slots, rows and state; "
                     "write-backs from the slots the fills take; both = fill and write-back of a batch at once, "
                     "against the sum of both memcpy directions):")
        lines.append("")
        lines += records.markdown_table(
            ["mover", "copy", "rows", "bytes / row", "blocks (most)", "ms", "GB/s", "/ memcpy", "write-back hidden"],
            [[r["mover"], r["direction"], f"{r['rows']:,}", str(r["row_bytes"]), str(r["blocks"] or "-"),
              common.fmt(r["ms"]), common.fmt(r["gbs"], ".1f"), common.fmt(r["vs_memcpy"], ".2f"),
              common.fmt(r.get("write_back_hidden"), ".2f")] for r in copies], "llrrrrrrr")
        lines.append("")
        for r in (r for r in copies if r["direction"] == "both"):
            lines.append(f"- {r['mover']}: {r['rows']:,} rows both ways at once: write-back hidden behind the "
                         f"fill {r['write_back_hidden']:.2f} (1 = all of it, 0 = none)")
    for r in (r for r in results if r["kind"] == "model" and r["model"] != "all HBM"):
        if r["step_vs_hbm"] is not None:
            lines.append(f"- {r['mover']}, zipf {r['alpha']:g}: serial step / all-HBM {r['step_vs_hbm']:.2f}")
        if r["pipelined_vs_hbm"] is not None:
            lines.append(f"- {r['mover']}, zipf {r['alpha']:g}: pipelined step / all-HBM {r['pipelined_vs_hbm']:.2f}")
    return lines


# ------------------------------------------------------------------------------------ big table


def run_big_table(args: argparse.Namespace) -> dict:
    """One HOST_CACHED table of ``--big-table-gb`` GB behind a ``--cache-gb`` GB cache: train a few steps."""
    device = default_device()
    row_bytes = args.dim * common.DTYPES[args.dtype].itemsize
    num_rows = int(args.big_table_gb * 1e9) // row_bytes
    if num_rows < 1:
        raise SystemExit(f"--big-table-gb {args.big_table_gb} holds no {row_bytes}-byte row")
    host_bytes = num_rows * (row_bytes + 4)  # rows and their row-wise Adagrad state, pinned
    available = host_available_bytes()
    margin = 0 if SIMULATION else 4 * 2**30  # for the process itself, the batches and the interpreter
    if available is not None and host_bytes + margin > available:
        raise SystemExit(f"big-table mode: the table needs {host_bytes / 2**30:.1f} GiB of pinned host memory "
                         f"(+{margin / 2**30:.0f} GiB margin), but only {available / 2**30:.1f} GiB is available "
                         f"(MemAvailable). Ask for a smaller --big-table-gb.")
    cache_bytes = int(args.cache_gb * 1e9)
    print(f"big table: {num_rows:,} rows x {args.dim} {args.dtype} = {num_rows * row_bytes / 1e9:.1f} GB pinned host, "
          f"cache {cache_bytes / 1e9:g} GB, batch {args.batch_size} x bag {args.big_bag_size}, "
          f"{args.big_steps} steps, zipf {args.alpha[0]:g}", flush=True)
    start = time.perf_counter()
    try:
        # One module (the table takes minutes to allocate): the mover named alone by --mover, else the default.
        emb = build_module([num_rows], args.dim, Placement.HOST_CACHED,
                           CacheConfig(memory=cache_bytes, policy=args.policy, associativity=args.associativity), args,
                           mover=args.mover[0] if len(args.mover) == 1 else None)
    except (RuntimeError, MemoryError) as error:
        raise SystemExit(f"big-table mode: allocating {host_bytes / 2**30:.1f} GiB of pinned host memory "
                         f"(or the cache) failed: {error}") from error
    setup_s = time.perf_counter() - start
    print(f"  allocated and initialised in {setup_s:.1f} s; {emb.cache.num_slots:,} cache slots "
          f"({emb.cache.num_slots / num_rows:.1%} of the rows)", flush=True)
    source = sampling.ZipfBatches([num_rows], args.alpha[0], args.batch_size, args.big_bag_size, device, seed=args.seed)
    grad = torch.randn(args.batch_size, args.dim, device=device,
                       generator=torch.Generator(device=device).manual_seed(args.seed))
    first_timed = args.big_steps // 2  # the second half: the cache is warm by then
    batches = (source.next() for _ in range(args.big_steps))
    measured = train_steps(emb, batches, grad, first_timed)
    stats = measured["stats"]
    result = dict(kind="big_table", mover=emb.cache.mover.name, table_gb=num_rows * row_bytes / 1e9,
                  cache_gb=cache_bytes / 1e9, rows=num_rows,
                  slots=emb.cache.num_slots, setup_s=setup_s, alpha=args.alpha[0],
                  steps=args.big_steps, timed_steps=args.big_steps - first_timed, **measured)
    result["prefetch_gbs"] = stats["bytes_in"] / measured["prefetch_total_ms"] / 1e6 if stats["bytes_in"] else None
    del emb
    common.free()
    return result


def format_big_table(r: dict) -> list[str]:
    header = ["mover", "table GB", "cache GB", "lookups", "steps (timed)", "prefetch ms", "forward ms", "backward ms",
              "step ms", "hit rate (lookups)", "hit rate (unique rows)", "prefetch GB/s (bytes in / prefetch ms)"]
    stats = r["stats"]
    row = [r["mover"], f"{r['table_gb']:.1f}", f"{r['cache_gb']:g}", f"zipf {r['alpha']:g}",
           f"{r['steps']} ({r['timed_steps']})",
           common.fmt(r["prefetch"]), common.fmt(r["forward"]), common.fmt(r["backward"]), common.fmt(r["step"]),
           f"{stats['hit_rate_by_lookup']:.4f}", f"{stats['hit_rate_by_unique']:.4f}",
           common.fmt(r["prefetch_gbs"], ".1f")]
    return records.markdown_table(header, [row])


def measurements_of(results: list[dict], args) -> list[tuple[dict, dict]]:
    """``(configuration, figures)`` of each measurement, for ``--record``: each model and Zipf
    exponent, each mover's copies alone, the pinned memcpy, or the big table."""
    shared = dict(tables=len(common.table_rows_of(args)) if args.big_table_gb is None else 1,
                  rows=sum(common.table_rows_of(args)) if args.big_table_gb is None else None, dim=args.dim,
                  dtype=args.dtype, batch_size=args.batch_size, bag_size=args.bag_size, optimizer="rowwise_adagrad",
                  cache_fraction=args.cache_fraction, policy=args.policy, associativity=args.associativity)
    found = []
    for r in results:
        if r["kind"] == "memcpy":
            found.append(({"what": "pinned memcpy", "gib": args.memcpy_gib}, dict(r)))
        elif r["kind"] == "copy":
            found.append(({**shared, "what": "mover alone", "mover": r["mover"], "direction": r["direction"],
                           "rows_moved": r["rows"], "row_bytes": r["row_bytes"], "blocks": r["blocks"]},
                          {key: r.get(key) for key in ("ms", "gbs", "vs_memcpy", "write_back_hidden")}))
        elif r["kind"] == "model":
            figures = {f"{phase}_ms": r[phase] for phase in ("prefetch", "forward", "backward", "step")}
            figures.update({key: r.get(key) for key in ("pipelined_step", "rows_in_per_batch", "mb_in_per_batch",
                                                        "mb_out_per_batch", "prefetch_gbs", "step_vs_hbm",
                                                        "pipelined_vs_hbm", "host_gather_gbs", "host_scatter_gbs")})
            figures["stats"] = r["stats"]
            found.append(({**shared, "what": "training steps", "model": r["model"], "mover": r["mover"],
                           "alpha": r["alpha"], "slots": r["slots"], "depth": args.depth, "warmup": args.warmup,
                           "batches": args.batches}, figures))
        else:  # the big table
            figures = {f"{phase}_ms": r[phase] for phase in ("prefetch", "forward", "backward", "step")}
            figures.update(prefetch_gbs=r["prefetch_gbs"], setup_s=r["setup_s"], stats=r["stats"])
            found.append(({**shared, "what": "big table", "mover": r["mover"], "table_gb": r["table_gb"],
                           "cache_gb": r["cache_gb"], "rows": r["rows"], "slots": r["slots"], "alpha": r["alpha"],
                           "bag_size": args.big_bag_size, "steps": r["steps"], "timed_steps": r["timed_steps"]},
                          figures))
    return found


# ------------------------------------------------------------------------------------ main


def run_command(args: argparse.Namespace, argv=None) -> int:
    """Run the benchmark for checked ``args``, print its table, write ``--json`` and ``--record``.

    ``tiered-tbe bench cache`` calls it with the CLI's arguments; :func:`main` with the script's.
    """
    check_args(args)
    print(describe_mode())
    if SIMULATION:
        print(common.SIMULATION_NOTE)
    if args.big_table_gb is not None:
        result = run_big_table(args)
        results = [result]
        table = format_big_table(result)
    else:
        print(f"{common.describe_tables(args)}, row-wise Adagrad; batch {args.batch_size} x bag {args.bag_size}; "
              f"cache {args.cache_fraction:g} of rows, {args.policy}, {args.associativity} ways; {args.warmup} "
              f"warm-up + {args.batches} timed batches per alpha; on {records.device_name()}", flush=True)
        results = run(args)
        table = format_table(results, args)
    common.report(args, SCRIPT, argv, results, table, measurements_of(results, args))
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_command(parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
