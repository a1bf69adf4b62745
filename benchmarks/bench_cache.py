"""Time the slot cache on a DLRM-like model: prefetch, forward and backward of each batch, against all-HBM.

The model: the 26 tables of the Criteo Kaggle data set (``tiered_tbe.traces``; ``--row-cap``
caps each, ``--tables N`` takes the first N, ``--rows R`` makes every table R rows instead), dim
128 fp32 (``--dim``, ``--dtype``), row-wise Adagrad, every table ``HOST_CACHED`` (pinned host
memory behind a slot cache holding ``--cache-fraction`` of all rows, ``--policy``), batches of
B=65536 samples with one lookup per table (``--bag-size``), Zipf(alpha) over a random
permutation of each table's rows, drawn on the GPU. Measured in one run:

- after ``--warmup`` batches (a steady-state cache), the time of ``emb.prefetch``, forward and
  ``out.backward(grad)`` of each of ``--batches`` batches (CUDA events; medians), and the cache
  counters over those batches: hit rates, rows and bytes copied in and written back;
- the fill bandwidth, bytes copied in over the prefetch time, against the pinned host->device
  ``memcpy`` bandwidth measured in the same run (target: >= 80% for 512-byte rows);
- the serial step (prefetch + forward + backward) against the same model with every table in
  HBM (``DEVICE``; target: <= 2x);
- with ``--big-table-gb N --cache-gb M``, instead: one ``HOST_CACHED`` table of N GB with an M GB
  cache trains ``--big-steps`` steps (a table larger than the GPU memory given to the module);
  step time and hit rate. The host needs N GB free for pinned memory (the lent H200 has 125 GiB).

Without a GPU (CPU simulation) it runs at a tiny size to prove it works; its times mean nothing.

    tiered-tbe bench cache                                    # 26 tables, Zipf 1.05 and 1.2
    tiered-tbe bench cache --row-cap 1000000 --record         # smaller tables; append to RESULTS.md
    tiered-tbe bench cache --tables 8 --rows 2000000 --dtype fp16 --policy lfu
    tiered-tbe bench cache --big-table-gb 60 --cache-gb 8
    python benchmarks/bench_cache.py ...                      # the same, from a checkout
"""

from __future__ import annotations

import argparse
import functools
import gc
import sys
import time

import torch

from tiered_tbe import records
from tiered_tbe.base.mode import SIMULATION, default_device, describe_mode  # first: picks GPU / simulation mode
from tiered_tbe.benchmarks import common
from tiered_tbe.cache.policy import POLICIES
from tiered_tbe.module import TieredEmbeddingBags
from tiered_tbe.optimizers import RowwiseAdagrad
from tiered_tbe.specs import CacheConfig, Placement, TableSpec

SCRIPT = "bench_cache.py"
# Sizes used when none is given: the target workload on a GPU, a toy one in simulation.
GPU_DEFAULTS = dict(tables=26, row_cap=0, dim=128, batch_size=65536, bag_size=1, warmup=20, batches=20,
                    memcpy_gib=1.0, big_steps=12)
SIMULATION_DEFAULTS = dict(tables=3, row_cap=1000, dim=16, batch_size=8, bag_size=1, warmup=2, batches=2,
                           memcpy_gib=0.001, big_steps=3)
FILL_TARGET = 0.8  # fill bandwidth / pinned memcpy bandwidth, at least
STEP_TARGET = 2.0  # serial cached step / all-HBM step, at most
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
    run.add_argument("--copy-blocks", type=int, nargs="+",
                     help="time the copy kernels alone with at most these many thread blocks each "
                          "(default: the cache's, tiered_tbe.cache.slot_cache.DEFAULT_COPY_BLOCKS)")
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
    return args


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return check_args(args)
    except ValueError as error:
        parser.error(str(error))


def build_module(table_rows, dim, placement: Placement, cache: CacheConfig | None, args) -> TieredEmbeddingBags:
    tables = [TableSpec(n, dim, name=f"C{t + 1}", placement=placement) for t, n in enumerate(table_rows)]
    return TieredEmbeddingBags(tables, optimizer=RowwiseAdagrad(lr=0.05, eps=1e-8), cache=cache,
                               weights_dtype=common.DTYPES[args.dtype], device=default_device(),
                               bounds_check=args.bounds_check, seed=args.seed)


