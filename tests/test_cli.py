"""The ``tiered-tbe`` command end to end, at tiny sizes."""

import csv
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from background import run_in_background

from tiered_tbe import records
from tiered_tbe.cache.policy import POLICIES as CACHE_POLICIES
from tiered_tbe.cli import main
from tiered_tbe.hit_rate.report import RESULT_COLUMNS
from tiered_tbe.hit_rate.runs import POLICIES
from tiered_tbe.traces import zipf_trace

TINY = ["--rows", "5000", "--batch-size", "64", "--bag-size", "4", "--batches", "20", "--no-progress"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["bench", "hit-rate", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_hit_rate_writes_table_csv_json_and_plot(tmp_path, capsys):
    csv_path, json_path, png_path = tmp_path / "r.csv", tmp_path / "r.json", tmp_path / "r.png"
    code, out, _ = run_cli(
        capsys, *TINY, "--cache-sizes", "1%,5%,1000,256KiB", "--associativity", "8",
        "--target-hit-rate", "0.6", "--csv", str(csv_path), "--json", str(json_path), "--plot", str(png_path),
    )
    assert code == 0
    header = next(line for line in out.splitlines() if line.startswith("policy  "))
    for column in RESULT_COLUMNS:
        assert column in header
    for policy in POLICIES:
        assert sum(line.startswith(policy + " ") for line in out.splitlines()) >= 4  # 4 sizes (+ target)
    assert "smallest cache reaching 60% hits" in out

    with open(csv_path) as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 4 * len(POLICIES)
    assert {row["cache_size"] for row in rows} == {"1%", "5%", "1000", "256KiB"}
    assert {"hit_rate_by_lookup", "rows_moved_per_batch", "bus_bytes_per_batch", "ratio_to_belady",
            "stats_unique_misses"} <= set(rows[0])
    assert all(0 <= float(row["hit_rate_by_lookup"]) <= 1 for row in rows)

    report = json.loads(json_path.read_text())
    assert report["trace"]["lookups"] == 20 * 64 * 4 and report["trace"]["rows"] == 5000
    assert len(report["results"]) == 4 * len(POLICIES)
    assert {target["policy"] for target in report["targets"]} == set(POLICIES)
    assert all(target["hit_rate"] >= 0.6 for target in report["targets"] if target["reached"])

    assert png_path.read_bytes()[:8] == PNG_MAGIC
    import matplotlib.image

    image = matplotlib.image.imread(png_path)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 400


def test_every_trace_kind_runs(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "--trace", "drift", "--drift-period", "5", *TINY,
                           "--policies", "lru,belady")
    assert code == 0 and "drifting zipf" in out
    code, out, _ = run_cli(capsys, "--trace", "criteo", "--row-cap", "2000", "--batch-size", "16",
                           "--batches", "5", "--alpha", "1.1", "--cache-sizes", "10%", "--no-progress")
    assert code == 0 and "criteo-kaggle 26 tables" in out

    trace = zipf_trace(3000, 1.2, batch_size=32, bag_size=2, num_batches=10, seed=0)
    batches = [tuple(torch.from_numpy(a) for a in trace.tbe_batch(b)) for b in range(trace.num_batches)]
    torch.save(batches, tmp_path / "trace.pt")
    code, out, _ = run_cli(capsys, "--trace", "file", "--file", str(tmp_path / "trace.pt"), "--cache-sizes",
                           "10%", "--policies", "fa-lru", "--no-progress")
    assert code == 0 and f"{trace.num_lookups:,} lookups" in out

    np.savetxt(tmp_path / "ids.txt", trace.rows, fmt="%d")
    code, out, _ = run_cli(capsys, "--trace", "file", "--file", str(tmp_path / "ids.txt"),
                           "--batch-size", "64", "--cache-sizes", "10%", "--policies", "lru", "--no-progress")
    assert code == 0 and "10 batches" in out


@pytest.mark.parametrize("args, message", [
    (["--alpha", "0"], "--alpha: expected an alpha > 0"),
    (["--alpha", "1,2"], "--trace zipf takes one --alpha"),
    (["--policies", "lru,mru"], "unknown policy mru"),
    (["--cache-sizes", "5%,lots"], "cannot read cache size 'lots'"),
    (["--target-hit-rate", "1.5"], "hit rate in (0, 1]"),
    (["--batch-size", "0"], "--batch-size: expected a whole number >= 1"),
    (["--trace", "file"], "--trace file needs --file"),
    (["--trace", "criteo", "--rows", "100"], "--rows does not apply to --trace criteo (use --row-cap)"),
    (["--trace", "zipf", "--row-cap", "100"], "--row-cap does not apply to --trace zipf"),
    (["--trace", "file", "--file", "/no/such/trace.pt"], "does not exist"),
    (["--csv", "/no/such/folder/out.csv"], "the folder does not exist"),
    (["--trace", "uniform"], "invalid choice: 'uniform'"),
])
def test_bad_flags_give_clear_errors(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "hit-rate", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: tiered-tbe bench hit-rate" in err and message in err


def test_missing_command_lists_the_commands(capsys):
    for argv, usage in (([], "usage: tiered-tbe "), (["bench"], "usage: tiered-tbe bench ")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert usage in capsys.readouterr().err


# The subprocess checks of this module, started as it is collected (tests/background.py).
_LIBRARY_IMPORTS = run_in_background([sys.executable, "-c", (
    "import sys, tiered_tbe.cli, tiered_tbe.hit_rate, tiered_tbe.train\n"
    "from tiered_tbe import records\n"
    "records.check_path('measurements.jsonl')\n"
    "for argv in (['train'], ['bench', 'hit-rate']):\n"
    "    tiered_tbe.cli.build_parser(argv)\n"
    "print(sorted(m for m in sys.modules if m.startswith('tiered_tbe.benchmarks')))\n"
    "tiered_tbe.cli.build_parser(['bench', 'cache'])\n"
    "print('tiered_tbe.benchmarks.bench_cache' in sys.modules)")], timeout=120, check=True)
DASH_M_ARGS = [*TINY, "--cache-sizes", "5%", "--policies", "belady"]
_DASH_M = run_in_background([sys.executable, "-m", "tiered_tbe", "bench", "hit-rate", *DASH_M_ARGS], timeout=120)


def test_the_library_never_imports_the_benchmarks():
    """The benchmarks sit above the library: the CLI loads a benchmark's module only for its command."""
    result = _LIBRARY_IMPORTS.result()
    assert result.stdout.split("\n")[:2] == ["[]", "True"], result.stdout


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"tiered-tbe {version('tiered-tbe')}"


def test_python_dash_m_runs_the_same_command(capsys):
    """``python -m tiered_tbe`` prints the table ``main`` prints here. Belady only: a new process
    would spend ~13 s compiling the CPU simulator of the set-associative policies (numba, not
    cached on disk: see cache/simulator.py), which the tests in this process compile and check."""
    code, out, _ = run_cli(capsys, *DASH_M_ARGS)
    assert code == 0
    result = _DASH_M.result()
    assert result.returncode == 0, result.stderr

    def rows(text):  # the table's rows without their last column (lookups per second)
        return [line.rsplit(None, 1)[0] for line in text.splitlines() if line.startswith("belady ")]

    assert "hit% lookup" in result.stdout and len(rows(out)) == 1 and rows(result.stdout) == rows(out)


# ------------------------------------------------------------------ --real-cache and --record

REAL_TINY = ["--rows", "4000", "--batch-size", "32", "--bag-size", "4", "--batches", "16", "--cache-sizes", "3%",
             "--associativity", "8", "--lookahead-window", "3", "--no-progress"]


def test_real_cache_agrees_with_the_simulator(capsys, tmp_path):
    """SlotCache (the Numba kernels, in the CUDA simulator here) over the same trace: every counter equal."""
    json_path = tmp_path / "r.json"
    code, out, err = run_cli(capsys, *REAL_TINY, "--policies", ",".join([*CACHE_POLICIES, "belady"]), "--real-cache",
                             "--json", str(json_path))
    assert code == 0, err
    assert "the same trace through the real cache (SlotCache in" in out
    table = out[out.index("the same trace through the real cache"):].splitlines()
    for policy in CACHE_POLICIES:  # every policy of the cache's registry
        line = next(line for line in table if line.startswith(policy + " "))
        assert line.rstrip().endswith("yes"), line
    assert not any(line.startswith("belady ") for line in table)  # no real cache for a bound
    assert f"real cache and simulator agree on every counter ({len(CACHE_POLICIES)} runs)" in out
    assert "DISAGREE" not in out + err
    rows = {row["policy"]: row for row in json.loads(json_path.read_text())["results"]}
    assert rows["lookahead"]["real_cache_agrees"] is True and "real_cache_agrees" not in rows["belady"]
    assert rows["lru"]["real_cache_hit_rate_by_lookup"] == rows["lru"]["hit_rate_by_lookup"] > 0
    assert rows["lookahead"]["real_cache_stats_bytes_in"] == rows["lookahead"]["stats_bytes_in"] > 0
    # A cache under pressure, not a trivially warm one: rows evicted and written back, or (a policy that
    # admits misses) misses refused.
    assert all(rows[p]["real_cache_stats_evictions"] > 100 and rows[p]["real_cache_stats_write_backs"] > 100
               or CACHE_POLICIES[p].refuses_misses and rows[p]["real_cache_stats_write_backs"] > 0
               and rows[p]["real_cache_stats_misses_no_slot"] > 100 for p in CACHE_POLICIES)


def test_real_cache_disagreement_fails_loudly(capsys, monkeypatch):
    from tiered_tbe.hit_rate import real_cache

    real = real_cache.run_slot_cache

    def off_by_one(*args, **kwargs):
        stats = real(*args, **kwargs)
        stats.lookup_hits += 1
        return stats

    monkeypatch.setattr(real_cache, "run_slot_cache", off_by_one)
    code, out, err = run_cli(capsys, *REAL_TINY, "--policies", "lru", "--real-cache")
    assert code == 1
    assert "WARNING: the real cache (SlotCache) and the exact simulator DISAGREE in 1 run(s)" in err
    assert "lru @ 3% (120 slots): lookup_hits " in err and " NO" in out


def test_real_cache_refuses_a_large_trace_in_simulation(capsys):
    from tiered_tbe.base.mode import SIMULATION

    if not SIMULATION:
        pytest.skip("the limit applies only in CPU simulation")
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "hit-rate", "--rows", "10000", "--batches", "10", "--real-cache", "--no-progress"])
    assert exit_info.value.code == 2
    assert "give a trace of at most 200,000 lookups (this one has 409,600" in capsys.readouterr().err


def test_real_cache_refuses_a_lookahead_window_past_its_hints(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "hit-rate", *REAL_TINY, "--policies", "lru,lookahead(65)", "--real-cache"])
    assert exit_info.value.code == 2
    assert "lookahead window 65 is longer than the real cache's hints reach (MAX_LOOKAHEAD = 64" in \
        capsys.readouterr().err


def test_record_appends_one_json_line_per_measurement_only_when_asked(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TIERED_TBE_MANAGED_FIRST_TOUCH", "host")  # a setting in force: the records say so
    monkeypatch.setenv("TIERED_TBE_COMMIT", "abc1234")  # not a setting: the commit itself
    results = tmp_path / "measurements.jsonl"
    args = [*TINY, "--cache-sizes", "2%,10%", "--policies", "lru,belady"]
    assert run_cli(capsys, *args)[0] == 0
    assert not results.exists()
    for _ in range(2):
        code, out, _ = run_cli(capsys, *args, "--record", str(results))
        assert code == 0 and f"appended 4 records to {results}" in out
    lines = records.read(results)
    assert len(lines) == 8
    first = lines[0]
    assert first["benchmark"] == "hit-rate" and first["device"].startswith("CPU simulator (exact)")
    assert first["command"].startswith("tiered-tbe bench hit-rate --rows 5000 --batch-size 64")
    assert {"python", "torch", "triton", "numba", "numba-cuda"} <= set(first["versions"]) and first["commit"]
    assert first["host"]["cores"] >= 1  # the machine, as far as Linux tells (records.host)
    assert first["commit"] == "abc1234" and first["settings"]["TIERED_TBE_MANAGED_FIRST_TOUCH"] == "host"
    assert "TIERED_TBE_COMMIT" not in first["settings"]
    assert first["configuration"]["trace"] == "zipf alpha=1.05, 5,000 rows, 20 batches of 64x4"
    assert [(r["configuration"]["policy"], r["configuration"]["cache_size"]) for r in lines[:4]] == [
        ("lru", "2%"), ("belady", "2%"), ("lru", "10%"), ("belady", "10%")]
    for r in lines:
        figures = r["figures"]
        assert 0 <= figures["hit_rate_by_lookup"] <= figures["hit_rate_ceiling"] <= 1
        assert figures["rows_moved_per_batch"] >= 0 and "stats_lookups" in figures


def test_record_refuses_a_file_in_the_package_source(capsys):
    import tiered_tbe

    inside = Path(tiered_tbe.__file__).parent / "measurements.jsonl"
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "hit-rate", *TINY, "--record", str(inside)])
    assert exit_info.value.code == 2
    assert "a file inside the package's source" in capsys.readouterr().err
    assert not inside.exists()


