"""Helpers shared by the benchmarks: timing, host-bus bandwidth, flags, records (batches: ``sampling.py``).

Import ``tiered_tbe`` (or anything under it) before this module in a script, so that CPU
simulation mode is chosen before triton or numba load; this module imports it first itself.

- :func:`time_ms`: median milliseconds of a callable (``triton.testing.do_bench`` on a GPU).
- :class:`StepTimer`: CUDA events around the phases of every step (prefetch, forward, ...),
  read once at the end; medians and totals per phase.
- :func:`pinned_copy_bandwidth`: pinned host <-> device ``memcpy`` GB/s, the bus ceiling.
- :func:`add_table_flags`, :func:`add_cache_flags`, :func:`add_output_flags`, :func:`check_table_args`,
  :func:`table_rows_of`: the flags every benchmark shares (``--tables --rows --dim --batch-size
  --bag-size --alpha --dtype``, ``--cache-fraction --policy``, ``--json PATH --record PATH``), one spelling.
- :func:`report`: print a benchmark's table, write its ``--json`` and append one JSON line per
  measurement to ``--record`` (:mod:`tiered_tbe.records`, the one writer, shared with
  ``tiered-tbe bench hit-rate``).

In simulation mode every "time" is of the CPU interpreter and means nothing; the helpers still
run, so the benchmarks can be tested without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import shlex
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from tiered_tbe import records
from tiered_tbe.base.mode import SIMULATION
from tiered_tbe.specs import WEIGHTS_DTYPES
from tiered_tbe.traces import CRITEO_KAGGLE_TABLE_ROWS

DTYPES = WEIGHTS_DTYPES  # --dtype: the weights dtype, by name
SIMULATION_NOTE = ("SIMULATION: kernels run in the Triton interpreter and the Numba CUDA simulator; "
                   "timings are meaningless.")


# ------------------------------------------------------------------------------------ timing


def synchronize() -> None:
    if not SIMULATION:
        torch.cuda.synchronize()


def beside(side_fn: Callable[[], object], fn: Callable[[], object], side: torch.cuda.Stream | None) -> None:
    """``side_fn()`` on the ``side`` stream beside ``fn()`` on the current one, the current stream then
    waiting for both (one after the other where there is no side stream: on the CPU)."""
    if side is None:
        side_fn()
        fn()
        return
    current = torch.cuda.current_stream(side.device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        side_fn()
    fn()
    current.wait_stream(side)


def time_ms(fn: Callable[[], object], rep_ms: float = 200.0) -> float:
    """Median milliseconds of ``fn()``: ``do_bench`` on a GPU (CUDA events, warm-up included),
    a wall clock over three calls after one warm-up call in simulation."""
    if SIMULATION:
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    import triton.testing

    return triton.testing.do_bench(fn, warmup=max(25.0, rep_ms / 4), rep=rep_ms, quantiles=[0.5, 0.2, 0.8])[0]


def event_ms(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median ms of ``fn()`` between two CUDA events on the current stream, after ``warmup``
    calls, the L2 left warm (``time_ms``'s ``do_bench`` empties it before each call); a wall
    clock in simulation."""
    for _ in range(warmup):
        fn()
    synchronize()
    times = []
    for _ in range(repeats):
        if SIMULATION:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
            continue
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def wall_ms(fn: Callable[[], object], repeats: int = 5) -> float:
    """Median wall-clock milliseconds of ``fn()`` with the device synchronized before and after
    each call (for work that mixes host threads and the GPU), after one warm-up call."""
    fn()
    synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


class StepTimer:
    """Times named phases of repeated steps with CUDA events on the current stream.

    ``mark(name)`` ends the phase ``name`` that began at the previous mark of the step (or at
    ``start()``). Nothing waits for the device until :meth:`phases` reads every event once, so
    the timing adds no host sync between steps. In simulation a host clock stands in (the
    work is synchronous there).

    Example::

        timer = StepTimer()
        for batch in batches:
            timer.start(); emb.prefetch(i, o); timer.mark("prefetch"); out = emb(i, o); timer.mark("forward")
        timer.phases()   # {"prefetch": [ms, ...], "forward": [ms, ...]}
    """

    def __init__(self):
        self._steps: list[list[tuple[str, object]]] = []

    def _stamp(self):
        if SIMULATION:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._steps.append([("", self._stamp())])

    def mark(self, name: str) -> None:
        self._steps[-1].append((name, self._stamp()))

    def discard(self) -> None:
        """Forget the step begun last (it did not happen)."""
        self._steps.pop()

    def phases(self) -> dict[str, list[float]]:
        """Milliseconds of every phase of every step, and ``"step"`` (first to last mark)."""
        synchronize()
        out: dict[str, list[float]] = {}
        for marks in self._steps:
            for (_, before), (name, after) in zip(marks, marks[1:]):
                out.setdefault(name, []).append(_elapsed_ms(before, after))
            out.setdefault("step", []).append(_elapsed_ms(marks[0][1], marks[-1][1]))
        return out


