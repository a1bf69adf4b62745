"""The README's performance table, ours against FBGEMM, from the latest records of each configuration.

Reads ``results/measurements.jsonl`` (one JSON line per measurement, as ``--record`` of every
benchmark writes it: ``tiered_tbe.records``) and prints, for each configuration of
:data:`ROWS` that has a record of ``tiered-tbe bench fbgemm`` on ``--device`` (not simulated)
with both sides' figures, the latest such record's phases as ``ours / FBGEMM (ratio)`` in ms:
forward, backward and step in HBM; prefetch too for the cached configurations; for a pipelined
configuration its step against FBGEMM's best step of the same shape *in the same run* (serial or
``prefetch_pipeline``, LRU or LFU). A line above the table names the device, dates, versions and
commits of the records used.

    python tools/results_table.py                    # print the table
    python tools/results_table.py --check README.md  # exit 1 (with a diff) if the README's differs

``--check`` compares the text between ``<!-- results-table:begin -->`` and
``<!-- results-table:end -->`` with what this prints; a file without the markers passes.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results" / "measurements.jsonl"
BEGIN, END = "<!-- results-table:begin -->", "<!-- results-table:end -->"
PHASES = ("prefetch", "forward", "backward", "step")


# (configuration, label, FBGEMM baselines of a pipelined row: the configurations of its shape)
ROWS = [
    ("criteo-adagrad", "26 Criteo tables x 128, B=65536, 1 lookup a table, Zipf 1.05, HBM", ()),
    ("criteo-adagrad-fp16", "the same, fp16 weights, stochastic rounding", ()),
    ("criteo-adam", "the same, Adam", ()),
    ("big-uniform-sgd", "one table 20M x 128, B=65536, bags of 32, uniform, SGD, HBM", ()),
    ("big-zipf-adagrad", "the same at Zipf 1.05, row-wise Adagrad", ()),
    ("mixed-weighted", "12 tables of dims 8-256 (64M rows), B=16384, bags of 0-40 with weights, HBM", ()),
    ("cached-managed-lru", "26 Criteo tables (17 GB), `MANAGED_CACHED` / `MANAGED_CACHING`, 5% cache, LRU, serial", ()),
    ("cached-managed-lru-z1.2", "the same at Zipf 1.2", ()),
    ("cached-managed-lfu-admit", "26 Criteo tables (17 GB), 5% cache, ours `lfu-admit`, FBGEMM's LFU, serial", ()),
    ("cached-managed-lfu-admit-z1.2", "the same at Zipf 1.2", ()),
    ("cached-mixed-weighted", "12 tables of dims 8-256 (64M rows), B=16384, bags of 0-40 with weights, 10% cache, "
                              "serial", ()),
    ("cached-mixed-weighted-lfu-admit", "the same (mixed dims), ours `lfu-admit`, FBGEMM's LFU", ()),
    ("cached-mixed-weighted-z0.6", "the same at Zipf 0.6 (most rows miss: ~2.7M rows, ~1 GB each way a batch)", ()),
    ("cached-mixed-weighted-z0.6-lookahead", "the same at Zipf 0.6, ours `lookahead` (told the next 64 batches), "
                                             "FBGEMM's LRU", ()),
    ("cached-mixed-bag20", "the same, every bag of 20 lookups", ()),
    ("cached-odd-dims-ragged", "8 tables of dims 4-132 (40M rows), B=8192-16384, bags of 1-30 drawn per batch, "
                               "weights, 10% cache, serial", ()),
    ("cached-odd-dims-ragged-lookahead", "the same (odd dims), ours `lookahead` (told the next 64 batches), "
                                         "FBGEMM's LRU", ()),
    ("cached-odd-dims-ragged-lfu-admit", "the same (odd dims), ours `lfu-admit`, FBGEMM's LFU", ()),
    ("cached-criteo-mixed", "26 Criteo tables of dims 16-128, bags of 0-4 with weights, 5% cache, serial", ()),
    ("cached-criteo-mixed-lfu-admit", "the same (Criteo mixed dims), ours `lfu-admit`, FBGEMM's LFU", ()),
    ("cached-managed-lru-pipelined", "Criteo cached, pipelined (depth 2), against FBGEMM's best step",
     ("cached-managed-lru", "cached-managed-lfu", "cached-managed-lfu-admit")),
    ("cached-managed-lfu-admit-pipelined", "Criteo cached, ours `lfu-admit`, pipelined (depth 2), against FBGEMM's "
                                           "best step",
     ("cached-managed-lru", "cached-managed-lfu", "cached-managed-lfu-admit")),
    ("cached-managed-lfu-admit-pipelined-z1.2", "the same at Zipf 1.2",
     ("cached-managed-lru-z1.2", "cached-managed-lfu-z1.2", "cached-managed-lfu-admit-z1.2")),
    ("cached-mixed-weighted-pipelined", "mixed dims, pipelined (depth 2), against FBGEMM's best step",
     ("cached-mixed-weighted", "cached-mixed-weighted-lfu")),
    ("cached-mixed-weighted-lfu-admit-pipelined", "mixed dims, ours `lfu-admit`, pipelined (depth 2), against "
                                                  "FBGEMM's best step",
     ("cached-mixed-weighted", "cached-mixed-weighted-lfu", "cached-mixed-weighted-lfu-admit")),
    ("cached-mixed-bag20-pipelined", "mixed dims, bags of 20, pipelined (depth 2), against FBGEMM's best step",
     ("cached-mixed-bag20",)),
    ("cached-odd-dims-ragged-pipelined", "odd dims, pipelined (depth 2), against FBGEMM's best step",
     ("cached-odd-dims-ragged", "cached-odd-dims-ragged-lfu")),
    ("cached-odd-dims-ragged-lfu-admit-pipelined", "odd dims, ours `lfu-admit`, pipelined (depth 2), against "
                                                   "FBGEMM's best step",
     ("cached-odd-dims-ragged", "cached-odd-dims-ragged-lfu", "cached-odd-dims-ragged-lfu-admit")),
    ("cached-mixed-weighted-lookahead-admit-w32-pipelined", "mixed dims, ours `lookahead-admit` (told the next 32 "
                                                            "batches), pipelined (depth 2), against FBGEMM's best step",
     ("cached-mixed-weighted", "cached-mixed-weighted-lfu", "cached-mixed-weighted-lfu-admit")),
    ("cached-managed-lookahead-admit-pipelined", "Criteo cached, ours `lookahead-admit` (told the next 64 batches), "
                                                 "pipelined (depth 2), against FBGEMM's best step",
     ("cached-managed-lru", "cached-managed-lfu", "cached-managed-lfu-admit")),
    ("cached-odd-dims-ragged-lookahead-admit-w64-pipelined", "odd dims, ours `lookahead-admit` (told the next 64 "
                                                             "batches), pipelined (depth 2), against FBGEMM's best "
                                                             "step",
     ("cached-odd-dims-ragged", "cached-odd-dims-ragged-lfu", "cached-odd-dims-ragged-lfu-admit")),
    ("cached-mixed-weighted-z0.6-lookahead-pipelined", "mixed dims at Zipf 0.6, ours `lookahead`, pipelined "
                                                       "(depth 2), against FBGEMM's best step",
     ("cached-mixed-weighted-z0.6", "cached-mixed-weighted-z0.6-lfu", "cached-mixed-weighted-z0.6-lfu-admit")),
    ("cached-criteo-mixed-pipelined", "Criteo mixed dims, pipelined (depth 2), against FBGEMM's best step",
     ("cached-criteo-mixed", "cached-criteo-mixed-lfu-admit")),
    ("cached-criteo-mixed-lfu-admit-pipelined", "Criteo mixed dims, ours `lfu-admit`, pipelined (depth 2), against "
                                                "FBGEMM's best step",
     ("cached-criteo-mixed", "cached-criteo-mixed-lfu-admit")),
]
METHOD = ("One process, the same batches on both sides, no bounds checks, row-wise Adagrad fp32 unless said; "
          "ms, ours / FBGEMM (ratio), medians of the timed steps (with the tables in HBM the sides take turns). "
          "Below 1.00 we are faster. Pipelined rows: our depth-2 step against FBGEMM's best step of the same "
          "shape in the same run (serial or `prefetch_pipeline`, LRU or LFU). Generated by "
          "`python tools/results_table.py` from `results/measurements.jsonl`.")


def read(path: Path) -> list[dict]:
    with path.open() as handle:
        return [json.loads(line) for line in handle if line.strip()]


def phases_of(name: str, baselines: tuple) -> tuple[str, ...]:
    """The phases a record of ``name`` must have on both sides to be shown."""
    if baselines:
        return ("step",)
    return PHASES if name.startswith("cached-") else PHASES[1:]


def complete(record: dict, phases, sides=("ours", "fbgemm")) -> bool:
    figures = record.get("figures", {})
    sides = [figures.get(side) for side in sides]
    return all(isinstance(side, dict) and isinstance(side.get(f"{phase}_ms"), (int, float))
               for side in sides for phase in phases)


def latest(records: list[dict], name: str, device: str, phases, baselines=()) -> dict | None:
    """The last record (file order: the file is appended to) of ``name`` on ``device`` with
    ``phases`` on both sides; with ``baselines`` (a pipelined row), the last one with our step whose run
    also measured FBGEMM's serial step of one of them (else FBGEMM's best step would be its pipelined one,
    which FBGEMM_GPU fails to run on some shapes)."""
    found = None
    sides = ("ours",) if baselines else ("ours", "fbgemm")
    for record in records:
        if (record.get("benchmark") == "fbgemm" and record.get("configuration", {}).get("name") == name
                and record.get("device") == device and not record.get("simulation")
                and complete(record, phases, sides)
                and "+" not in record.get("commit", "+")  # committed code only: a commit one can check out
                and (not baselines or serial_baselines(records, record, baselines))):
            found = record
    return found


def serial_baselines(records: list[dict], record: dict, baselines) -> list[dict]:
    """The records of ``baselines`` (configuration names) measured in ``record``'s run."""
    return [other for other in records if other.get("configuration", {}).get("name") in baselines
            and same_run(other, record) and complete(other, ("step",))]


