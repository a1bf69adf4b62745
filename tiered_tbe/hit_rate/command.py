"""The command line of ``tiered-tbe bench hit-rate``: ``build_parser`` adds its flags, ``run`` executes them.

See :mod:`tiered_tbe.hit_rate` for what the study measures and how.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable

from tqdm import tqdm

from tiered_tbe import records
from tiered_tbe.cache.hints import DEFAULT_LOOKAHEAD
from tiered_tbe.cache.policy import POLICIES as CACHE_POLICIES
from tiered_tbe.hit_rate.capacity import TargetResult, cache_slots, check_cache_size, find_smallest_cache
from tiered_tbe.hit_rate.plot import plot
from tiered_tbe.hit_rate.real_cache import (
    REAL_CACHE_POLICIES,
    REAL_CACHE_SIMULATION_MAX_LOOKUPS,
    check_real_cache_trace,
    check_real_cache_windows,
    disagreements,
    real_cache_device,
    run_real_cache,
)
from tiered_tbe.hit_rate.report import (
    append_record,
    counted_batches,
    describe_run,
    format_real_cache,
    format_results,
    format_targets,
    write_csv,
    write_json,
)
from tiered_tbe.hit_rate.runs import (
    OPTIMUM,
    POLICIES,
    Measurement,
    SimOptions,
    base_policy,
    expand_policies,
    is_policy_name,
    no_bar,
    reads_window,
    resolve_policy,
    sweep,
)
from tiered_tbe.specs import CacheConfig
from tiered_tbe.traces import (
    CRITEO_KAGGLE_TABLE_ROWS,
    FILE_FORMATS,
    Trace,
    criteo_trace,
    drifting_zipf_trace,
    load_trace,
    zipf_trace,
)

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}  # weights of a planned model, by name


def _checked(convert: Callable[[str], object], valid: Callable, expected: str) -> Callable[[str], object]:
    """An argparse ``type``: ``convert`` the text and check it is ``valid``, or say what was expected."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not valid(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


def _split(convert: Callable[[str], object]) -> Callable[[str], list]:
    return lambda text: [convert(part) for part in text.split(",")]


def _rate(text: str) -> float:
    return float(text[:-1]) / 100 if text.endswith("%") else float(text)


def _policy_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if not is_policy_name(name)]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown policy {', '.join(unknown) or '(none)'}; choose from "
                                         f"{', '.join(POLICIES)}")
    return list(dict.fromkeys(names))


def _windows(text: str) -> list[int]:
    """``--lookahead-window``: one window or comma-separated windows, each >= 1 (repeats dropped)."""
    parts = [part.strip() for part in text.split(",")]
    try:
        windows = [int(part) for part in parts]
    except ValueError:
        windows = []
    if not windows or any(w < 1 for w in windows):
        raise argparse.ArgumentTypeError(f"expected a window >= 1 (batches), or comma-separated windows such as "
                                         f"8,16,32, got {text!r}")
    return list(dict.fromkeys(windows))


def lookahead_windows(args: argparse.Namespace) -> list[int]:
    """The windows of ``--lookahead-window`` (the default is a bare int)."""
    value = args.lookahead_window
    return [value] if isinstance(value, int) else list(value)


def policies_from_args(args: argparse.Namespace) -> list[str]:
    """``--policies``, with ``lookahead`` as ``lookahead(W)`` per window when several are given."""
    return expand_policies(args.policies, lookahead_windows(args))


