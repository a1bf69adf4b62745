"""How a measurement is recorded: one JSON line per measurement, one writer for every benchmark.

``tiered-tbe bench fbgemm | kernels | cache | pipeline | hit-rate --record PATH`` append to the
file the user names (JSON Lines: one object a line, appended, never rewritten). Every line
carries when, where and from which code it was measured, and how to measure it again::

    {"date": "2026-12-04T10:31:07", "device": "NVIDIA H200", "simulation": false,
     "versions": {"python": "3.12.3", "torch": "2.11.0", "triton": "3.6.0", "numba": "0.61.2",
                  "numba-cuda": "0.20.1", "fbgemm_gpu": "1.6.0"},
     "commit": "8e0f3d8", "host": {"cpu": "...", "cores": 16, "numa_nodes": 1, "memory_gb": 135.1,
                                    "transparent_huge_pages": "madvise / madvise", "nvidia_driver": "580.95.05"},
     "command": "tiered-tbe bench fbgemm --configs criteo-adagrad --record r.jsonl",
     "benchmark": "fbgemm", "configuration": {"name": "criteo-adagrad", ...},
     "figures": {"ours": {"forward_ms": 0.60, ...}, "fbgemm": {...}, "ours_over_fbgemm": {...}}}

``configuration`` says what was measured (the shape, the settings: what a later run must match
to compare), ``figures`` what came out (times in ms, rates, ratios against the baseline run in
the same command). :func:`read` loads a file back; ``tools/results_table.py`` builds the
README's table from ``results/measurements.jsonl`` this way. ``fbgemm_gpu`` and ``torchrec``
versions appear when the process imported them.

The ``--json`` reports of the benchmarks carry the same context (:func:`context`).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from tiered_tbe.base.host_memory import meminfo_bytes, transparent_huge_pages
from tiered_tbe.base.mode import SIMULATION

# Distributions every record names, and the optional ones named when their module is loaded.
_VERSIONED = (("torch", "torch"), ("triton", "triton"), ("numba", "numba"), ("numba-cuda", "numba_cuda"))
_OPTIONAL = (("fbgemm_gpu", "fbgemm_gpu"), ("torchrec", "torchrec"))
# Top-level packages of this project (their folders are the package's source tree: no record goes there).
_PACKAGES = ("tiered_tbe", "tiered_tbe.base", "tiered_tbe.cache", "tiered_tbe.kernels", "tiered_tbe.benchmarks")


def device_name() -> str:
    return "CPU simulation" if SIMULATION else torch.cuda.get_device_name()


def git_commit() -> str:
    """Short commit of the checkout, ``+uncommitted`` when tracked files changed; ``unknown``
    outside a git checkout. ``TIERED_TBE_COMMIT`` overrides it (a copy of a working tree whose
    git metadata is missing or stale, e.g. on a machine the tree was copied to)."""
    given = os.environ.get("TIERED_TBE_COMMIT")
    if given:
        return given[:7] if re.fullmatch(r"[0-9a-f]{40}", given) else given  # a full hash, short as git's
    here = Path(__file__).parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                                cwd=here).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=here).stdout.strip()
        return commit + ("+uncommitted" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _version(distribution: str, module: str) -> str | None:
    loaded = sys.modules.get(module)
    if loaded is not None and isinstance(getattr(loaded, "__version__", None), str):
        return loaded.__version__
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str]:
    """``python``, ``torch``, ``triton``, ``numba``, ``numba-cuda``; ``fbgemm_gpu`` and ``torchrec``
    when this process imported them (a benchmark that ran them)."""
    found = {"python": platform.python_version()}
    for distribution, module in _VERSIONED:
        found[distribution] = _version(distribution, module) or "not installed"
    for distribution, module in _OPTIONAL:
        if module in sys.modules:
            found[distribution] = _version(distribution, module) or "unknown"
    return found


def host() -> dict:
    """The machine a measurement ran on, as far as Linux tells: ``cpu`` (model), ``cores`` (this
    process may use), ``numa_nodes``, ``memory_gb``, ``transparent_huge_pages`` (the kernel's setting
    and its defrag setting) and ``nvidia_driver``; each key present only where it could be read. Two
    machines that ran the same code at different speeds may differ here."""
    found: dict = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                found["cpu"] = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    found["cores"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    nodes = list(Path("/sys/devices/system/node").glob("node[0-9]*"))
    if nodes:
        found["numa_nodes"] = len(nodes)
    total = meminfo_bytes("MemTotal")
    if total is not None:
        found["memory_gb"] = round(total / 1e9, 1)
    pages = transparent_huge_pages()
    if pages is not None:
        found["transparent_huge_pages"] = pages
    try:
        version = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)",
                            Path("/proc/driver/nvidia/version").read_text())
        if version:
            found["nvidia_driver"] = version.group(1)
    except OSError:
        pass
    return found


# The process whose measurements a record holds: records of one run share it (a benchmark appends each
# configuration's record as soon as it is measured, at different dates).
RUN = f"{datetime.datetime.now().isoformat(timespec='seconds')}-{os.getpid()}"
_HOST = host()  # read once a process


def settings() -> dict[str, str]:
    """The project's environment settings in force (``TIERED_TBE_*`` variables, ``TIERED_TBE_COMMIT`` aside):
    an A/B run of one setting differs only here (``TIERED_TBE_MANAGED_FIRST_TOUCH=host``, ...)."""
    return {name: value for name, value in sorted(os.environ.items())
            if name.startswith("TIERED_TBE_") and name != "TIERED_TBE_COMMIT"}


def context(device: str | None = None) -> dict:
    """``date``, ``run`` (:data:`RUN`), ``device`` (default :func:`device_name`), ``simulation``,
    ``versions``, ``commit``, ``host`` (:func:`host`) and, when any is set, ``settings`` (:func:`settings`):
    what every record and JSON report carries."""
    found = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), run=RUN, device=device or device_name(),
                 simulation=SIMULATION, versions=versions(), commit=git_commit(), host=_HOST)
    in_force = settings()
    if in_force:
        found["settings"] = in_force
    return found


def measurement(benchmark: str, command: str, configuration: dict, figures: dict, device: str | None = None,
                **extra) -> dict:
    """One record: the :func:`context`, then ``command``, ``benchmark``, ``configuration``, ``figures``
    (and ``extra`` keys, e.g. a ``note``)."""
    return {**context(device), "command": command, "benchmark": benchmark, "configuration": configuration,
            "figures": figures, **extra}


def source_folders() -> list[Path]:
    """The folders of this project's packages (where an editable install runs from)."""
    folders = []
    for name in _PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            folders += [Path(location).resolve() for location in spec.submodule_search_locations]
    return folders


