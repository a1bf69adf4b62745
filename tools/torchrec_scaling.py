"""Weak scaling of a TorchRec job, ours beside TorchRec's kernels, from `tiered-tbe bench torchrec --record` lines.

`tools/gpu_torchrec.sh` runs the benchmark on N GPUs and on 1 with the same batch per rank (and again with
every table's rows x4). This pairs each configuration's N-GPU record with its 1-GPU record of the same shape
(tables, rows, dim, batch per rank, Zipf exponent, cache load factor, VBE) and commit, and prints for each side
the samples per second of all ranks on N GPUs against 1 (the scaling; N is ideal), our step against TorchRec's
on N GPUs, and, from a profiled run, NCCL's share of the N-GPU step (the all-to-alls and the dense all-reduce).

    python tools/torchrec_scaling.py out/bench_torchrec.jsonl           # a markdown table
    python tools/torchrec_scaling.py results/measurements.jsonl --commit 1a2b3c4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tiered_tbe import records

# What makes two records the same job at another world size (besides the configuration's name).
SHAPE = ("tables", "rows", "rows_scale", "dim", "batch_size", "alpha", "cache_load_factor", "vbe")
SIDES = ("ours", "torchrec")


def read_records(path: Path, commit: str | None = None) -> list[dict]:
    """The `bench torchrec` records of ``path`` (of ``commit`` only, when given)."""
    return [record for record in records.read(path) if record.get("benchmark") == "torchrec"
            and (commit is None or str(record.get("commit", "")).startswith(commit))]


def scaling_rows(records: list[dict]) -> list[dict]:
    """One row per configuration and shape that has a 1-GPU record and a record on more GPUs (the latest of
    each world size): ``name``, ``rows``, ``world_size``, per side ``<side>_scaling`` (samples/s on N over
    samples/s on 1), ``ours_over_torchrec`` (step on N GPUs), ``<side>_nccl_share`` (NCCL's GPU time over the
    step on N GPUs; None unprofiled)."""
    latest: dict[tuple, dict[int, dict]] = {}
    for record in records:
        configuration = record["configuration"]
        key = (configuration["name"], str(record.get("commit")),
               *(configuration.get(field, 1 if field == "rows_scale" else None) for field in SHAPE))
        latest.setdefault(key, {})[int(configuration["world_size"])] = record  # later lines win
    rows = []
    for key, by_world in latest.items():
        if 1 not in by_world:
            continue
        for world_size, record in sorted(by_world.items()):
            if world_size == 1:
                continue
            one, many = by_world[1]["figures"], record["figures"]
            row = dict(name=key[0], commit=key[1], rows=record["configuration"].get("rows"), world_size=world_size,
                       ours_over_torchrec=many["ours"]["step_ms"] / many["torchrec"]["step_ms"])
            for side in SIDES:
                row[f"{side}_scaling"] = many[side]["samples_per_s"] / one[side]["samples_per_s"]
                row[f"{side}_samples_per_s"] = many[side]["samples_per_s"]
                collective = many[side].get("profile", {}).get("collective_gpu_ms")
                row[f"{side}_nccl_share"] = None if collective is None else collective / many[side]["step_ms"]
            rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    def share(value):
        return "-" if value is None else f"{100 * value:.1f}%"

    lines = ["| configuration | rows | GPUs | samples/s ours (xN/1) | samples/s TorchRec (xN/1) | "
             "step ours / TorchRec | NCCL share ours / TorchRec |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        rows_text = "-" if row["rows"] is None else f"{row['rows']:,}"
        lines.append(
            f"| {row['name']} | {rows_text} | {row['world_size']} | "
            f"{row['ours_samples_per_s']:,.0f} ({row['ours_scaling']:.2f}x) | "
            f"{row['torchrec_samples_per_s']:,.0f} ({row['torchrec_scaling']:.2f}x) | "
            f"{row['ours_over_torchrec']:.2f} | "
            f"{share(row['ours_nccl_share'])} / {share(row['torchrec_nccl_share'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", type=Path, help="JSON lines written by `tiered-tbe bench torchrec --record`")
    parser.add_argument("--commit", help="only records of this commit (a prefix)")
    args = parser.parse_args(argv)
    rows = scaling_rows(read_records(args.records, args.commit))
    if not rows:
        print("no configuration has records on 1 GPU and on more", file=sys.stderr)
        return 1
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
