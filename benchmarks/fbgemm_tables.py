"""What ``bench fbgemm`` prints and records: ours beside FBGEMM per phase, what the caches moved,
each cached shape's phases and steps side by side, the profiles (``--profile``), and one record
per configuration (``--record``).

Every ratio is ours / FBGEMM's figure measured in the same run (below 1: ours is faster).
"""

from __future__ import annotations

from tiered_tbe import records
from tiered_tbe.benchmarks import common, kernel_profile
from tiered_tbe.benchmarks.fbgemm_configs import CONFIGS, PROFILED_KERNELS, SWEEP_PREFIXES
from tiered_tbe.benchmarks.fbgemm_sides import COUNTED_STEPS, warmup_steps

PHASES = ("prefetch", "forward", "backward", "step")
_BY_NAME = {c.name: c for c in CONFIGS}


def ratio(ours, theirs) -> float | None:
    return ours / theirs if ours is not None and theirs else None


def table_of(results: list[dict]) -> list[str]:
    """Every table of a run, as printed lines."""
    return phase_table_of(results) + cached_table_of(results) + moved_table_of(results) + profile_table_of(results)


def phase_table_of(results: list[dict]) -> list[str]:
    """Ours beside FBGEMM, each phase of each configuration (ms, medians); our bare kernels and the
    tuning sweeps' steps under the HBM configurations."""
    rows = []
    for row in results:
        config = _BY_NAME[row["config"]]
        for phase in PHASES if config.cached else PHASES[1:]:
            ours, theirs = row["ours"].get(phase), row["fbgemm"].get(phase)
            rows.append([config.name, phase, common.fmt(theirs), common.fmt(ours),
                         common.fmt(ratio(ours, theirs), ".2f")])
        if "kernel_forward" in row["ours"]:
            for what, key in ((f"forward, bare kernel ({row['ours']['forward_tile']})", "kernel_forward"),
                              ("backward, bare: sort + run-length encode", "kernel_sort"),
                              ("backward, bare: of which the sort (base/sorting.stable_sort)", "kernel_sort_alone"),
                              ("backward, bare: update kernels", "kernel_update")):
                rows.append([config.name, what, "-", common.fmt(row["ours"][key]), "-"])
        for key, value in row.items():
            if key.startswith(SWEEP_PREFIXES):
                for phase in (key.split()[1], "step"):
                    theirs = row["fbgemm"].get(phase)
                    rows.append([config.name, f"{phase}, {key[5:]}", common.fmt(theirs), common.fmt(value.get(phase)),
                                 common.fmt(ratio(value.get(phase), theirs), ".2f")])
    header = ["configuration", "phase", "FBGEMM ms", "ours ms", "ours / FBGEMM"]
    return records.markdown_table(header, rows)


def _cell(ours, theirs) -> str:
    """``ours / FBGEMM (ratio)`` in ms; ``ours`` alone when FBGEMM did not run."""
    if ours is None:
        return "-"
    if not theirs:
        return common.fmt(ours)
    return f"{common.fmt(ours)} / {common.fmt(theirs)} ({ratio(ours, theirs):.2f})"


