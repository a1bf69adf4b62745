"""The ``tiered-tbe`` command (also ``python -m tiered_tbe``).

Commands are argparse subcommands. Each lives in its own module, which provides
``build_parser(parser)`` (adds its flags to the subparser it is given) and a run function
(returns an exit code; anything else, such as a result dict, counts as 0); this file only
wires them together, by module name::

    tiered-tbe train ...              the main job: a DLRM-style model on a synthetic click trace
    tiered-tbe bench hit-rate ...     cache hit rate by policy and size (tiered_tbe.hit_rate)
    tiered-tbe bench kernels ...      Triton TBE kernels vs torch's embedding bags (benchmarks/bench_kernels.py)
    tiered-tbe bench cache ...        the slot cache vs all-HBM (benchmarks/bench_cache.py)
    tiered-tbe bench pipeline ...     the prefetch pipeline vs serial, all-HBM, managed (benchmarks/bench_pipeline.py)
    tiered-tbe bench fbgemm ...       ours beside FBGEMM_GPU's TBE on the same batches (benchmarks/bench_fbgemm.py)
    tiered-tbe bench torchrec ...     a DMP step, our sharder against TorchRec's kernels (benchmarks/bench_torchrec.py)

A command's module is imported only when that command runs (or its ``--help`` is asked for), so
the library never imports the benchmarks, and ``tiered-tbe train`` loads none of them. A new
command is one line of :data:`COMMANDS`. A run raises ``ValueError`` for arguments that do not
fit together; the command prints it as a usage error (exit code 2), like argparse's own errors.
``args.command_line`` holds the command as typed, for the records that ``--record`` writes.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    words: tuple[str, ...]  # ("train",) or ("bench", "hit-rate")
    summary: str
    module: str  # provides build_parser(parser) and the function named by `run`
    run: str = "run"


COMMANDS = (
    Command(("train",), "train a small DLRM-style model with tiered embedding tables (the main job)",
            "tiered_tbe.train"),
    Command(("bench", "hit-rate"), "cache hit rate of each policy and bound against cache size",
            "tiered_tbe.hit_rate.command"),
    Command(("bench", "kernels"), "time the Triton TBE kernels against torch's embedding bags (GPU)",
            "tiered_tbe.benchmarks.bench_kernels", "run_command"),
    Command(("bench", "cache"), "time prefetch, forward and backward through the slot cache against all-HBM (GPU)",
            "tiered_tbe.benchmarks.bench_cache", "run_command"),
    Command(("bench", "pipeline"), "time training steps with the prefetch pipeline against serial prefetch, "
            "all-HBM and managed memory (GPU)", "tiered_tbe.benchmarks.bench_pipeline", "run_command"),
    Command(("bench", "fbgemm"), "time training steps against FBGEMM_GPU's TBE side by side, in HBM and cached "
            "(GPU; needs fbgemm-gpu)", "tiered_tbe.benchmarks.bench_fbgemm", "run_command"),
    Command(("bench", "torchrec"), "time a DistributedModelParallel training step with our sharder against "
            "TorchRec's own kernels under the same plan (GPU; needs torchrec)", "tiered_tbe.benchmarks.bench_torchrec",
            "run_command"),
)
GROUPS = {"bench": "benchmarks of tiered-tbe"}


def version() -> str:
    try:
        return importlib.metadata.version("tiered-tbe")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the commands ``argv`` names get their flags (their modules are imported).
    ``argv=None``: every command's."""
    parser = argparse.ArgumentParser(
        prog="tiered-tbe",
        description="Table-batched embedding bags for tables larger than GPU memory: training, benchmarks and tools.",
    )
    parser.add_argument("--version", action="version", version=f"tiered-tbe {version()}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for command in COMMANDS:
        *group, name = command.words
        if group and group[0] not in groups:
            group_parser = commands.add_parser(group[0], help=GROUPS[group[0]], description=GROUPS[group[0]])
            groups[group[0]] = group_parser.add_subparsers(title=group[0], metavar="BENCHMARK", required=True)
        parent = groups[group[0]] if group else commands
        subparser = parent.add_parser(name, help=command.summary, description=command.summary)
        if argv is None or list(argv[: len(command.words)]) == list(command.words):
            module = importlib.import_module(command.module)
            module.build_parser(subparser)
            subparser.set_defaults(run=getattr(module, command.run), command_parser=subparser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command, return its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
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