def free(*_unused) -> None:
    """Give back the memory of modules the caller has dropped (pinned memory goes with them)."""
    gc.collect()
    if not SIMULATION:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def train_steps(emb: TieredEmbeddingBags, batches, grad: torch.Tensor, warmup: int) -> dict:
    """Prefetch, forward, backward every batch; time those after the first ``warmup``.

    Returns the per-phase median milliseconds (``prefetch``, ``forward``, ``backward``,
    ``step``), the total prefetch milliseconds and the cache counters of the timed batches.
    """
    timer = common.StepTimer()
    for i, (indices, offsets) in enumerate(batches):
        if i == warmup:
            common.synchronize()
            emb.reset_cache_stats()
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
    return result


def copy_bandwidth(cache, counts, rep_ms: float, block_caps=(None,)) -> list[dict]:
    """GB/s of the cache's copy kernels alone (``SlotCache._copy_rows``), as a prefetch runs them:
    ``count`` distinct random rows of the cached tables, in ascending row order, to or from
    distinct random slots, weights and optimizer state. Clobbers the cache's rows and the
    tables: call it on a module about to be dropped."""
    device = cache.device
    generator = torch.Generator(device=device).manual_seed(0)
    results = []
    for count in counts:
        count = max(1, min(count, cache.num_slots, cache._rows_end))
        rows = torch.randperm(cache._rows_end, device=device, generator=generator)[:count].sort().values
        slots = torch.randperm(cache.num_slots, device=device, generator=generator)[:count].to(torch.int32)
        selected = torch.ones(count, dtype=torch.uint8, device=device)
        nbytes = int(cache._bytes_of(rows, selected))
        default_blocks = cache.copy_blocks
        for blocks in block_caps:
            cache.copy_blocks = blocks or default_blocks
            for direction, to_backing in (("fill", False), ("write-back", True)):
                copy = functools.partial(cache._copy_rows, selected, 1, rows, slots, to_backing=to_backing)
                ms = common.time_ms(copy, rep_ms)
                results.append(dict(kind="copy", direction=direction, rows=count, row_bytes=nbytes // count,
                                    ms=ms, gbs=nbytes / ms / 1e6, blocks=cache.copy_blocks))
                print(f"  {direction} kernel, {count:,} rows of {nbytes // count} bytes, at most "
                      f"{cache.copy_blocks} blocks: {ms:.3f} ms, {nbytes / ms / 1e6:.1f} GB/s", flush=True)
        cache.copy_blocks = default_blocks
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
    batches = {alpha: common.ZipfBatches(table_rows, alpha, args.batch_size, args.bag_size, device,
                                         seed=args.seed).batches(num_batches)
               for alpha in args.alpha}
    grad = torch.randn(args.batch_size, len(table_rows) * args.dim, device=device,
                       generator=torch.Generator(device=device).manual_seed(args.seed))

    models = [("host_cached", Placement.HOST_CACHED,
               CacheConfig(fraction=args.cache_fraction, policy=args.policy, associativity=args.associativity))]
    if not args.no_hbm:
        models.append(("all HBM", Placement.DEVICE, None))
    for label, placement, cache in models:
        start = time.perf_counter()
        emb = build_module(table_rows, args.dim, placement, cache, args)
        setup_s = time.perf_counter() - start
        slots = emb.cache.num_slots if emb.cache is not None else 0
        print(f"{label}: built in {setup_s:.1f} s" + (f", {slots:,} cache slots" if slots else ""), flush=True)
        for alpha in args.alpha:
            measured = train_steps(emb, batches[alpha], grad, args.warmup)
            results.append(dict(kind="model", model=label, alpha=alpha, slots=slots, **measured))
            print(f"  zipf {alpha:g}: step {measured['step']:.3f} ms", flush=True)
        if emb.cache is not None:  # last use of this module: the copies below clobber its rows
            moved = [r["stats"]["rows_copied_in"] // max(r["stats"]["batches"], 1) for r in results
                     if r.get("model") == label]
            for copy in copy_bandwidth(emb.cache, sorted({*moved, COPY_BULK_ROWS}), args.rep_ms,
                                       args.copy_blocks or (None,)):
                copy["vs_memcpy"] = copy["gbs"] / bandwidth["h2d_gbs" if copy["direction"] == "fill" else "d2h_gbs"]
                results.append(copy)
        del emb
        free()

    hbm_step = {r["alpha"]: r["step"] for r in results if r.get("model") == "all HBM"}
    row_bytes = args.dim * common.DTYPES[args.dtype].itemsize
    for r in results:
        if r["kind"] != "model":
            continue
        stats, n = r["stats"], max(r["stats"]["batches"], 1)
        r["rows_in_per_batch"] = stats["rows_copied_in"] / n
        r["mb_in_per_batch"] = stats["bytes_in"] / n / 1e6
        r["mb_out_per_batch"] = stats["bytes_out"] / n / 1e6
        r["prefetch_gbs"] = stats["bytes_in"] / r["prefetch_total_ms"] / 1e6 if stats["bytes_in"] else None
        r["step_vs_hbm"] = r["step"] / hbm_step[r["alpha"]] if r["alpha"] in hbm_step else None
        r["row_bytes"] = row_bytes
    return results


