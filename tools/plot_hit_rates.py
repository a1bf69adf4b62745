"""Plot several ``tiered-tbe bench hit-rate --json`` reports side by side: one column per trace.

Top row: hit rate by lookup against cache size (percent of rows, log scale); bottom row: rows
moved per batch (copied in + written back; rows read and updated in place are not moved, as the
figure says). One line per policy, bounds (fully associative LRU,
Belady) dashed, the same color for a policy in every panel. This is how ``docs/hit_rate.png`` is
made from the runs of ``docs/hit_rates.md``::

    python tools/plot_hit_rates.py out/hit_rate_zipf1.05.json out/hit_rate_zipf1.2.json \\
        out/hit_rate_criteo.json --titles "Zipf 1.05" "Zipf 1.2" "Criteo-like" --out docs/hit_rate.png
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

from tiered_tbe.hit_rate.plot import MOVED_NOTE


def plot_reports(reports: list[dict], titles: list[str], path: Path) -> None:
    """Draw ``reports`` (parsed JSON of ``bench hit-rate --json``) into a PNG at ``path`` (Agg canvas:
    no display needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(4.6 * len(reports), 7.2), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, len(reports), squeeze=False)
    policies = list(dict.fromkeys(row["policy"] for report in reports for row in report["results"]))
    cycle = [f"C{i}" for i in range(10)]
    color = {policy: cycle[i % len(cycle)] for i, policy in enumerate(policies)}
    for column, (report, title) in enumerate(zip(reports, titles)):
        hit_axes, moved_axes = axes[0, column], axes[1, column]
        for policy in policies:
            points = sorted((r for r in report["results"] if r["policy"] == policy), key=lambda r: r["cache_rows"])
            if not points:
                continue
            x = [100 * r["cache_fraction"] for r in points]
            style = dict(color=color[policy], marker="o", linestyle="--" if points[0]["is_bound"] else "-",
                         label=policy)
            hit_axes.plot(x, [100 * r["hit_rate_by_lookup"] for r in points], **style)
            moved_axes.plot(x, [r["rows_moved_per_batch"] for r in points], **style)
        ticks = sorted({100 * r["cache_fraction"] for r in report["results"]})
        for ax, ylabel in ((hit_axes, "hit rate by lookup (%)"), (moved_axes, "rows moved per batch")):
            ax.set_xscale("log")
            ax.set_xticks(ticks, [f"{t:.3g}%" for t in ticks])
            ax.minorticks_off()
            ax.set_xlabel("cache size (% of rows)")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
        trace = report["trace"]
        hit_axes.set_title(f"{title}\n" + "\n".join(textwrap.wrap(
            f"{trace['rows']:,} rows, {trace['lookups'] / 1e6:.0f}M lookups in {trace['batches']:,} batches", 48)),
            fontsize=10)
    axes[0, 0].legend(title="policy (dashed: bounds)", fontsize=9)
    for column in range(len(reports)):  # what "moved" counts, above each rows-moved panel
        axes[1, column].set_title("\n".join(textwrap.wrap(MOVED_NOTE, 62)), fontsize=7)
    options = reports[0]["options"]
    figure.suptitle(f"Slot-cache hit rate, exact CPU simulator: {options['associativity']}-way sets, "
                    f"{'training' if options['training'] else 'inference'}, lookahead window "
                    f"{options['lookahead_window']} batches", fontsize=11)
    figure.savefig(path, dpi=100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=Path, help="JSON files written by tiered-tbe bench hit-rate --json")
    parser.add_argument("--titles", nargs="+", help="one title per report (default: the trace descriptions)")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    reports = [json.loads(path.read_text()) for path in args.reports]
    titles = args.titles or [report["trace"]["description"] for report in reports]
    if len(titles) != len(reports):
        parser.error(f"--titles: give one per report ({len(reports)}), got {len(titles)}")
    plot_reports(reports, titles, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