def cached_table_of(results: list[dict]) -> list[str]:
    """One row per serial cached configuration: each phase, the serial step, the step of its
    pipelined twin (the same shape and policy, when it ran), ours / FBGEMM each; and our best step
    (serial or pipelined) against FBGEMM's best step of the same shape in this run (LRU or LFU,
    serial or ``prefetch_pipeline``)."""
    measured = [(_BY_NAME[row["config"]], row) for row in results if _BY_NAME[row["config"]].cached]
    rows = []
    for config, row in measured:
        if config.pipelined:
            continue
        twins = [r for c, r in measured if c.pipelined and c.shape == config.shape and c.policy == config.policy
                 and c.placement == config.placement]
        pipelined = twins[0] if twins else {"ours": {}, "fbgemm": {}}
        same_shape = [r for c, r in measured if c.shape == config.shape]
        ours_best = min((r["ours"]["step"] for r in (row, pipelined) if r["ours"].get("step")), default=None)
        fbgemm_best = min((r["fbgemm"]["step"] for r in same_shape if r["fbgemm"].get("step")), default=None)
        rows.append([config.name, *(_cell(row["ours"].get(phase), row["fbgemm"].get(phase)) for phase in PHASES),
                     _cell(pipelined["ours"].get("step"), pipelined["fbgemm"].get("step")),
                     common.fmt(ratio(ours_best, fbgemm_best), ".2f")])
    if not rows:
        return []
    header = ["cached configuration (ms, ours / FBGEMM)", "prefetch", "forward", "backward", "serial step",
              "pipelined step (depth 2)", "best step / FBGEMM's best"]
    return ["", *records.markdown_table(header, rows)]


def moved(side: dict, pipelined: bool = False) -> dict:
    """Rows and bytes a side's cache moved per batch and the bus rate reached (bytes moved /
    prefetch ms, from the timed steps' total prefetch time): ours from its own counters over the
    timed steps, FBGEMM's counted off its cache tags over a few steps after them
    (``fbgemm_sides.fbgemm_moves_counted``: every victim written back, weights only). No bus rate
    for a ``pipelined`` configuration: its "prefetch" is the training stream's wait for a prefetch
    that ran beside the step (a few microseconds gave ~15,000 GB/s)."""
    if side.get("rows_in_per_batch") is None:
        return {}
    found = {key: side[key] for key in ("rows_in_per_batch", "rows_out_per_batch", "bytes_in_per_batch",
                                        "bytes_out_per_batch")}
    found["rows_in_place_per_batch"] = side.get("rows_in_place_per_batch")  # ours only
    prefetch_ms = side.get("prefetch_total", 0) / max(side.get("steps", 0), 1)
    found["bus_gbs"] = ((found["bytes_in_per_batch"] + found["bytes_out_per_batch"]) / prefetch_ms / 1e6
                        if prefetch_ms and not pipelined else None)
    return found


def moved_table_of(results: list[dict]) -> list[str]:
    """What each side's cache moved per batch in the serial cached configurations, and the bus rate."""
    rows = []
    for row in results:
        config = _BY_NAME[row["config"]]
        if not config.cached or config.pipelined:
            continue
        for name, side in (("ours", row["ours"]), ("FBGEMM", row["fbgemm"])):
            found = moved(side)
            if not found:
                continue
            rows.append([config.name, name, common.fmt(found["rows_in_per_batch"], ",.0f"),
                         common.fmt(found["rows_out_per_batch"], ",.0f"),
                         common.fmt(_mb(found["bytes_in_per_batch"]), ",.1f"),
                         common.fmt(_mb(found["bytes_out_per_batch"]), ",.1f"),
                         common.fmt(found["bus_gbs"], ".1f"),
                         common.fmt(found["rows_in_place_per_batch"], ",.0f"),
                         common.fmt(side.get("hit_rate"), ".3f")])
    if not rows:
        return []
    header = ["cached configuration", "side", "rows in / batch", "rows out / batch", "MB in / batch", "MB out / batch",
              "bus GB/s (in + out) / prefetch", "rows read in place / batch", "hit rate (lookups)"]
    note = ("Ours: its counters over the timed steps, rows with their optimizer state, dirty victims written back. "
            f"FBGEMM's: counted off its cache tags over {COUNTED_STEPS} steps after the timed ones, weights only (its "
            "optimizer state stays out of its cache), every victim written back.")
    return ["", *records.markdown_table(header, rows), "", note]


