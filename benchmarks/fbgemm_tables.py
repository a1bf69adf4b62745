"""The tables ``bench_fbgemm`` prints and records: ours beside FBGEMM per phase with the targets,
the cached steps against the host-tables issue's targets, and the profiles (``--profile``)."""

from __future__ import annotations

from tiered_tbe import records
from tiered_tbe.benchmarks import common
from tiered_tbe.benchmarks.fbgemm_configs import CONFIGS, PROFILED_KERNELS, SWEEP_PREFIXES


def table_of(results: list[dict]) -> list[str]:
    by_name = {c.name: c for c in CONFIGS}
    rows = []
    for row in results:
        config = by_name[row["config"]]
        phases = ("prefetch", "forward", "backward", "step") if config.cached else ("forward", "backward", "step")
        for phase in phases:
            ours, theirs = row["ours"].get(phase), row["fbgemm"].get(phase)
            ratio = ours / theirs if ours is not None and theirs else None
            target = config.target(phase) if phase != "prefetch" else float("nan")
            verdict = "-" if ratio is None or target != target else ("met" if ratio <= target else "MISSED")
            rows.append([config.name, phase, common.fmt(theirs), common.fmt(ours), common.fmt(ratio, ".2f"),
                         common.fmt(target, ".1f") if target == target else "-", verdict])
        if "rows_in_per_batch" in row["ours"]:
            rows.append([config.name, f"rows copied in per timed batch, ours (hit rate by lookup "
                                      f"{common.fmt(row['ours']['hit_rate'], '.3f')})", "-",
                         common.fmt(row["ours"]["rows_in_per_batch"], ".0f"), "-", "-", "-"])
        if "kernel_forward" in row["ours"]:
            rows.append([config.name, f"forward, bare kernel ({row['ours']['forward_tile']})", "-",
                         common.fmt(row["ours"]["kernel_forward"]), "-", "-", "-"])
            rows.append([config.name, "backward, bare: sort + run-length encode", "-",
                         common.fmt(row["ours"]["kernel_sort"]), "-", "-", "-"])
            rows.append([config.name, "backward, bare: of which the sort (base/sorting.stable_sort)", "-",
                         common.fmt(row["ours"]["kernel_sort_alone"]), "-", "-", "-"])
            rows.append([config.name, "backward, bare: update kernels", "-",
                         common.fmt(row["ours"]["kernel_update"]), "-", "-", "-"])
        for key, value in row.items():
            if key.startswith(SWEEP_PREFIXES):
                for phase in (key.split()[1], "step"):
                    theirs = row["fbgemm"].get(phase)
                    rows.append([config.name, f"{phase}, {key[5:]}", common.fmt(theirs), common.fmt(value.get(phase)),
                                 common.fmt(value[phase] / theirs if theirs else None, ".2f"), "-", "-"])
    rows += cached_targets_of(results)
    header = ["configuration", "phase", "FBGEMM ms", "ours ms", "ours / FBGEMM", "target", ""]
    return records.markdown_table(header, rows) + profile_table_of(results)


def cached_targets_of(results: list[dict]) -> list[list[str]]:
    """The cached steps against the host-tables issue's targets, one row each with its baseline in
    the FBGEMM ms column: a serial step at most 0.8 of FBGEMM's best serial cached step (the
    faster of its LRU and LFU on the same batches); a pipelined step at most 0.5 of that and at
    most 1.2 of our own all-HBM step. Rows only for what this run measured."""
    by_name = {c.name: c for c in CONFIGS}
    configs = [(by_name[row["config"]], row) for row in results]
    rows = []
    for config, row in configs:
        ours = row["ours"].get("step")
        if not config.cached or ours is None:
            continue
        shape = (config.tables, config.alpha, config.optimizer, config.dtype, config.bag_size)
        same = [(c, r) for c, r in configs if (c.tables, c.alpha, c.optimizer, c.dtype, c.bag_size) == shape]
        serial = [(r["fbgemm"]["step"], c.name) for c, r in same
                  if c.cached and not c.pipelined and r["fbgemm"].get("step")]
        hbm = [(r["ours"]["step"], c.name) for c, r in same if not c.cached and r["ours"].get("step")]
        targets = (((serial, "FBGEMM's best serial cached step", 0.5), (hbm, "our all-HBM step", 1.2))
                   if config.pipelined else ((serial, "FBGEMM's best serial cached step", 0.8),))
        for baselines, what, target in targets:
            if baselines:
                baseline, name = min(baselines)
                ratio = ours / baseline
                rows.append([config.name, f"step / {what} ({name}, in the FBGEMM ms column)", common.fmt(baseline),
                             common.fmt(ours), common.fmt(ratio, ".2f"), common.fmt(target, ".1f"),
                             "met" if ratio <= target else "MISSED"])
    return rows


def profile_table_of(results: list[dict]) -> list[str]:
    """With --profile: each phase's fraction of the copy bandwidth, and the longest kernels of each side."""
    rows = []
    for row in results:
        ours, theirs, copy_gbs = row["ours"], row["fbgemm"], row.get("copy_gbs")
        for phase, floor in ours.get("bytes", {}).items():
            fractions = [floor / (side[phase] * 1e6) / copy_gbs if side.get(phase) and copy_gbs else None
                         for side in (theirs, ours)]
            rows.append([row["config"], f"{phase}: {floor / 1e6:.0f} MB at least, fraction of copy bandwidth",
                         common.fmt(fractions[0], ".2f"), common.fmt(fractions[1], ".2f")])
        for phase in ("prefetch", "forward", "backward"):
            if f"host_{phase}" in ours:
                rows.append([row["config"], f"{phase}: host ms to enqueue", common.fmt(theirs.get(f"host_{phase}")),
                             common.fmt(ours[f"host_{phase}"])])
        if ours.get("profile"):
            totals = [sum(ms for _, ms in side["profile"]) if side.get("profile") else None for side in (theirs, ours)]
            rows.append([row["config"], "all kernels of a step (the GPU's busy time)", common.fmt(totals[0]),
                         common.fmt(totals[1])])
        sides = [(theirs, "FBGEMM", 1), (ours, "ours", 2)]
        sides += [(value, key[5:], 2) for key, value in row.items() if key.startswith(SWEEP_PREFIXES)]
        for side, name, column in sides:
            for kernel, ms in side.get("profile", [])[:PROFILED_KERNELS]:
                cells = ["-", "-"]
                cells[column - 1] = common.fmt(ms)
                rows.append([row["config"], f"{name} kernel {kernel}", *cells])
    if not rows:
        return []
    header = ["configuration", "profile (device ms per step, all streams)", "FBGEMM", "ours"]
    return ["", *records.markdown_table(header, rows)]
