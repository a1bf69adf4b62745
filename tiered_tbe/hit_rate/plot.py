"""The ``--plot`` figure of a hit-rate study: hit rate and rows moved against cache size.

Two panels, one line per policy (bounds dashed), one legend below both. The smallest cache each
policy needs to reach ``--target-hit-rate`` is a star on the left panel, labelled with the
policy and its size; neither stars nor labels overlap, and the axes are widened to hold every
star. The right panel's title says what "moved" counts: rows read or written in place are not
moved. matplotlib is imported only here, when a plot is drawn (the ``plot`` extra).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence

from tiered_tbe.hit_rate.capacity import TargetResult
from tiered_tbe.hit_rate.runs import Measurement, SimOptions
from tiered_tbe.traces import Trace

MOVED_NOTE = ("moved = copied into the cache + dirty rows written back; rows of misses that found every way "
              "locked are read and updated in place and not counted here (they count in bus/batch)")


def _log_limits(values: Sequence[float], margin: float = 0.12) -> tuple[float, float]:
    """x limits of a log axis holding every value, ``margin`` of its span beyond each end."""
    low, high = math.log10(min(values)), math.log10(max(values))
    span = max(high - low, 0.3)
    return 10 ** (low - margin * span), 10 ** (high + margin * span)


def _mark_targets(axes, targets: Sequence[TargetResult], color_of: dict[str, str]) -> None:
    """A star at the smallest cache each policy needs for the target, and a label naming it.

    Policies that need the same size share one star and one label. Stars closer than a star's
    width (in the axes' log scale) are stacked upward, so none hides another. Labels form a
    column below the target line (above it for a target under 50%): the star furthest right gets
    the first row, and each star to its left a row further down, so a label's leader line runs
    left of every label above it and never crosses one.
    """
    from matplotlib import transforms  # matplotlib is optional: only --plot needs it

    reached = [t for t in targets if t.found is not None and t.metric == "lookup"]
    if not reached:
        return
    by_size: dict[int, list[TargetResult]] = {}
    for target in reached:
        by_size.setdefault(target.found.num_slots, []).append(target)
    groups = sorted(by_size.values(), key=lambda group: group[0].found.num_slots)
    low, high = (math.log10(limit) for limit in axes.get_xlim())
    too_close = 0.035 * (high - low)  # about a star's width, in decades
    downward = 100 * reached[0].target > 50
    star_rise = []  # points above its data position, per group
    for i, group in enumerate(groups):
        x = math.log10(100 * group[0].found.cache_fraction)
        previous = math.log10(100 * groups[i - 1][0].found.cache_fraction) if i else None
        star_rise.append(star_rise[-1] + 11 if previous is not None and x - previous < too_close else 0)
    for row, i in enumerate(sorted(range(len(groups)), key=lambda i: -groups[i][0].found.num_slots)):
        group = groups[i]
        found = group[0].found
        x, y = 100 * found.cache_fraction, 100 * min(t.found.hit_rate for t in group)
        color = color_of.get(group[0].policy, "black") if len(group) == 1 else "black"
        star = transforms.offset_copy(axes.transData, fig=axes.figure, y=star_rise[i], units="points")
        axes.plot([x], [y], marker="*", markersize=13, color=color, markeredgecolor="black", markeredgewidth=0.6,
                  linestyle="none", zorder=5, transform=star)
        names = ", ".join(t.policy for t in group)
        # Every label's row is counted from the target line, not from its star: rows never meet.
        drop = 20 + 13 * row
        row_at = transforms.offset_copy(axes.transData, fig=axes.figure, x=6, y=-drop if downward else drop,
                                        units="points")
        axes.annotate(f"{names}: {x:.3g}% of rows", xy=(x, y), xycoords=star, xytext=(x, 100 * group[0].target),
                      textcoords=row_at, fontsize=8, color=color, va="center", ha="left",
                      bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.9),
                      arrowprops=dict(arrowstyle="-", color=color, linewidth=0.7, shrinkA=0, shrinkB=4), zorder=6)


def plot(path: str, results: Sequence[Measurement], trace: Trace,
         targets: Sequence[TargetResult] = (), options: SimOptions | None = None) -> None:
    """PNG at ``path`` of :func:`draw`."""
    draw(results, trace, targets, options).savefig(path, dpi=110)


def draw(results: Sequence[Measurement], trace: Trace, targets: Sequence[TargetResult] = (),
         options: SimOptions | None = None):
    """A matplotlib Figure: hit rate by lookup (left) and rows moved per batch (right) against cache size.

    A bare Figure with the Agg canvas: no display needed, pyplot's global backend untouched.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 5.6), layout="constrained")
    FigureCanvasAgg(figure)
    hit_axes, moved_axes = figure.subplots(1, 2)
    color_of = {}
    for policy in dict.fromkeys(m.policy for m in results):
        points = sorted((m for m in results if m.policy == policy), key=lambda m: m.num_slots)
        x = [100 * m.cache_fraction for m in points]
        style = dict(linestyle="--" if points[0].is_bound else "-", marker="o", label=policy)
        (line,) = hit_axes.plot(x, [100 * m.hit_rate for m in points], **style)
        moved_axes.plot(x, [m.rows_moved_per_batch for m in points], color=line.get_color(), **style)
        color_of[policy] = line.get_color()
    sizes = [100 * m.cache_fraction for m in results]
    sizes += [100 * t.found.cache_fraction for t in targets if t.found is not None]
    ticks = sorted({100 * m.cache_fraction for m in results})
    for axes, ylabel in ((hit_axes, "hit rate by lookup (%)"),
                         (moved_axes, "rows moved per batch (copied in + written back)")):
        axes.set_xscale("log")
        axes.set_xlim(*_log_limits(sizes))
        axes.set_xticks(ticks, [f"{t:.3g}%" for t in ticks])
        axes.minorticks_off()
        axes.set_xlabel("cache size (% of rows)")
        axes.set_ylabel(ylabel)
        axes.grid(True, alpha=0.3)
    hit_axes.set_ylim(0, 104)  # every star (a hit rate <= 100%) inside the axes
    moved_axes.set_ylim(bottom=0)
    if targets:
        hit_axes.axhline(100 * targets[0].target, color="gray", linewidth=0.8, linestyle=":",
                         label=f"target {100 * targets[0].target:g}% ({targets[0].metric}); star: smallest cache "
                               "reaching it")
        _mark_targets(hit_axes, targets, color_of)
    hit_axes.set_title("hit rate", fontsize=10)
    moved_axes.set_title("rows moved\n" + "\n".join(textwrap.wrap(MOVED_NOTE, 80)), fontsize=8)
    handles, labels = hit_axes.get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 6), fontsize=9)
    title = trace.description
    if options is not None and (options.pipeline_depth or options.warmup_batches or options.future_batches):
        title += (f"\npipeline depth {options.pipeline_depth} (not the bounds), counted after "
                  f"{options.warmup_batches} warm-up batches"
                  + (f", last {options.future_batches} batches only lookahead's future" if options.future_batches
                     else ""))
    figure.suptitle(title, fontsize=10)
    return figure