def same_run(a: dict, b: dict) -> bool:
    """Whether two records were measured by one process: the same ``run`` (older records, which lack
    it, were all written at the end of their run: the same date)."""
    if a.get("run") and b.get("run"):
        return a["run"] == b["run"] and a.get("device") == b.get("device")
    return all(a.get(key) == b.get(key) for key in ("date", "device", "commit"))


def fmt_ms(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def cell(ours: float, theirs: float, bold: bool = False) -> str:
    ratio = f"{ours / theirs:.2f}"
    return f"{fmt_ms(ours)} / {fmt_ms(theirs)} ({f'**{ratio}**' if bold else ratio})"


def table(records: list[dict], device: str) -> list[str]:
    """The lines between the README's markers."""
    rows, used = [], []
    for name, label, baselines in ROWS:
        record = latest(records, name, device, phases_of(name, baselines), baselines)
        if record is None:
            continue
        used.append(record)
        ours, theirs = record["figures"]["ours"], record["figures"].get("fbgemm") or {}
        if baselines:
            # FBGEMM's best step of this shape in the same run: its prefetch_pipeline step, its serial ones.
            steps = [theirs["step_ms"]] if "step_ms" in theirs else []
            for other in serial_baselines(records, record, baselines):
                steps.append(other["figures"]["fbgemm"]["step_ms"])
                used.append(other)
            if "--fit-cache" in record.get("command", ""):
                label += ", `fit_cache`"
            rows.append([label, "", "", "", cell(ours["step_ms"], min(steps), bold=True)])
            continue
        cells = [cell(ours[f"{p}_ms"], theirs[f"{p}_ms"], bold=p == "step") if f"{p}_ms" in ours and
                 f"{p}_ms" in theirs else "" for p in PHASES]
        rows.append([label, *cells])
    if not rows:
        return [f"No record of `tiered-tbe bench fbgemm` on {device} in results/measurements.jsonl."]
    lines = [describe(used, device), "", METHOD, "", "| configuration | prefetch | forward | backward | step |",
             "|---|---:|---:|---:|---:|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def describe(used: list[dict], device: str) -> str:
    """``NVIDIA H200, 2026-12-03: torch 2.11, Triton 3.6, FBGEMM_GPU 1.6.0; commits eb97f44, 8e0f3d8.``"""
    dates = sorted({r["date"][:10] for r in used if r.get("date")})
    commits = list(dict.fromkeys(r.get("commit", "unknown") for r in used))
    versions = {}
    for record in used:
        for name, version in (record.get("versions") or {}).items():
            versions.setdefault(name, [])
            if version not in versions[name]:
                versions[name].append(version)
    shown = [f"{label} {'/'.join(versions[key])}" for key, label in
             (("torch", "torch"), ("triton", "Triton"), ("fbgemm_gpu", "FBGEMM_GPU"), ("cuda-cccl", "cuda-cccl"))
             if key in versions]
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}" if dates else "undated"
    return f"{device}, {when}: " + ", ".join(shown) + ("; " if shown else "") + f"commits {', '.join(commits)}."


def between_markers(text: str) -> str | None:
    """The text between the markers (without the blank lines at its ends), or None without them."""
    if BEGIN not in text or END not in text:
        return None
    inside = text.split(BEGIN, 1)[1].split(END, 1)[0]
    return inside.strip("\n")


def check(path: Path, expected: list[str], source: Path) -> int:
    """0 if ``path``'s table (between the markers) is ``expected`` or it has no markers; else 1
    and a unified diff on stdout."""
    found = between_markers(path.read_text())
    if found is None:
        print(f"{path}: no {BEGIN} ... {END} markers: nothing to check")
        return 0
    if found.splitlines() == expected:
        print(f"{path}: the results table matches {source}")
        return 0
    diff = difflib.unified_diff(found.splitlines(), expected, f"{path} (between the markers)",
                                "python tools/results_table.py", lineterm="")
    print("\n".join(diff))
    print(f"{path}: the results table differs from what tools/results_table.py prints (above: - {path}, + the "
          "records); paste its output between the markers")
    return 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/results_table.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="the records (default results/measurements.jsonl of this checkout)")
    parser.add_argument("--device", default="NVIDIA H200", help="records of this device only (default NVIDIA H200)")
    parser.add_argument("--check", type=Path, metavar="FILE",
                        help="check that FILE's table between the markers equals what would be printed")
    args = parser.parse_args(argv)
    lines = table(read(args.results), args.device)
    if args.check is not None:
        return check(args.check, lines, args.results)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