def _elapsed_ms(before, after) -> float:
    if SIMULATION:
        return (after - before) * 1e3
    return before.elapsed_time(after)


# What a step may do besides enqueueing its kernels, each a count so far (step_counters): the caching
# allocators' calls into CUDA (cudaFree, and a retry after a failed allocation, synchronize the device;
# so do the syncs of every stream that free memory recorded on other streams) and, for a module of
# ours, the CUDA graphs captured or run eagerly rather than replayed. In a steady state each should be 0.
ALLOCATOR_COUNTERS = {"device_mallocs": "num_device_alloc", "device_frees": "num_device_free",
                      "alloc_retries": "num_alloc_retries", "allocator_syncs": "num_sync_all_streams"}
HOST_ALLOCATOR_COUNTERS = {"host_mallocs": "num_host_alloc", "host_frees": "num_host_free"}


def step_counters(*graph_owners) -> Callable[[], dict[str, int]]:
    """A function that returns the counts so far of what a step may do besides its kernels: the
    CUDA caching allocator's and pinned-host allocator's calls into CUDA (:data:`ALLOCATOR_COUNTERS`,
    :data:`HOST_ALLOCATOR_COUNTERS`; on a GPU only) and the captures, replays and eager runs of every
    :class:`~tiered_tbe.base.graphs.StepGraphs` that an object of ``graph_owners`` holds as an
    attribute (our module and its slot cache)."""
    from tiered_tbe.base.graphs import StepGraphs

    graphs = [value for owner in graph_owners if owner is not None
              for value in vars(owner).values() if isinstance(value, StepGraphs)]

    def counts() -> dict[str, int]:
        out: dict[str, int] = {}
        if graphs:
            out.update(graph_captures=sum(g.captures for g in graphs), graph_replays=sum(g.replays for g in graphs),
                       graph_eager_runs=sum(g.eager for g in graphs))
        if not SIMULATION:
            stats = torch.cuda.memory_stats()
            out.update({name: int(stats.get(key, 0)) for name, key in ALLOCATOR_COUNTERS.items()})
            host_stats = getattr(torch.cuda, "host_memory_stats", None)
            if host_stats is not None:
                stats = host_stats()
                out.update({name: int(stats.get(key, 0)) for name, key in HOST_ALLOCATOR_COUNTERS.items()})
        return out

    return counts


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def free() -> None:
    """Give back the memory of modules the caller has dropped (pinned memory goes with them)."""
    gc.collect()
    if not SIMULATION:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ flags


def _default_help(name: str, gpu: dict, simulation: dict, fallback: str = "") -> str:
    """``(default X; Y in simulation)`` from the scripts' GPU and simulation defaults."""
    if name not in gpu:
        return f"(default {fallback})" if fallback else ""
    if gpu[name] == simulation.get(name, gpu[name]):
        return f"(default {gpu[name]})"
    return f"(default {gpu[name]}; {simulation[name]} in simulation)"