def test_the_plot_marks_each_target_inside_the_axes_labelled_and_apart():
    """Stars for the smallest caches reaching the target: inside the axes, none hiding another, each
    labelled (policies of one size share a label), labels apart; the rows-moved panel says what it counts."""
    from tiered_tbe.hit_rate.capacity import find_smallest_cache
    from tiered_tbe.hit_rate.plot import MOVED_NOTE, draw
    from tiered_tbe.hit_rate.runs import SimOptions, sweep

    trace = zipf_trace(20_000, 1.05, 256, 4, 20, seed=0)
    options = SimOptions(associativity=32, pipeline_depth=2)
    results = sweep(trace, list(POLICIES), [("1%", 224), ("5%", 1024), ("20%", 4000)], options, progress=False)
    targets = [find_smallest_cache(trace, policy, 0.6, options, known=results) for policy in POLICIES]
    assert all(t.found is not None for t in targets)
    figure = draw(results, trace, targets, options)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    hit_axes, moved_axes = figure.axes
    box = hit_axes.get_window_extent(renderer)
    stars = [line for line in hit_axes.get_lines() if line.get_marker() == "*"]
    centers = [line.get_transform().transform(line.get_xydata()[0]) for line in stars]
    assert len(stars) == len({t.found.num_slots for t in targets})  # one star per size
    for x, y in centers:
        assert box.x0 < x < box.x1 and box.y0 < y < box.y1
    radius = stars[0].get_markersize() / 72 * figure.dpi / 2
    for i, a in enumerate(centers):
        for b in centers[i + 1:]:
            assert max(abs(a[0] - b[0]), abs(a[1] - b[1])) >= radius, "two stars overlap"
    labels = [text for text in hit_axes.texts if "% of rows" in text.get_text()]
    assert len(labels) == len(stars)
    assert sorted(name for text in labels for name in text.get_text().split(":")[0].split(", ")) == sorted(POLICIES)
    from matplotlib.text import Text

    extents = [Text.get_window_extent(text, renderer) for text in labels]  # the text, not its leader line
    for extent in extents:
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1 and box.y0 <= extent.y0 and extent.y1 <= box.y1
    for i, a in enumerate(extents):
        assert not any(a.overlaps(b) for b in extents[i + 1:]), "two labels overlap"
    assert MOVED_NOTE.split()[-1] in moved_axes.get_title() and "in place" in moved_axes.get_title()
