"""The ``tiered-tbe`` command (also ``python -m tiered_tbe``).

Commands are argparse subcommands. Each lives in its own module, which provides
``build_parser(parser)`` (adds its flags to the subparser it is given) and ``run(args)``
(returns an exit code; anything else, such as a result dict, counts as 0); this file only
wires them together::

    tiered-tbe train ...              the main job: a DLRM-style model on a synthetic click trace
    tiered-tbe bench hit-rate ...     cache hit rate by policy and size (tiered_tbe.hit_rate)
    tiered-tbe bench kernels ...      Triton TBE kernels vs torch's embedding bags (benchmarks/bench_kernels.py)
    tiered-tbe bench cache ...        the slot cache vs all-HBM (benchmarks/bench_cache.py)
    tiered-tbe bench pipeline ...     the prefetch pipeline vs serial, all-HBM, managed (benchmarks/bench_pipeline.py)
    tiered-tbe bench fbgemm ...       ours beside FBGEMM_GPU's TBE on the same batches (benchmarks/bench_fbgemm.py)

A new command is one ``_add_command`` line. A ``run`` raises ``ValueError`` for arguments that
do not fit together; the command prints it as a usage error (exit code 2), like argparse's own
errors. ``args.command_line`` holds the command as typed, for the records that ``--record`` writes.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Sequence

from tiered_tbe import hit_rate, train
from tiered_tbe.benchmarks import bench_cache, bench_fbgemm, bench_kernels, bench_pipeline


def _add_command(
    commands: argparse._SubParsersAction,
    name: str,
    summary: str,
    build_parser: Callable[[argparse.ArgumentParser], argparse.ArgumentParser],
    run: Callable[[argparse.Namespace], object],
) -> argparse.ArgumentParser:
    parser = commands.add_parser(name, help=summary, description=summary)
    build_parser(parser)
    parser.set_defaults(run=run, command_parser=parser)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiered-tbe",
        description="Table-batched embedding bags for tables larger than GPU memory: benchmarks and tools.",
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    bench = commands.add_parser("bench", help="benchmarks", description="Benchmarks of tiered-tbe.")
    benchmarks = bench.add_subparsers(title="benchmarks", metavar="BENCHMARK", required=True)
    _add_command(commands, "train", "train a small DLRM-style model with tiered embedding tables (the main job)",
                 train.build_parser, train.run)
    _add_command(benchmarks, "hit-rate", "cache hit rate of each policy and bound against cache size",
                 hit_rate.build_parser, hit_rate.run)
    _add_command(benchmarks, "kernels", "time the Triton TBE kernels against torch's embedding bags (GPU)",
                 bench_kernels.build_parser, bench_kernels.run_command)
    _add_command(benchmarks, "cache", "time prefetch, forward and backward through the slot cache against "
                 "all-HBM (GPU)", bench_cache.build_parser, bench_cache.run_command)
    _add_command(benchmarks, "pipeline", "time training steps with the prefetch pipeline against serial "
                 "prefetch, all-HBM and managed memory (GPU)", bench_pipeline.build_parser, bench_pipeline.run_command)
    _add_command(benchmarks, "fbgemm", "time training steps against FBGEMM_GPU's TBE side by side, in HBM and "
                 "cached (GPU; needs fbgemm-gpu)", bench_fbgemm.build_parser, bench_fbgemm.run_command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command, return its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.command_line = shlex.join(["tiered-tbe", *argv])
    try:
        code = args.run(args)
    except (ValueError, OSError) as error:
        # Bad flag combinations, unreadable trace files, unwritable output paths: the user's to fix,
        # so a usage message rather than a traceback.
        args.command_parser.error(str(error))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return code if isinstance(code, int) else 0  # a run may return a result (a dict) instead of a code