def add_table_flags(parser: argparse.ArgumentParser, gpu: dict, simulation: dict, criteo: bool = True,
                    alphas: Sequence[float] = (1.05, 1.2)) -> None:
    """The model's shape: ``--tables --rows [--row-cap] --dim --dtype --batch-size --bag-size --alpha``.

    Sizes left unset take ``gpu`` (or, in simulation, ``simulation``) defaults in
    :func:`check_table_args`. ``criteo``: without ``--rows`` the tables are the first
    ``--tables`` Criteo Kaggle tables (``--row-cap`` caps them); else every table has ``--rows``.
    """
    group = parser.add_argument_group("model")
    if criteo:
        group.add_argument("--tables", "--num-tables", dest="tables", type=int,
                           help="tables: the first N Criteo Kaggle tables, or N tables of --rows rows "
                                + _default_help("tables", gpu, simulation))
        group.add_argument("--rows", type=int,
                           help="rows of every table, instead of the Criteo Kaggle cardinalities (default: those)")
        group.add_argument("--row-cap", type=int,
                           help="cap every Criteo Kaggle table at this many rows; 0 = none "
                                + _default_help("row_cap", gpu, simulation))
    else:
        group.add_argument("--tables", "--num-tables", dest="tables", type=int,
                           help="tables of --rows rows each " + _default_help("tables", gpu, simulation))
        group.add_argument("--rows", type=int, help="rows of every table " + _default_help("rows", gpu, simulation))
    group.add_argument("--dim", type=int, help="embedding dim " + _default_help("dim", gpu, simulation))
    group.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                       help="weights dtype (default fp32); optimizer state is fp32")
    group.add_argument("--batch-size", type=int,
                       help="samples (bags per table) per batch " + _default_help("batch_size", gpu, simulation))
    group.add_argument("--bag-size", type=int,
                       help="lookups per table per sample " + _default_help("bag_size", gpu, simulation, "1"))
    group.add_argument("--alpha", type=float, nargs="+", default=list(alphas),
                       help=f"Zipf exponents, one run each (default: {' '.join(f'{a:g}' for a in alphas)}; "
                            "0 = uniform)")


def add_cache_flags(parser: argparse.ArgumentParser, policies: Sequence[str], several: bool = False) -> None:
    """``--cache-fraction --policy --associativity``; ``several``: ``--policy`` takes a list (alias
    ``--policies``), one run each."""
    group = parser.add_argument_group("cache")
    group.add_argument("--cache-fraction", type=float, default=0.05,
                       help="slot cache size, fraction of all rows (default 0.05)")
    if several:
        group.add_argument("--policy", "--policies", dest="policies", nargs="+", default=list(policies),
                           choices=policies, metavar="POLICY",
                           help=f"cache policies, one run each: {', '.join(policies)} (default: all)")
    else:
        group.add_argument("--policy", default=policies[0], choices=policies,
                           help=f"cache policy (default {policies[0]})")
    group.add_argument("--associativity", type=int, default=32, help="ways per cache set (default 32)")


def add_output_flags(parser: argparse.ArgumentParser) -> None:
    """``--json PATH --record PATH``."""
    group = parser.add_argument_group("output")
    group.add_argument("--json", type=Path, metavar="PATH", help="also write the results to this JSON file")
    group.add_argument("--record", type=Path, metavar="PATH",
                       help="append one JSON line per measurement to PATH (date, device, versions, commit, command, "
                            "configuration, figures: tiered_tbe.records); nothing is recorded without it")