def _cache_sizes(text: str) -> list[str]:
    try:
        return [check_cache_size(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


_positive_int = _checked(int, lambda v: v >= 1, "a whole number >= 1")
_non_negative_int = _checked(int, lambda v: v >= 0, "a whole number >= 0")
_seed = _checked(int, lambda v: v >= 0, "a whole number >= 0")
_alphas = _checked(_split(float), lambda values: all(0 < v < math.inf for v in values),
                   "an alpha > 0, or comma-separated alphas")
_table_rows = _checked(_split(int), lambda values: all(v >= 1 for v in values),
                       "comma-separated rows per table, each >= 1")
_target = _checked(_rate, lambda v: 0 < v <= 1, "a hit rate in (0, 1] such as 0.95 or 95%")
_tolerance = _checked(float, lambda v: 0 < v < 1, "a fraction in (0, 1) such as 0.01")


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the flags of ``bench hit-rate`` to ``parser`` (a new one if None) and return it."""
    parser = parser or argparse.ArgumentParser(prog="tiered-tbe bench hit-rate")
    parser.description = ("Cache hit rate of the slot cache's policies (exact CPU simulator) against fully\n"
                          "associative LRU and offline Belady, over synthetic or recorded lookup traces.")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = FILE_FORMATS + "\nPolicies:\n" + "\n".join(f"  {p.name:<8} {p.description}"
                                                             for p in POLICIES.values())

    trace = parser.add_argument_group("trace")
    trace.add_argument("--trace", choices=("zipf", "drift", "criteo", "file"), default="zipf",
                       help="zipf: one table, Zipf(alpha) lookups; drift: Zipf whose hot rows change over "
                            "time; criteo: the 26 Criteo Kaggle tables; file: --file (default: zipf)")
    trace.add_argument("--alpha", type=_alphas,
                       help="Zipf exponent, > 0 (1.0 is Zipf, not uniform); criteo: one value or 26 "
                            "(default 1.05)")
    trace.add_argument("--rows", type=_positive_int,
                       help="rows of the table, zipf and drift (default 1000000)")
    trace.add_argument("--batch-size", type=_positive_int,
                       help="bags per table per batch (default 2048; file: from the file if it says)")
    trace.add_argument("--bag-size", type=_positive_int,
                       help="lookups per bag (default 20 for zipf and drift, 1 for criteo and text files)")
    trace.add_argument("--batches", type=_positive_int, help="batches to generate (default 250)")
    trace.add_argument("--seed", type=_seed, default=0, help="seed of the generators (default 0)")
    trace.add_argument("--drift-period", type=_positive_int,
                       help="drift: batches for the popularity to move fully to a new ranking (default 100)")
    trace.add_argument("--row-cap", type=_positive_int, help="criteo: at most this many rows per table")
    trace.add_argument("--file", help="file: the trace (.pt, .npy, .npz or text; see below)")
    trace.add_argument("--table-rows", type=_table_rows,
                       help="file: comma-separated rows per table when the file's indices are table-local")

    cache = parser.add_argument_group("cache")
    cache.add_argument("--policies", type=_policy_list, default=list(POLICIES),
                       help=f"comma-separated, any of {', '.join(POLICIES)} (default: all)")
    cache.add_argument("--cache-sizes", type=_cache_sizes, default=["1%", "2%", "5%", "10%", "20%"],
                       help="comma-separated: percent of rows (5%%), fraction (0.05), rows (100000) or bytes "
                            "(512MiB); rounded up to whole sets (default 1%%,2%%,5%%,10%%,20%%)")
    cache.add_argument("--associativity", type=_positive_int, default=32, help="ways per set (default 32)")
    cache.add_argument("--lfu-decay-interval", type=_positive_int, default=64,
                       help="LFU halves its use counts every this many batches (default 64)")
    cache.add_argument("--lookahead-window", type=_windows, default=DEFAULT_LOOKAHEAD,
                       help="lookahead knows the rows of this many batches after the one being "
                            f"prefetched (default {DEFAULT_LOOKAHEAD}: PrefetchPipeline's default, so a study "
                            "with default flags models training); comma-separated windows (8,16,32) run one "
                            "lookahead(W) policy per window")
    cache.add_argument("--full-window", action="store_true",
                       help="add max(--lookahead-window) batches to the trace that no policy runs, only "
                            "lookahead's window and Belady's next uses see (a file's last batches serve "
                            "instead); changes Belady's traffic near the end, the policies' counters hardly")
    cache.add_argument("--pipeline-depth", type=_non_negative_int, default=0,
                       help="batches prefetched ahead of the one training, whose rows stay locked, as "
                            "PrefetchPipeline(depth=D) holds them (default 0: serial training); the bounds "
                            "ignore it")
    cache.add_argument("--warmup", type=_non_negative_int, default=0,
                       help="the first this many batches run but are not counted: every figure is over the "
                            "batches after them, a cache in steady state (default 0)")
    cache.add_argument("--dim", type=_positive_int, default=128,
                       help="embedding dim, for bytes (default 128)")
    cache.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="fp32",
                       help="weights dtype (default fp32)")
    cache.add_argument("--optimizer", choices=list(_optimizers()), default="rowwise_adagrad",
                       help="its per-row fp32 state travels with the row (default rowwise_adagrad)")
    cache.add_argument("--inference", action="store_true", help="no updates: nothing is written back")
    cache.add_argument("--real-cache", action="store_true",
                       help="also run the real SlotCache (its Numba kernels; in the CUDA simulator without a GPU: "
                            f"traces of at most {REAL_CACHE_SIMULATION_MAX_LOOKUPS:,} lookups) for every policy "
                            f"of the cache ({', '.join(REAL_CACHE_POLICIES)}), print both, exit 1 if they disagree")

    target = parser.add_argument_group("capacity")
    target.add_argument("--target-hit-rate", type=_target,
                        help="find the smallest cache reaching this hit rate (0.95 or 95%%), per policy")
    target.add_argument("--target-metric", choices=("lookup", "unique"), default="lookup",
                        help="hit rate the target refers to (default lookup)")
    target.add_argument("--target-tolerance", type=_tolerance, default=0.01,
                        help="stop the search when the answer is within this relative distance "
                             "(default 0.01)")

    output = parser.add_argument_group("output")
    output.add_argument("--csv", help="write every measurement to this CSV file")
    output.add_argument("--json", help="write trace, options, measurements and targets to this JSON file")
    output.add_argument("--plot", help="write a PNG plot of hit rate and rows moved against cache size")
    output.add_argument("--record", metavar="PATH",
                        help="append one JSON line per policy and cache size to PATH (date, machine, versions, "
                             "commit, command, configuration, figures: tiered_tbe.records)")
    output.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


# Flags that only some trace kinds take (None when not given), and the kinds that take them.
_TRACE_FLAGS = {
    "alpha": ("zipf", "drift", "criteo"), "rows": ("zipf", "drift"), "batches": ("zipf", "drift", "criteo"),
    "drift_period": ("drift",), "row_cap": ("criteo",), "file": ("file",), "table_rows": ("file",),
}


def trace_from_args(args: argparse.Namespace) -> Trace:
    """The trace the flags describe; ``ValueError`` for flags that do not fit the trace kind."""
    kind = args.trace
    for name, kinds in _TRACE_FLAGS.items():
        if kind not in kinds and getattr(args, name) is not None:
            hint = " (use --row-cap)" if (name, kind) == ("rows", "criteo") else ""
            raise ValueError(f"--{name.replace('_', '-')} does not apply to --trace {kind}{hint}")
    alphas = args.alpha or [1.05]
    batches = (args.batches or 250) + future_batches(args)  # a file's own last batches are its future
    batch_size = args.batch_size or 2048
    if kind in ("zipf", "drift") and len(alphas) != 1:
        raise ValueError(f"--trace {kind} takes one --alpha, got {len(alphas)}")
    if kind == "zipf":
        return zipf_trace(args.rows or 1_000_000, alphas[0], batch_size, args.bag_size or 20, batches,
                          seed=args.seed)
    if kind == "drift":
        return drifting_zipf_trace(args.rows or 1_000_000, alphas[0], batch_size, args.bag_size or 20,
                                   batches, drift_period=args.drift_period or 100, seed=args.seed)
    if kind == "criteo":
        if len(alphas) not in (1, len(CRITEO_KAGGLE_TABLE_ROWS)):
            raise ValueError(f"--trace criteo takes one --alpha or {len(CRITEO_KAGGLE_TABLE_ROWS)}, "
                             f"got {len(alphas)}")
        return criteo_trace(alphas[0] if len(alphas) == 1 else alphas, batch_size, batches,
                            bag_size=args.bag_size or 1, row_cap=args.row_cap, seed=args.seed)
    if args.file is None:
        raise ValueError("--trace file needs --file PATH")
    # For a file, --batch-size only cuts lookups that the file does not cut into batches itself.
    return load_trace(args.file, batch_size=args.batch_size, bag_size=args.bag_size or 1,
                      table_rows=args.table_rows)


def _optimizers() -> dict:
    """The optimizer registry, loaded when the command runs: it loads Triton (each optimizer's update
    is a Triton function), which the simulations themselves never need."""
    from tiered_tbe.optimizers import OPTIMIZERS

    return OPTIMIZERS


def options_from_args(args: argparse.Namespace) -> SimOptions:
    weight_bytes = args.dim * DTYPE_BYTES[args.dtype]
    row_bytes = weight_bytes + 4 * _optimizers()[args.optimizer]().state_width(args.dim)
    return SimOptions(associativity=args.associativity, weight_bytes=weight_bytes, row_bytes=row_bytes,
                      training=not args.inference, lfu_decay_interval=args.lfu_decay_interval,
                      lookahead_window=lookahead_windows(args)[0],
                      pipeline_depth=getattr(args, "pipeline_depth", 0), warmup_batches=getattr(args, "warmup", 0),
                      future_batches=future_batches(args))


def future_batches(args: argparse.Namespace) -> int:
    """Batches at the end of the trace that only lookahead's window sees (``--full-window``)."""
    windowed = [name for name in args.policies if reads_window(name)]
    if not getattr(args, "full_window", False) or not windowed:
        return 0
    options = SimOptions(lookahead_window=lookahead_windows(args)[0])
    return max(lookahead_windows(args) + [resolve_policy(name, options)[1].lookahead_window for name in windowed])


def _check_outputs(args: argparse.Namespace) -> None:
    for flag in ("csv", "json", "plot"):
        path = getattr(args, flag)
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise ValueError(f"--{flag.replace('_', '-')} {path}: the folder does not exist")
    if args.record:
        records.check_path(args.record)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'tiered-tbe[plot]'") from None


def run(args: argparse.Namespace, out=None) -> int:
    """Execute ``bench hit-rate`` for parsed ``args``; print to ``out`` (stdout). Returns 0.

    Raises ``ValueError`` for arguments that do not fit together (the CLI prints it as a usage error).
    """
    out = out or sys.stdout
    _check_outputs(args)  # before minutes of simulation, not after
    options = options_from_args(args)
    progress = False if args.no_progress else None

    start = time.perf_counter()
    if progress is None and sys.stderr.isatty():  # a large trace takes seconds to build
        print("building the trace ...", file=sys.stderr, flush=True)
    trace = trace_from_args(args)
    options.check(trace)
    policies = policies_from_args(args)
    if args.real_cache:
        check_real_cache_trace(trace)
        check_real_cache_windows(policies, options)
    counted = counted_batches(trace, options)
    print(f"trace: {trace.description}\n"
          f"       {trace.num_lookups:,} lookups, {trace.num_rows:,} rows ({counted.touched:,} touched), "
          f"built in {time.perf_counter() - start:.1f} s", file=out)
    print(f"cache: {options.associativity}-way sets, {options.row_bytes} B per row "
          f"({args.dim} x {args.dtype} + {args.optimizer} state), {describe_run(options, policies)}", file=out)
    if options.warmup_batches or options.future_batches:
        print(f"counted: {counted.describe()}", file=out)

    results = sweep(trace, policies, cache_slots(args.cache_sizes, trace.num_rows, options), options,
                    progress=progress)
    print("\n" + format_results(results), file=out)
    no_slot_results = [m for m in results if m.policy != OPTIMUM and m.stats.misses_no_slot]
    # Rows a batch reads in place, beside the copy rows a module keeps of them by default (the forward
    # copies them for the backward; CacheConfig.in_place_copies sizes the copies).
    no_slot = [f"{m.policy} @ {m.size_label} {100 * m.stats.misses_no_slot / m.stats.unique_misses:.0f}% "
               f"({m.stats.misses_no_slot / max(m.stats.batches, 1):,.0f} rows a batch; copy rows by default: "
               f"{CacheConfig().copy_rows(m.num_slots):,}; set full: "
               f"{m.stats.misses_set_full / max(m.stats.batches, 1):,.0f} a batch)"
               for m in no_slot_results]
    if no_slot:  # a cache smaller than a batch's rows (or the batches in flight): the rest bypasses it
        lockers = "their own batch" + (f" and the {options.pipeline_depth} before it (the bounds: their own only)"
                                       if options.pipeline_depth else "")
        refused = ("refused by a policy that admits misses (its victim used at least as often, or needed no "
                   "later) or ") if any(base_policy(m.policy) in CACHE_POLICIES
                                        and CACHE_POLICIES[base_policy(m.policy)].refuses_misses
                                        for m in no_slot_results) else ""
        print(f"misses read in place (set full: every way of their set locked by {lockers}; the rest {refused}"
              f"left in place by a batch in flight): " + ", ".join(no_slot), file=out)

    mismatches: list[Measurement] = []
    if args.real_cache:
        checked = run_real_cache(trace, results, options, progress=progress)
        if checked:
            print(f"\nthe same trace through the real cache (SlotCache in {real_cache_device()}) beside the "
                  f"simulator:\n" + format_real_cache(checked), file=out)
        mismatches = [m for m in checked if not m.real_cache_agrees]
        if checked and not mismatches:
            print(f"real cache and simulator agree on every counter ({len(checked)} runs)", file=out)
        if not checked:
            print(f"--real-cache: no policy with a real cache among --policies ({', '.join(REAL_CACHE_POLICIES)} "
                  "have one; the bounds do not)", file=out)

    targets: list[TargetResult] = []
    if args.target_hit_rate is not None:
        with tqdm(desc=f"searching for {100 * args.target_hit_rate:g}% hits", unit="run",
                  disable=no_bar(progress), file=sys.stderr) as bar:
            for policy in policies:
                targets.append(find_smallest_cache(trace, policy, args.target_hit_rate, options,
                                                   metric=args.target_metric, known=results,
                                                   tolerance=args.target_tolerance, bar=bar))
        print(f"\nsmallest cache reaching {100 * args.target_hit_rate:g}% hits by {args.target_metric} "
              f"(within {100 * args.target_tolerance:g}% or one set):", file=out)
        print(format_targets(targets, trace.num_rows), file=out)

    for path, write in ((args.csv, lambda p: write_csv(p, results, trace)),
                        (args.json, lambda p: write_json(p, results, targets, trace, options)),
                        (args.plot, lambda p: plot(p, results, trace, targets, options))):
        if path:
            write(path)
            print(f"wrote {path}", file=out)
    if args.record:
        command = getattr(args, "command_line", None) or "tiered_tbe.hit_rate.run(...) from Python"
        written = append_record(args.record, results, trace, options, command, counted)
        print(f"appended {written} records to {args.record}", file=out)
    if mismatches:
        warning = "\n".join(f"  {m.policy} @ {m.size_label} ({m.num_slots:,} slots): {disagreements(m)}"
                             for m in mismatches)
        message = (f"WARNING: the real cache (SlotCache) and the exact simulator DISAGREE in {len(mismatches)} "
                   f"run(s) (counter: simulator vs real cache):\n{warning}")
        print("\n" + message, file=out)
        if out is not sys.stderr:
            print(message, file=sys.stderr)
        return 1
    return 0
