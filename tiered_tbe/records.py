"""How a measurement is reported: one path for the benchmarks and the hit-rate study.

Every record says when, where and from which code it was measured, and how to measure it
again: a markdown section of ``benchmarks/RESULTS.md`` (GPU benchmarks) or
``benchmarks/HIT_RATES.md`` (``tiered-tbe bench hit-rate --record``) reads::

    ## <title>

    <date>, <device>, commit <commit>

    `<command>`

    <lines: a table, notes>

and a JSON report carries the same context (:func:`context`). The benchmarks
(``tiered_tbe.benchmarks.common``) and :mod:`tiered_tbe.hit_rate` both write through here.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

import torch

from tiered_tbe.base.mode import SIMULATION


def results_file(name: str) -> Path:
    """``benchmarks/<name>`` of the checkout this package runs from (an editable install), else
    ``./<name>`` (an installed package ships no results files). Loads no benchmark module."""
    spec = importlib.util.find_spec("tiered_tbe.benchmarks")
    if spec is not None and spec.origin is not None:
        beside = Path(spec.origin).with_name(name)
        if beside.exists():
            return beside
    return Path.cwd() / name


def device_name() -> str:
    return "CPU simulation" if SIMULATION else torch.cuda.get_device_name()


def git_commit() -> str:
    """Short commit of the checkout, ``+uncommitted`` when tracked files changed; ``unknown``
    outside a git checkout. ``TIERED_TBE_COMMIT`` overrides it: the lent GPU machine runs a copy
    of the working tree whose git metadata may be stale (docs/GPU.md passes the real commit)."""
    if os.environ.get("TIERED_TBE_COMMIT"):
        return os.environ["TIERED_TBE_COMMIT"]
    here = Path(__file__).parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                                cwd=here).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=here).stdout.strip()
        return commit + ("+uncommitted" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def context(device: str | None = None) -> dict:
    """``date``, ``device`` (default :func:`device_name`), ``simulation``, ``commit``: what every report carries."""
    return dict(date=datetime.datetime.now().isoformat(timespec="seconds"), device=device or device_name(),
                simulation=SIMULATION, commit=git_commit())


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str | None = None) -> list[str]:
    """Lines of a markdown table. ``align``: one of ``l``/``r`` per column (default: first left, rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---" if a == "l" else "---:" for a in align]
    return ["| " + " | ".join(cells) + " |" for cells in (header, rule, *rows)]


def append_section(path: Path | str, file_title: str, title: str, command: str, lines: Sequence[str],
                   device: str | None = None, note: str = "") -> None:
    """Append a record (see the module docstring) to ``path``; a new file gets ``# file_title`` first.

    Args:
        title: the section's heading (a script's name, a trace's description).
        command: the command line that measured it, to be run again.
        lines: the body: tables and notes.
        device: where it ran (default :func:`device_name`).
        note: appended to the command's line, e.g. that simulated times mean nothing.
    """
    path = Path(path)
    header = "" if path.exists() else f"# {file_title}\n"
    date = datetime.date.today().isoformat()
    with path.open("a") as out:
        out.write(f"{header}\n## {title}\n\n{date}, {device or device_name()}, commit {git_commit()}\n\n"
                  f"`{command}`{note}\n\n" + "\n".join(lines) + "\n")