def format_table(results: list[dict], args) -> list[str]:
    memcpy = next(r for r in results if r["kind"] == "memcpy")
    header = ["model", "lookups", "prefetch ms", "forward ms", "backward ms", "step ms", "hit rate (lookups)",
              "hit rate (unique rows)", "rows in / batch", "MB in / batch", "MB out / batch", "prefetch GB/s",
              "step / all-HBM"]
    rows = []
    for r in (r for r in results if r["kind"] == "model"):
        cached = r["model"] != "all HBM"
        stats = r["stats"]
        rows.append([
            r["model"], f"zipf {r['alpha']:g}", common.fmt(r["prefetch"]), common.fmt(r["forward"]),
            common.fmt(r["backward"]), common.fmt(r["step"]),
            common.fmt(stats["hit_rate_by_lookup"], ".4f") if cached else "-",
            common.fmt(stats["hit_rate_by_unique"], ".4f") if cached else "-",
            common.fmt(r["rows_in_per_batch"], ",.0f") if cached else "-",
            common.fmt(r["mb_in_per_batch"], ".1f") if cached else "-",
            common.fmt(r["mb_out_per_batch"], ".1f") if cached else "-",
            common.fmt(r["prefetch_gbs"], ".1f"),
            common.fmt(r["step_vs_hbm"], ".2f") if cached else "1.00",
        ])
    lines = records.markdown_table(header, rows, "ll" + "r" * (len(header) - 2))
    lines.append("")
    lines.append(f"Pinned memcpy in the same run: host->device {memcpy['h2d_gbs']:.1f} GB/s, "
                 f"device->host {memcpy['d2h_gbs']:.1f} GB/s. Prefetch GB/s = bytes copied in (rows and their "
                 f"Adagrad state) / prefetch time (which also holds the dedup, the lookup and the write-backs).")
    copies = [r for r in results if r["kind"] == "copy"]
    if copies:
        lines.append("")
        lines.append("The copy kernels alone (distinct random rows in ascending order, random slots, rows and state):")
        lines.append("")
        lines += records.markdown_table(
            ["copy", "rows", "bytes / row", "blocks (most)", "ms", "GB/s", "/ memcpy"],
            [[r["direction"], f"{r['rows']:,}", str(r["row_bytes"]), str(r["blocks"]), common.fmt(r["ms"]),
              common.fmt(r["gbs"], ".1f"), common.fmt(r["vs_memcpy"], ".2f")] for r in copies], "lrrrrrr")
        lines.append("")
        for r in (r for r in copies if r["direction"] == "fill"):
            lines.append(f"- fill of {r['rows']:,} rows ({r['blocks']} blocks): fill / memcpy {r['vs_memcpy']:.2f} "
                         f"(target >= {FILL_TARGET:.2f} for 512-byte rows: {judge(r['vs_memcpy'] >= FILL_TARGET)})")
    for r in (r for r in results if r["kind"] == "model" and r["model"] != "all HBM"):
        if r["step_vs_hbm"] is not None:
            lines.append(f"- zipf {r['alpha']:g}: serial step / all-HBM {r['step_vs_hbm']:.2f} (target <= "
                         f"{STEP_TARGET:.1f}: {judge(r['step_vs_hbm'] <= STEP_TARGET)})")
    return lines