def check_path(path: Path | str) -> Path:
    """``path`` if a record may be appended there; ``ValueError`` for a file inside the package's
    source folders (results are data of a run, not part of the library) or in a folder that does
    not exist."""
    path = Path(path)
    resolved = path.resolve()
    for folder in source_folders():
        if resolved.is_relative_to(folder):
            raise ValueError(f"--record {path}: a file inside the package's source ({folder}); name a file "
                             "outside it, e.g. results/measurements.jsonl of a checkout or ./measurements.jsonl")
    if not resolved.parent.is_dir():
        raise ValueError(f"--record {path}: the folder {path.parent} does not exist")
    return path


def _plain(value):
    """JSON-able ``value``: NaN and infinities as None, paths and other objects as strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if hasattr(value, "item"):  # numpy / torch scalars
        return _plain(value.item())
    return str(value)


def append(path: Path | str, records: Iterable[dict]) -> int:
    """Append each record to ``path`` as one JSON line (created if missing); the number written."""
    path = check_path(path)
    lines = [json.dumps(_plain(record), sort_keys=False) for record in records]
    with path.open("a") as out:
        for line in lines:
            out.write(line + "\n")
    return len(lines)


def read(path: Path | str) -> list[dict]:
    """Every record of a JSON Lines file, in file order (blank lines skipped); ``ValueError``
    naming the line of one that does not parse."""
    found = []
    with Path(path).open() as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not a JSON record ({error})") from None
    return found


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str | None = None) -> list[str]:
    """Lines of a markdown table. ``align``: one of ``l``/``r`` per column (default: first left, rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---" if a == "l" else "---:" for a in align]
    return ["| " + " | ".join(cells) + " |" for cells in (header, rule, *rows)]