def check_table_args(args: argparse.Namespace, gpu: dict, simulation: dict, criteo: bool = True) -> None:
    """Fill unset sizes from the GPU (or simulation) defaults; ``ValueError`` for sizes that do not fit.

    With ``--rows`` the simulation default ``row_cap`` does not apply (the rows are given).
    """
    defaults = simulation if SIMULATION else gpu
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            if name == "row_cap" and args.rows is not None:
                continue
            setattr(args, name, value)
    if getattr(args, "record", None) is not None:
        records.check_path(args.record)  # before minutes of measuring, not after
    if getattr(args, "bag_size", 1) is None:
        args.bag_size = 1
    if args.tables < 1:
        raise ValueError(f"--tables must be >= 1, got {args.tables}")
    if criteo:
        if args.rows is not None and getattr(args, "row_cap", None):
            raise ValueError("--row-cap caps the Criteo Kaggle tables; with --rows every table has --rows rows: "
                             "give one of them")
        if args.rows is None and args.tables > len(CRITEO_KAGGLE_TABLE_ROWS):
            raise ValueError(f"--tables must be between 1 and {len(CRITEO_KAGGLE_TABLE_ROWS)} for the Criteo "
                             f"Kaggle tables (give --rows for more tables of one size)")
    for name in ("rows", "dim", "batch_size", "bag_size"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if any(a < 0 or not math.isfinite(a) for a in args.alpha):
        raise ValueError(f"--alpha: exponents must be finite and >= 0, got {args.alpha}")
    fraction = getattr(args, "cache_fraction", None)
    if fraction is not None and not 0 < fraction <= 1:
        raise ValueError(f"--cache-fraction must be in (0, 1], got {fraction}")


def table_rows_of(args: argparse.Namespace) -> list[int]:
    """Rows of every table: ``--tables`` tables of ``--rows``, or the first ``--tables`` Criteo Kaggle
    tables capped at ``--row-cap``."""
    if args.rows is not None:
        return [args.rows] * args.tables
    rows = list(CRITEO_KAGGLE_TABLE_ROWS[: args.tables])
    cap = getattr(args, "row_cap", 0)
    return [min(n, cap) for n in rows] if cap else rows


def describe_tables(args: argparse.Namespace) -> str:
    """``3 Criteo Kaggle tables (2,173 rows, capped at 1,000) x 16 fp32`` or ``4 tables of 1,000 rows x 16 fp16``."""
    rows = table_rows_of(args)
    if args.rows is not None:
        shape = f"{len(rows)} table{'s' if len(rows) > 1 else ''} of {args.rows:,} rows"
    else:
        cap = getattr(args, "row_cap", 0)
        shape = (f"{len(rows)} Criteo Kaggle tables ({sum(rows):,} rows" + (f", capped at {cap:,}" if cap else "")
                 + ")")
    return f"{shape} x {args.dim} {args.dtype}"


# ------------------------------------------------------------------------------------ host bus


def pinned_copy_bandwidth(gib: float, rep_ms: float = 200.0) -> dict[str, float]:
    """GB/s of one ``copy_`` of ``gib`` GiB from pinned host memory to the device and back
    (bytes moved once; ``do_bench`` medians). Random data, never zeros."""
    numel = max(1, int(gib * 2**30) // 4)
    device = "cpu" if SIMULATION else "cuda"
    on_device = torch.rand(numel, device=device)
    host = torch.empty(numel, pin_memory=not SIMULATION)
    host.copy_(on_device)  # random bytes both ways, drawn on the device (fast)
    to_device_ms = time_ms(lambda: on_device.copy_(host, non_blocking=True), rep_ms)
    to_host_ms = time_ms(lambda: host.copy_(on_device, non_blocking=True), rep_ms)
    nbytes = numel * 4
    return {"h2d_gbs": nbytes / to_device_ms / 1e6, "d2h_gbs": nbytes / to_host_ms / 1e6}


# ------------------------------------------------------------------------------------ reporting


def fmt(value, spec: str = ".3f") -> str:
    """``value`` formatted, ``-`` for None / NaN, strings unchanged."""
    if value is None or isinstance(value, str):
        return "-" if value is None else value
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return format(value, spec)


def script_command(script: str, argv: Sequence[str]) -> str:
    """The command line of a script run: ``python benchmarks/bench_cache.py --tables 3``. ``script``: a
    file of ``benchmarks/`` by name, or a path from the repository root (``tools/bench_host_memory.py``)."""
    return shlex.join(["python", script if "/" in script else f"benchmarks/{script}", *argv])


def command_of(args: argparse.Namespace, script: str, argv: Sequence[str] | None) -> str:
    """What ran: the ``tiered-tbe ...`` command line the CLI stored in ``args.command_line``, else
    the script's own (``argv``)."""
    return getattr(args, "command_line", None) or script_command(script, argv or [])


def write_json(path: Path, script: str, args, results) -> None:
    """Write the results (JSON-able), the arguments and the context (:func:`tiered_tbe.records.context`)."""
    document = {
        "script": script,
        **records.context(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                 if k not in ("run", "command_parser")},  # the CLI's plumbing
        "results": results,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1, default=str) + "\n")


def report(args, script: str, argv: Sequence[str] | None, results, table: Sequence[str],
           measurements: Sequence[tuple[dict, dict]] = ()) -> None:
    """Print a benchmark's table; write its JSON (``--json``) and append one record per
    measurement, a ``(configuration, figures)`` pair, to ``--record`` when asked."""
    print("\n".join(table))
    if args.json:
        write_json(args.json, script, args, results)
        print(f"wrote {args.json}")
    if args.record and measurements:
        append_records(args, script, argv, measurements)


def append_records(args, script: str, argv: Sequence[str] | None, measurements: Sequence[tuple[dict, dict]]) -> None:
    """Append one record per ``(configuration, figures)`` to ``--record`` (nothing without it)."""
    if not args.record:
        return
    command = command_of(args, script, argv)
    benchmark = Path(script).stem.removeprefix("bench_")
    extra = {"note": "simulation: times meaningless"} if SIMULATION else {}
    written = records.append(args.record, [records.measurement(benchmark, command, configuration, figures, **extra)
                                           for configuration, figures in measurements])
    print(f"appended {written} records to {args.record}")