def judge(ok: bool) -> str:
    if SIMULATION:
        return "not judged in simulation"
    return "met" if ok else "MISSED"


# ------------------------------------------------------------------------------------ big table


def run_big_table(args: argparse.Namespace) -> dict:
    """One HOST_CACHED table of ``--big-table-gb`` GB behind a ``--cache-gb`` GB cache: train a few steps."""
    device = default_device()
    row_bytes = args.dim * common.DTYPES[args.dtype].itemsize
    num_rows = int(args.big_table_gb * 1e9) // row_bytes
    if num_rows < 1:
        raise SystemExit(f"--big-table-gb {args.big_table_gb} holds no {row_bytes}-byte row")
    host_bytes = num_rows * (row_bytes + 4)  # rows and their row-wise Adagrad state, pinned
    available = common.host_memory_available()
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
        emb = build_module([num_rows], args.dim, Placement.HOST_CACHED,
                           CacheConfig(memory=cache_bytes, policy=args.policy, associativity=args.associativity), args)
    except (RuntimeError, MemoryError) as error:
        raise SystemExit(f"big-table mode: allocating {host_bytes / 2**30:.1f} GiB of pinned host memory "
                         f"(or the cache) failed: {error}") from error
    setup_s = time.perf_counter() - start
    print(f"  allocated and initialised in {setup_s:.1f} s; {emb.cache.num_slots:,} cache slots "
          f"({emb.cache.num_slots / num_rows:.1%} of the rows)", flush=True)
    source = common.ZipfBatches([num_rows], args.alpha[0], args.batch_size, args.big_bag_size, device, seed=args.seed)
    grad = torch.randn(args.batch_size, args.dim, device=device,
                       generator=torch.Generator(device=device).manual_seed(args.seed))
    first_timed = args.big_steps // 2  # the second half: the cache is warm by then
    batches = (source.next() for _ in range(args.big_steps))
    measured = train_steps(emb, batches, grad, first_timed)
    stats = measured["stats"]
    result = dict(kind="big_table", table_gb=num_rows * row_bytes / 1e9, cache_gb=cache_bytes / 1e9, rows=num_rows,
                  slots=emb.cache.num_slots, setup_s=setup_s, alpha=args.alpha[0],
                  steps=args.big_steps, timed_steps=args.big_steps - first_timed, **measured)
    result["prefetch_gbs"] = stats["bytes_in"] / measured["prefetch_total_ms"] / 1e6 if stats["bytes_in"] else None
    del emb
    free()
    return result


def format_big_table(r: dict) -> list[str]:
    header = ["table GB", "cache GB", "lookups", "steps (timed)", "prefetch ms", "forward ms", "backward ms",
              "step ms", "hit rate (lookups)", "hit rate (unique rows)", "prefetch GB/s (bytes in / prefetch ms)"]
    stats = r["stats"]
    row = [f"{r['table_gb']:.1f}", f"{r['cache_gb']:g}", f"zipf {r['alpha']:g}", f"{r['steps']} ({r['timed_steps']})",
           common.fmt(r["prefetch"]), common.fmt(r["forward"]), common.fmt(r["backward"]), common.fmt(r["step"]),
           f"{stats['hit_rate_by_lookup']:.4f}", f"{stats['hit_rate_by_unique']:.4f}",
           common.fmt(r["prefetch_gbs"], ".1f")]
    return records.markdown_table(header, [row])


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
    common.report(args, SCRIPT, argv, results, table)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_command(parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