def _mb(value):
    return None if value is None else value / 1e6


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
            busy = [kernel_profile.phase_totals(side.get("profile") or []) for side in (theirs, ours)]
            for phase in [*dict.fromkeys([*busy[0], *busy[1]])]:
                rows.append([row["config"], f"{phase}: its kernels' device ms (busy time)",
                             *(common.fmt(phases.get(phase)) for phases in busy)])
            rows.append([row["config"], "all kernels of a step (the GPU's busy time)",
                         *(common.fmt(sum(phases.values()) if phases else None) for phases in busy)])
        sides = [(theirs, "FBGEMM", 1), (ours, "ours", 2)]
        sides += [(value, key[5:], 2) for key, value in row.items() if key.startswith(SWEEP_PREFIXES)]
        for side, name, column in sides:
            shown: dict[str, int] = {}
            for phase, kernel, ms in side.get("profile", []):  # the longest few of each phase
                shown[phase] = shown.get(phase, 0) + 1
                if shown[phase] <= PROFILED_KERNELS:
                    cells = ["-", "-"]
                    cells[column - 1] = common.fmt(ms)
                    rows.append([row["config"], f"{name} {phase} kernel {kernel}", *cells])
    if not rows:
        return []
    header = ["configuration", "profile (device ms per step, all streams)", "FBGEMM", "ours"]
    return ["", *records.markdown_table(header, rows)]


def _figures(side: dict) -> dict:
    """A side's figures for a record: every phase's ms (``forward_ms``, ...) and the rest as measured
    (host ms, bare kernels, cache counters), the kernel profile left out."""
    out = {}
    for key, value in side.items():
        if key in ("profile", "host_profile", "bytes"):
            continue
        # host_* and kernel_* are ms, but the step counters (host_mallocs_per_step, ...) are counts.
        timed = key in PHASES or key == "prefetch_total" or (key.startswith(("host_", "kernel_"))
                                                            and not key.endswith("_per_step"))
        out[f"{key}_ms" if timed else key] = value
    return out


def measurements_of(results: list[dict], args) -> list[tuple[dict, dict]]:
    """``(configuration, figures)`` per configuration, for ``--record``: the configuration as run
    (its tiny shape in simulation) and this run's settings; each side's figures, ours / FBGEMM per
    phase, what each cache moved, and the tuning variants' phases."""
    found = []
    for row in results:
        configuration = dict(row["configuration"], mover=args.mover, steps=args.steps,
                             warmup=warmup_steps(_BY_NAME[row['config']], args))
        if row["configuration"].get("placement") == "host_cached":
            configuration["fbgemm_placement"] = "managed_caching_host_mapped"  # fbgemm_sides.fbgemm_module
        if args.state_layout:
            configuration["state_layout"] = args.state_layout
        if getattr(args, "in_place_copies", None) is not None:
            configuration["in_place_copies"] = args.in_place_copies
        figures = {"ours": _figures(row["ours"]), "fbgemm": _figures(row["fbgemm"]),
                   "ours_over_fbgemm": {phase: ratio(row["ours"].get(phase), row["fbgemm"].get(phase))
                                        for phase in PHASES if row["ours"].get(phase) and row["fbgemm"].get(phase)}}
        if _BY_NAME[row["config"]].cached:
            pipelined = _BY_NAME[row["config"]].pipelined
            figures["moved"] = {"ours": moved(row["ours"], pipelined), "fbgemm": moved(row["fbgemm"], pipelined)}
        figures.update({key: _figures(value) for key, value in row.items() if key.startswith(SWEEP_PREFIXES)})
        # --profile: every kernel's phase and device ms a step (longest first), so that two records can be
        # compared phase by phase and kernel by kernel (the printed table lists the longest few of each phase).
        profiles = {side: [[phase, kernel, round(ms, 4)] for phase, kernel, ms in row[side]["profile"] if ms >= 0.001]
                    for side in ("ours", "fbgemm") if row[side].get("profile")}
        if profiles:
            figures["kernel_ms_per_step"] = profiles
        found.append((configuration, figures))
    return found
