"""The benchmarks run end to end at a tiny size (CPU simulation here: their times mean nothing).

Each benchmark's ``main`` (or ``tiered-tbe bench ...``) is called in-process with tiny flags (3
tables of at most 1000 rows, batch 4, 2 timed batches: the Triton interpreter's time grows with
the batch) and must print its table; ``--json`` and ``--record`` must write (to a temporary file).
``tiered-tbe bench kernels | cache | pipeline | fbgemm`` run the same modules from the installed
package (``tiered_tbe.benchmarks``) with the same flags. No benchmark judges against a target:
each prints ratios against the baseline it measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from background import run_in_background

import tiered_tbe  # noqa: F401  (chooses GPU / simulation mode before the scripts import triton or numba)
from tiered_tbe import Placement, records
from tiered_tbe.batch import CopyRows
from tiered_tbe.cache.policy import POLICIES
from tiered_tbe.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_simulated_thread_per_launch(one_simulated_thread):
    """The benchmarks are checked for their plumbing and tables here, not the cache's kernels for
    races (tests/test_cache*.py run several threads a launch): one simulated thread a launch."""
TINY_MODEL = ["--num-tables", "3", "--row-cap", "1000", "--dim", "16", "--batch-size", "4", "--alpha", "1.05",
              "--warmup", "1", "--batches", "2"]
SHARED_FLAGS = ["--tables", "--rows", "--dim", "--batch-size", "--bag-size", "--alpha", "--dtype", "--record", "--json"]


@pytest.fixture(scope="module")
def scripts():
    """The benchmark modules, as the scripts and the CLI import them (the package tiered_tbe.benchmarks)."""
    return {name: importlib.import_module(f"tiered_tbe.benchmarks.{name}")
            for name in ("common", "bench_kernels", "bench_cache", "bench_pipeline", "bench_fbgemm")}


def test_bench_cache_prints_its_table(scripts, capsys, tmp_path):
    results_file, json_file = tmp_path / "measurements.jsonl", tmp_path / "cache.json"
    scripts["bench_cache"].main([*TINY_MODEL, "--memcpy-gib", "0.0001", "--record", str(results_file),
                                 "--json", str(json_file)])
    out = capsys.readouterr().out
    assert "| model | mover | lookups | prefetch ms | forward ms | backward ms | step ms |" in out
    assert "| host_cached | zero_copy | zipf 1.05 |" in out and "| host_cached | staged | zipf 1.05 |" in out
    assert "| all HBM | - | zipf 1.05 |" in out
    assert "serial step / all-HBM" in out and "pipelined step / all-HBM" in out
    assert "write-back hidden behind the fill" in out
    for mover in ("zero_copy", "staged"):
        for direction in ("fill", "write-back", "both"):
            assert f"| {mover} | {direction} | " in out, (mover, direction)
    assert_no_verdicts(out)
    if tiered_tbe.SIMULATION:
        assert "timings are meaningless" in out
    document = json.loads(json_file.read_text())
    cached = {r["mover"]: r for r in document["results"] if r.get("model") == "host_cached"}
    assert set(cached) == {"zero_copy", "staged"}
    for r in cached.values():
        assert r["stats"]["batches"] == 2 and r["stats"]["lookups"] == 2 * 3 * 4
        assert r["rows_in_per_batch"] >= 0 and r["step_vs_hbm"] > 0 and r["pipelined_vs_hbm"] > 0
    # The same decisions, whichever mover carries the rows.
    assert cached["staged"]["stats"] == cached["zero_copy"]["stats"]
    lines = records.read(results_file)
    assert {line["benchmark"] for line in lines} == {"cache"}
    assert all(line["command"].startswith("python benchmarks/bench_cache.py --num-tables 3") for line in lines)
    trained = [line for line in lines if line["configuration"].get("what") == "training steps"]
    assert {(line["configuration"]["model"], line["configuration"]["mover"]) for line in trained} == {
        ("host_cached", "zero_copy"), ("host_cached", "staged"), ("all HBM", "-")}
    for line in trained:
        assert line["configuration"]["tables"] == 3 and line["configuration"]["alpha"] == 1.05
        assert line["figures"]["step_ms"] > 0 and line["note"] == "simulation: times meaningless"
    assert sum(line["configuration"].get("what") == "mover alone" for line in lines) == 2 * 3 * 2  # 2 row counts


def test_bench_cache_big_table_mode(scripts, capsys, tmp_path):
    # 50 kB table of 16-float rows = 781 rows; a 10 kB cache (a few sets).
    json_file = tmp_path / "big.json"
    scripts["bench_cache"].main(["--big-table-gb", "0.00005", "--cache-gb", "0.00001", "--dim", "16",
                                 "--batch-size", "8", "--big-bag-size", "2", "--big-steps", "2", "--mover", "staged",
                                 "--json", str(json_file)])
    out = capsys.readouterr().out
    assert "big table: 781 rows x 16 fp32" in out
    assert "| mover | table GB | cache GB | lookups | steps (timed) |" in out
    result = json.loads(json_file.read_text())["results"][0]
    assert result["steps"] == 2 and result["timed_steps"] == 1 and result["stats"]["lookups"] == 8 * 2
    assert result["mover"] == "staged"


def test_bench_cache_big_table_fails_clearly_without_memory(scripts, monkeypatch):
    monkeypatch.setattr(scripts["bench_cache"], "host_available_bytes", lambda: 2**20)
    with pytest.raises(SystemExit, match="pinned host memory.*only 0.0 GiB is available"):
        scripts["bench_cache"].main(["--big-table-gb", "0.01", "--dim", "16"])


def test_bench_pipeline_prints_its_table(scripts, capsys, tmp_path):
    json_file = tmp_path / "pipeline.json"
    scripts["bench_pipeline"].main([*TINY_MODEL, "--depth", "2", "--bottom-mlp", "8", "--top-mlp", "8",
                                    "--json", str(json_file)])
    out = capsys.readouterr().out
    assert "| model | lookups | step ms | samples/s | throughput / all-HBM | rows moved / batch |" in out
    names = ["all HBM", "managed, no cache"]
    for mover in ("zero_copy",):
        names += [f"host_cached lru, {mover} mover, serial (prefetch in forward)"]
        names += [f"host_cached {policy}, {mover} mover, pipelined depth 2" for policy in POLICIES]
    for name in names:
        assert f"| {name}" in out, name
    assert "throughput / all-HBM" in out and "zero_copy mover: lookahead rows moved / LRU" in out
    results = json.loads(json_file.read_text())["results"]
    pipelined = {r["policy"]: r for r in results if r["run"] == "pipelined"}
    assert set(pipelined) == set(POLICIES)
    assert all(r["rows_in_per_batch"] is not None for r in pipelined.values())
    assert pipelined["lru"]["rows_vs_lru"] == 1.0
    # The pipeline tells a lookahead cache its window during the warm-up; the other policies get none.
    assert pipelined["lookahead"]["lookahead_hints"] is True
    assert pipelined["lru"]["lookahead_hints"] is None and pipelined["lfu"]["lookahead_hints"] is None
    assert pipelined["lookahead"]["rows_vs_lru"] > 0


@pytest.mark.parametrize("name", ["bench_kernels", "bench_cache", "bench_pipeline", "bench_fbgemm"])
def test_help(scripts, capsys, name):
    with pytest.raises(SystemExit) as exit_info:
        scripts[name].main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--record PATH" in out and "--results-file" not in out
    assert_no_verdicts(out)


# ------------------------------------------------------------------ tiered-tbe bench kernels | cache | pipeline


@pytest.mark.parametrize("name", ["kernels", "cache", "pipeline", "fbgemm"])
def test_cli_help_lists_the_shared_flags(capsys, name):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["bench", name, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: tiered-tbe bench {name}")
    shared = ["--record", "--json"] if name == "fbgemm" else SHARED_FLAGS
    for flag in shared + ([] if name in ("kernels", "fbgemm") else ["--cache-fraction", "--policy", "--row-cap"]):
        assert flag in out, flag
    assert_no_verdicts(out)


def test_cli_bench_kernels(capsys, tmp_path):
    json_file = tmp_path / "kernels.json"
    code = cli_main(["bench", "kernels", "--tables", "2", "--rows", "300", "--dim", "16", "--batch-size", "4",
                     "--bag-size", "3", "--alpha", "1.05", "--dtype", "fp16", "--rep-ms", "1",
                     "--json", str(json_file)])
    assert code == 0
    out = capsys.readouterr().out
    assert "2 tables of 300 rows x 16 fp16, batch 4 x bag 3 per table (24 lookups)" in out
    assert "| op | lookups | unique rows | ours ms | torch ms | ours GB/s | torch GB/s | torch / ours |" in out
    for op in ("forward", "fwd+bwd+sgd", "fwd+bwd+adagrad"):
        assert f"| {op} | zipf 1.05 |" in out, op
    document = json.loads(json_file.read_text())
    assert document["args"]["command_line"].startswith("tiered-tbe bench kernels --tables 2")
    assert "run" not in document["args"] and "command_parser" not in document["args"]
    assert all(r["speedup"] > 0 for r in document["results"] if "torch_ms" in r)


def test_cli_bench_cache_records_only_when_asked(capsys, tmp_path):
    results_file = tmp_path / "measurements.jsonl"
    args = ["bench", "cache", "--tables", "2", "--rows", "500", "--dim", "16", "--batch-size", "4", "--bag-size", "2",
            "--alpha", "1.2", "--cache-fraction", "0.1", "--policy", "lfu", "--warmup", "1", "--batches", "2",
            "--memcpy-gib", "0.0001", "--mover", "staged", "--depth", "0"]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "2 tables of 500 rows x 16 fp32" in out and "cache 0.1 of rows, lfu" in out
    assert "| host_cached | staged | zipf 1.2 |" in out and "| all HBM | - | zipf 1.2 |" in out  # the baseline
    assert "| zero_copy |" not in out and "pipelined step / all-HBM" not in out
    assert "serial step / all-HBM" in out
    assert not results_file.exists()  # no --record: nothing written
    assert cli_main([*args, "--record", str(results_file)]) == 0
    assert cli_main([*args, "--record", str(results_file)]) == 0  # appended, never rewritten
    lines = records.read(results_file)
    half = len(lines) // 2
    assert len(lines) == 2 * half and [r["configuration"] for r in lines[:half]] == [
        r["configuration"] for r in lines[half:]]
    staged = [line for line in lines if line["configuration"].get("mover") == "staged"
              and line["configuration"].get("what") == "training steps"]
    assert len(staged) == 2 and staged[0]["command"].startswith("tiered-tbe bench cache --tables 2 --rows 500")
    assert staged[0]["configuration"]["policy"] == "lfu" and staged[0]["figures"]["step_vs_hbm"] > 0


def test_record_refuses_the_package_source_before_measuring(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["bench", "kernels", "--record", str(REPO / "benchmarks" / "r.jsonl")])
    assert exit_info.value.code == 2
    assert "a file inside the package's source" in capsys.readouterr().err


def test_cli_bench_pipeline(capsys, tmp_path):
    code = cli_main(["bench", "pipeline", "--num-tables", "2", "--row-cap", "500", "--dim", "16", "--batch-size", "4",
                     "--alpha", "1.05", "--warmup", "1", "--batches", "2", "--modes", "hbm", "pipelined",
                     "--policies", "lru", "--bottom-mlp", "8", "--top-mlp", "8", "--mover", "zero_copy", "staged",
                     "--staging-rows", "3", "--mover-threads", "1", "--json", str(tmp_path / "pipeline.json")])
    assert code == 0
    out = capsys.readouterr().out
    assert "2 Criteo Kaggle tables (1,000 rows, capped at 500) x 16 fp32" in out  # 1460 and 583 rows, capped
    assert "| all HBM | zipf 1.05 |" in out
    for mover in ("zero_copy", "staged"):
        assert f"| host_cached lru, {mover} mover, pipelined depth 2 | zipf 1.05 |" in out, mover
    results = json.loads((tmp_path / "pipeline.json").read_text())["results"]
    cached = {r["mover"]: r for r in results if r["policy"] == "lru"}
    assert cached["staged"]["stats"] == cached["zero_copy"]["stats"]  # the same decisions, whichever mover
    assert "throughput / all-HBM" in out


def test_cli_bench_pipeline_on_managed_memory(capsys, tmp_path):
    """--placement managed_cached builds the cached models on managed memory (FBGEMM's
    MANAGED_CACHING), beside host_cached, each judged against its own LRU."""
    code = cli_main(["bench", "pipeline", "--num-tables", "2", "--row-cap", "500", "--dim", "16", "--batch-size", "4",
                     "--alpha", "1.05", "--warmup", "1", "--batches", "2", "--modes", "hbm", "pipelined",
                     "--policies", "lru", "lookahead", "--bottom-mlp", "8", "--top-mlp", "8",
                     "--placement", "host_cached", "managed_cached", "--json", str(tmp_path / "pipeline.json")])
    assert code == 0
    out = capsys.readouterr().out
    for placement in ("host_cached", "managed_cached"):
        assert f"| {placement} lru, zero_copy mover, pipelined depth 2 | zipf 1.05 |" in out, placement
        assert f"- zipf 1.05, {placement}, zero_copy mover: lookahead rows moved / LRU" in out, placement
    results = json.loads((tmp_path / "pipeline.json").read_text())["results"]
    cached = {(r["placement"], r["policy"]): r for r in results if r["policy"]}
    assert cached[("managed_cached", "lru")]["rows_vs_lru"] == 1.0
    # The same batches and decisions whichever store holds the rows.
    assert cached[("managed_cached", "lru")]["stats"] == cached[("host_cached", "lru")]["stats"]


@pytest.mark.parametrize("args, message", [
    (["cache", "--rows", "100", "--row-cap", "10"], "--row-cap caps the Criteo Kaggle tables"),
    (["cache", "--tables", "27"], "--tables must be between 1 and 26"),
    (["pipeline", "--depth", "9"], "--depth must be between 1 and 8"),
    (["cache", "--depth", "9"], "--depth must be between 0 and 8"),
    (["cache", "--mover", "dma"], "invalid choice: 'dma'"),
    (["pipeline", "--staging-rows", "0"], "--staging-rows must be >= 1"),
    (["kernels", "--rows", "0"], "--rows must be >= 1"),
    (["cache", "--cache-fraction", "2"], "--cache-fraction must be in (0, 1]"),
    (["cache", "--dtype", "fp8"], "invalid choice: 'fp8'"),
])
def test_cli_bad_flags_are_usage_errors(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["bench", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: tiered-tbe bench {args[0]}" in err and message in err


def test_old_flag_names_still_work(scripts):
    cache = scripts["bench_cache"].parse_args(["--num-tables", "4"])
    assert cache.tables == 4 and cache.policy == "lru"
    pipeline = scripts["bench_pipeline"].parse_args(["--policies", "lru", "lfu"])
    assert pipeline.policies == ["lru", "lfu"] and scripts["bench_pipeline"].parse_args(
        ["--policy", "lookahead"]).policies == ["lookahead"]
    assert scripts["bench_cache"].parse_args(["--rows", "77", "--tables", "30"]).tables == 30  # any count with --rows


# Started as this module is collected (tests/background.py).
_ENTRY_POINTS = {
    "package": run_in_background([sys.executable, "-m", "tiered_tbe", "bench", "kernels", "--help"], timeout=120,
                                 cwd=REPO),  # from the installed package
    "script": run_in_background([sys.executable, "benchmarks/bench_pipeline.py", "--help"], timeout=120,
                                cwd=REPO),  # as a script of the checkout
}


@pytest.mark.parametrize("entry_point", list(_ENTRY_POINTS))
def test_both_entry_points_import(entry_point):
    result = _ENTRY_POINTS[entry_point].result()
    assert result.returncode == 0, result.stderr
    assert "--cache-fraction" in result.stdout or "--tables" in result.stdout


def test_zipf_batches_are_tbe_batches_and_seeded():
    sampling = importlib.import_module("tiered_tbe.benchmarks.sampling")
    rows = [1000, 5, 300]
    source = sampling.ZipfBatches(rows, 1.05, batch_size=64, bag_size=2, device="cpu", seed=3)
    indices, offsets = source.next()
    assert indices.dtype == torch.int64 and indices.shape == (3 * 64 * 2,)
    assert torch.equal(offsets, torch.arange(0, 3 * 64 * 2 + 1, 2))
    for t, n in enumerate(rows):
        part = indices[t * 128:(t + 1) * 128]
        assert 0 <= int(part.min()) and int(part.max()) < n
    again = sampling.ZipfBatches(rows, 1.05, batch_size=64, bag_size=2, device="cpu", seed=3).next()[0]
    assert torch.equal(indices, again)
    uniform = sampling.ZipfBatches(rows, 0.0, batch_size=64, bag_size=1, device="cpu").next()[0]
    assert int(uniform[64:128].max()) < 5
    global_rows = sampling.global_rows(indices, offsets, rows)
    assert torch.equal(global_rows[128:256], indices[128:256] + 1000)


@pytest.mark.parametrize("bag_lengths", ["per_bag", "per_batch", "fixed"])
def test_zipf_batches_with_drawn_bag_lengths_weights_and_batch_sizes(bag_lengths):
    """Bags of lengths drawn per bag (empty ones included) or per table and batch, per-sample
    weights, batch sizes drawn per batch: every batch a valid TBE batch, each table's rows its own,
    seeded."""
    sampling = importlib.import_module("tiered_tbe.benchmarks.sampling")
    rows = [1000, 5, 300, 70]

    def source():
        return sampling.ZipfBatches(rows, 1.05, batch_size=32, bag_size=6, device="cpu", seed=4,
                                    bag_lengths=bag_lengths, weighted=True, min_batch_size=9)

    batches, sizes = source().batches(12), set()
    for indices, offsets, weights in batches:
        batch_size = (offsets.numel() - 1) // len(rows)
        sizes.add(batch_size)
        assert 9 <= batch_size <= 32 and offsets.numel() == len(rows) * batch_size + 1
        assert offsets[0] == 0 and offsets[-1] == indices.numel() and bool((offsets[1:] >= offsets[:-1]).all())
        lengths = (offsets[1:] - offsets[:-1]).view(len(rows), batch_size)
        assert int(lengths.max()) <= 6
        if bag_lengths == "per_batch":  # one length per table and batch
            assert bool((lengths == lengths[:, :1]).all()) and int(lengths.min()) >= 1
        if bag_lengths == "fixed":
            assert bool((lengths == 6).all())
        for t, n in enumerate(rows):
            part = indices[offsets[t * batch_size]:offsets[(t + 1) * batch_size]]
            assert part.numel() == 0 or (0 <= int(part.min()) and int(part.max()) < n)
        assert weights.dtype == torch.float32 and weights.shape == indices.shape
        assert bool(((weights >= 0.5) & (weights < 1.5)).all())
        global_rows = sampling.global_rows(indices, offsets, rows)
        assert bool((global_rows < sum(rows)).all())
    assert len(sizes) > 1  # the batch size changes
    if bag_lengths == "per_bag":
        assert any(bool((b[1][1:] == b[1][:-1]).any()) for b in batches)  # empty bags
    for (i, o, w), (i2, o2, w2) in zip(batches, source().batches(12)):
        assert torch.equal(i, i2) and torch.equal(o, o2) and torch.equal(w, w2)
    with pytest.raises(ValueError, match="bag_lengths must be one of"):
        sampling.ZipfBatches(rows, 1.05, 4, 2, "cpu", bag_lengths="poisson")


def assert_no_verdicts(text: str) -> None:
    """No benchmark judges against an internal target: it prints ratios against its own baseline."""
    for word in ("MISSED", "target", "met)", "| met |"):
        assert word not in text, word


def test_cli_bench_fbgemm_without_fbgemm_times_our_side(capsys, tmp_path):
    """Without FBGEMM (and without a GPU) the command says so, times our side at a tiny size
    through every path (HBM, cached, pipelined), writes its JSON and appends a record per
    configuration; --list names the configurations."""
    assert cli_main(["bench", "fbgemm", "--list"]) == 0
    listed = capsys.readouterr().out
    assert "criteo-adagrad " in listed and "cached-lru-pipelined " in listed
    described = {line.split()[0]: line for line in listed.splitlines()}
    assert "12 tables (64,000,000 rows) x dims 8-256 fp32, B=16384, L=0-40 per bag, weighted" in described[
        "cached-mixed-weighted"]
    assert "8 tables (40,000,000 rows) x dims 4-132 fp32, B=8192-16384, L=1-30 per batch, weighted" in described[
        "cached-odd-dims-ragged"]
    json_file, results_file = tmp_path / "fbgemm.json", tmp_path / "measurements.jsonl"
    code = cli_main(["bench", "fbgemm", "--configs", "criteo-sgd", "cached-lru", "cached-lru-pipelined", "--steps", "1",
                     "--state-layout", "with_rows", "--json", str(json_file), "--record", str(results_file)])
    assert code == 0
    out = capsys.readouterr().out
    assert "FBGEMM_GPU: no CUDA device (simulation mode); timing our side only" in out
    assert "ours state_layout=with_rows" in out
    assert "| criteo-sgd | forward |" in out and "| cached-lru-pipelined | step |" in out
    assert_no_verdicts(out)
    results = {r["config"]: r for r in json.loads(json_file.read_text())["results"]}
    assert results["criteo-sgd"]["ours"]["step"] > 0 and results["criteo-sgd"]["fbgemm"] == {}
    # Counted over the timed steps only: the serial cached step's new batch misses rows of its own.
    assert 0 <= results["cached-lru"]["ours"]["hit_rate"] < 1 and results["cached-lru"]["ours"]["rows_in_per_batch"] > 0
    assert "| cached-lru | ours | " in out  # what the cache moved
    assert "| cached-lru | " in out.split("| cached configuration (ms, ours / FBGEMM) |")[1]
    lines = {line["configuration"]["name"]: line for line in records.read(results_file)}
    assert set(lines) == {"criteo-sgd", "cached-lru", "cached-lru-pipelined"}
    cached = lines["cached-lru"]
    assert cached["benchmark"] == "fbgemm" and cached["configuration"]["state_layout"] == "with_rows"
    assert cached["configuration"]["table_rows"] == [50, 7, 300]  # the shape run: tiny in simulation
    assert cached["figures"]["ours"]["prefetch_ms"] > 0 and cached["figures"]["fbgemm"] == {}
    assert cached["figures"]["moved"]["ours"]["rows_in_per_batch"] > 0
    # fbgemm_gpu's version only where this process imported it (another test may have: TorchRec's)
    assert ("fbgemm_gpu" in cached["versions"]) == ("fbgemm_gpu" in sys.modules)


def test_bench_fbgemm_mixed_dims_ragged_bags_and_weights(capsys, tmp_path):
    """The cached configurations of mixed dims, bags of drawn lengths, per-sample weights and batch
    sizes that change every step run end to end, serial and pipelined (tiny in simulation; the pipeline
    fitted to the cache), and report each phase, what the cache moved per batch and the bus rate."""
    json_file = tmp_path / "fbgemm.json"
    code = cli_main(["bench", "fbgemm", "--configs", "cached-mixed-weighted", "cached-mixed-weighted-pipelined",
                     "cached-odd-dims-ragged-pipelined", "--steps", "2", "--fit-cache", "--json", str(json_file)])
    assert code == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| cached-mixed-weighted | ")
               and line.count("|") == 8)  # the cached summary: phases, serial and pipelined steps
    cells = [cell.strip() for cell in row.split("|")[2:-1]]
    assert all(float(cell) > 0 for cell in cells[:5])  # ours alone: no FBGEMM here
    assert "| cached-mixed-weighted | ours | " in out and "bus GB/s" in out
    results = {r["config"]: r for r in json.loads(json_file.read_text())["results"]}
    mixed = results["cached-mixed-weighted"]
    assert mixed["configuration"]["dims"] == [8, 16, 16] and mixed["configuration"]["weighted"]
    ours = mixed["ours"]
    assert ours["rows_in_per_batch"] > 0 and ours["bytes_in_per_batch"] > 0 and ours["state_bytes_per_row"] == 4
    assert ours["steps"] == 2 and ours["prefetch_total"] > 0
    # No CUDA graphs in simulation: each timed step's prefetch, forward and backward ran eagerly.
    assert ours["graph_captures_per_step"] == ours["graph_replays_per_step"] == 0
    assert ours["graph_eager_runs_per_step"] >= 3
    assert ours["lookups_per_step"] > 0 and "profiled_lookups_per_step" not in ours  # no --profile
    for name in ("cached-mixed-weighted-pipelined", "cached-odd-dims-ragged-pipelined"):
        assert results[name]["ours"]["step"] > 0, name
        assert 0 <= results[name]["ours"]["ahead_at_end"] <= 2, name  # --fit-cache
    assert_no_verdicts(out)


def test_bench_fbgemm_uncached_managed_configuration_reads_every_row_in_place(capsys, tmp_path):
    """``managed-odd-dims-ragged`` has no cache: our module keeps every table in managed memory (``MANAGED``,
    no slots, no prefetch), and the benchmark times its forward and backward as it times an HBM
    configuration's, its record naming the placement."""
    from tiered_tbe.benchmarks import fbgemm_sides
    from tiered_tbe.benchmarks.fbgemm_configs import CONFIGS, simulation_shape

    config = simulation_shape(next(c for c in CONFIGS if c.name == "managed-odd-dims-ragged"))
    assert not config.cached and config.lookahead_window == 0
    ours = fbgemm_sides.ours_module(config, fbgemm_sides.DEFAULT_MODULE_ARGS)
    assert ours.cache is None and {spec.placement for spec in ours.tables} == {Placement.MANAGED}
    json_file = tmp_path / "fbgemm.json"
    assert cli_main(["bench", "fbgemm", "--configs", "managed-odd-dims-ragged", "--steps", "1", "--ours-only",
                     "--json", str(json_file)]) == 0
    result = json.loads(json_file.read_text())["results"][0]
    assert result["configuration"]["placement"] == "managed" and result["configuration"]["policy"] is None
    assert result["ours"]["forward"] > 0 and result["ours"]["backward"] > 0 and "prefetch" not in result["ours"]
    assert_no_verdicts(capsys.readouterr().out)


def test_bench_fbgemm_host_profile_runs_the_timed_steps_again(capsys):
    """--host-profile profiles our timed steps again, on their own batches (a pipelined cached
    configuration here): the table names the module's prefetch and the pipeline's."""
    assert cli_main(["bench", "fbgemm", "--configs", "cached-odd-dims-ragged-lfu-admit-pipelined", "--steps", "2",
                     "--warmup", "1", "--ours-only", "--host-profile", "2000"]) == 0
    out = capsys.readouterr().out
    profile = out[out.index("host profile of cached-odd-dims-ragged-lfu-admit-pipelined, the 2 timed steps again"):]
    assert "tiered_tbe/module.py" in profile and "(prefetch)" in profile and "(_prefetch_next)" in profile


def test_cache_moves_reads_rows_in_and_out_off_the_tags():
    """A way whose row changed took a row in, and wrote its old row back when it held one; bytes by
    each row's table (tables of 3, 2 and 4 rows, rows of 8, 16 and 4 bytes)."""
    from tiered_tbe.benchmarks.fbgemm_sides import cache_moves

    row_starts = torch.tensor([0, 3, 5])
    row_bytes = torch.tensor([8, 16, 4])
    before = torch.tensor([[-1, 0, 4], [8, -1, 2]])
    after = torch.tensor([[3, 0, 6], [8, -1, 5]])  # way 0 filled (empty before), 4 -> 6, 2 -> 5
    rows_in, rows_out, bytes_in, bytes_out = cache_moves(before, after, row_starts, row_bytes).tolist()
    assert (rows_in, rows_out) == (3, 2)
    assert bytes_in == 16 + 4 + 4  # rows 3 (table 1), 6 (table 2), 5 (table 2)
    assert bytes_out == 16 + 8  # rows 4 (table 1), 2 (table 0)
    assert cache_moves(after, after, row_starts, row_bytes).tolist() == [0, 0, 0, 0]


def test_fbgemm_moves_counted_averages_each_prefetch_and_trains_each_batch():
    """The counting steps prefetch, pool and backpropagate each batch from ``first`` on (cycling),
    and report the moves a batch, read off the tags around each prefetch (a stand-in for FBGEMM's
    module whose prefetch puts the batch's first index in way 0 of set 0)."""
    from tiered_tbe.benchmarks import fbgemm_sides
    from tiered_tbe.benchmarks.fbgemm_configs import Config

    config = Config("two-tables", tables=(4, 4), dim=(2, 6), placement="managed_cached")

    class StandIn:
        def __init__(self):
            self.lxu_cache_state = torch.full((2, 2), -1, dtype=torch.int64)
            self.weight = torch.ones(3, requires_grad=True)
            self.seen = []

        def prefetch(self, indices, offsets):
            self.lxu_cache_state[0, 0] = indices[0]

        def __call__(self, indices, offsets, per_sample_weights=None):
            self.seen.append(int(indices[0]))
            return self.weight.sum().expand(2, 8)

    batches = [(torch.tensor([row]), torch.tensor([0, 1]), None) for row in (1, 5, 5, 2)]
    emb = StandIn()
    found = fbgemm_sides.fbgemm_moves_counted(emb, config, batches, torch.ones(2, 8), first=1, steps=4)
    assert emb.seen == [5, 5, 2, 1]
    # in: 5 (empty way), then 2 (out 5), then 1 (out 2); 5 again moved nothing
    assert found["rows_in_per_batch"] == 3 / 4 and found["rows_out_per_batch"] == 2 / 4
    assert found["bytes_in_per_batch"] == (24 + 8 + 8) / 4 and found["bytes_out_per_batch"] == (24 + 8) / 4
    assert emb.weight.grad is not None and float(emb.weight.grad[0]) == 4 * 16


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_fbgemm_cache_moves_match_the_rows_that_entered_and_left_its_cache(policy):
    """On FBGEMM's own cache (MANAGED_CACHING, LRU and LFU, more rows named than it holds): what
    ``cache_moves`` reads off the tags around each prefetch equals the rows found in the cache after
    it and not before (in), and before and not after (out), each row weighed by its table's dim."""
    from tiered_tbe.benchmarks import fbgemm_sides
    from tiered_tbe.benchmarks.fbgemm_configs import Config

    if fbgemm_sides.fbgemm_available():
        pytest.skip(fbgemm_sides.fbgemm_available())
    config = Config("small-cached", tables=(3000, 5000), dim=(4, 12), batch_size=256, bag_size=8, alpha=1.05,
                    placement="managed_cached", policy=policy, cache_fraction=0.1, bag_lengths="per_bag")
    emb = fbgemm_sides.fbgemm_module(config)
    batches, grad = fbgemm_sides.batches_of(config, seed=3, count=6)
    row_starts = torch.tensor([0, 3000], device="cuda")
    row_bytes = torch.tensor([16, 48], device="cuda")
    total_in = 0
    for indices, offsets, weights in batches:
        before = emb.lxu_cache_state.clone()
        emb.prefetch(indices, offsets)
        after = emb.lxu_cache_state
        found = fbgemm_sides.cache_moves(before, after, row_starts, row_bytes).tolist()
        held_before, held_after = before[before >= 0], after[after >= 0]
        came_in = held_after[~torch.isin(held_after, held_before)]
        went_out = held_before[~torch.isin(held_before, held_after)]
        weigh = lambda rows: int(torch.where(rows >= 3000, 48, 16).sum())  # noqa: E731
        assert found == [came_in.numel(), went_out.numel(), weigh(came_in), weigh(went_out)]
        total_in += came_in.numel()
        out = emb(indices, offsets, per_sample_weights=weights)
        out.backward(grad[: out.shape[0]])
    assert total_in > 0


@pytest.mark.skipif(importlib.util.find_spec("fbgemm_gpu") is None, reason="needs fbgemm-gpu (its CPU build will do)")
def test_fbgemm_side_has_our_tables_dims_and_weights():
    """FBGEMM's module of a mixed-dim configuration (built on the CPU: HOST tables) has a table of
    each configuration dim, and given our weights it pools a weighted, ragged batch as ours does:
    the FBGEMM side of bench fbgemm computes what ours computes."""
    from tiered_tbe.benchmarks import fbgemm_sides
    from tiered_tbe.benchmarks.fbgemm_configs import CONFIGS, simulation_shape

    config = simulation_shape(next(c for c in CONFIGS if c.name == "cached-odd-dims-ragged"))
    config = dataclasses.replace(config, placement="device")  # no cache on the CPU
    fbgemm = fbgemm_sides.fbgemm_module(config, device="cpu")
    ours = fbgemm_sides.ours_module(config, fbgemm_sides.DEFAULT_MODULE_ARGS, device="cpu")
    weights = fbgemm.split_embedding_weights()
    assert [tuple(w.shape) for w in weights] == list(zip(config.tables, config.dims))
    with torch.no_grad():
        for t, table in enumerate(weights):
            table.copy_(ours.table(t))
    batches, grad = fbgemm_sides.batches_of(config, seed=2, count=2, device="cpu")
    for indices, offsets, per_sample_weights in batches:
        assert per_sample_weights is not None
        with torch.no_grad():
            expected = ours(indices, offsets, per_sample_weights=per_sample_weights)
        got = fbgemm(indices, offsets, per_sample_weights=per_sample_weights)
        assert got.shape == (grad[: (offsets.numel() - 1) // len(config.tables)].shape)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_bench_fbgemm_tuning_sweeps_print_a_row_each(capsys):
    """--forward-tiles and --backward-configs time our HBM step again with each shape."""
    code = cli_main(["bench", "fbgemm", "--configs", "criteo-sgd", "--steps", "1", "--forward-tiles", "2,2,4",
                     "--backward-configs", "2,2,4,4"])
    assert code == 0
    out = capsys.readouterr().out
    assert "| criteo-sgd | forward, forward 2,2,4 |" in out and "| criteo-sgd | step, forward 2,2,4 |" in out
    assert "| criteo-sgd | backward, backward 2,2,4,4 |" in out


def test_bench_fbgemm_times_the_forward_of_one_launch_beside_column_groups(capsys):
    """--forward-one-launch times our HBM step again with the forward launched once over every feature."""
    code = cli_main(["bench", "fbgemm", "--configs", "mixed-weighted", "--steps", "1", "--forward-one-launch"])
    assert code == 0
    out = capsys.readouterr().out
    assert "| mixed-weighted | forward, forward one-launch |" in out
    assert "| mixed-weighted | step, forward one-launch |" in out


def test_bench_fbgemm_gives_a_cached_configuration_a_new_batch_every_step():
    """A cache that saw the batches before misses nothing: cached configurations never repeat a
    batch (warm-up, timed, profiled and FBGEMM's counted steps); the all-HBM ones cycle
    --distinct-batches."""
    bench_fbgemm = importlib.import_module("tiered_tbe.benchmarks.bench_fbgemm")
    counted = importlib.import_module("tiered_tbe.benchmarks.fbgemm_sides").COUNTED_STEPS
    by_name = {c.name: c for c in bench_fbgemm.CONFIGS}
    args = bench_fbgemm.check_args(bench_fbgemm.build_parser().parse_args(["--steps", "20", "--warmup", "8"]))
    steps = args.warmup + args.steps
    assert bench_fbgemm.batches_needed(by_name["criteo-sgd"], args) == args.distinct_batches
    assert bench_fbgemm.batches_needed(by_name["cached-lru"], args) == steps + counted
    assert bench_fbgemm.batches_needed(by_name["cached-lru-pipelined"], args) == steps  # FBGEMM's moves not counted
    args.profile = True
    assert bench_fbgemm.batches_needed(by_name["cached-lfu"], args) == steps + bench_fbgemm.PROFILED_STEPS + counted
    # The profiled steps take the batches after the timed ones, the counted ones those after them.
    assert importlib.import_module("tiered_tbe.benchmarks.sampling").cycle(list(range(7)), 3, first=5) == [5, 6, 0]


def test_bench_fbgemm_times_batches_of_changing_size_after_their_graphs_are_captured(monkeypatch):
    """On a GPU a configuration whose batch size changes every step warms up at least
    VARIABLE_SIZE_WARMUP steps (each padded batch shape captured), and draws a batch for each; another cached
    configuration CACHED_WARMUP, an uncached one --warmup."""
    sides = importlib.import_module("tiered_tbe.benchmarks.fbgemm_sides")
    bench_fbgemm = importlib.import_module("tiered_tbe.benchmarks.bench_fbgemm")
    by_name = {c.name: c for c in bench_fbgemm.CONFIGS}
    args = bench_fbgemm.check_args(bench_fbgemm.build_parser().parse_args(["--steps", "20", "--warmup", "8"]))
    monkeypatch.setattr(sides, "SIMULATION", False)
    ragged, fixed = by_name["cached-odd-dims-ragged"], by_name["cached-mixed-weighted"]
    assert sides.warmup_steps(ragged, args) == sides.VARIABLE_SIZE_WARMUP > args.warmup
    # A cached one of a fixed batch size warms up past the readings after which its forwards stop keeping copies.
    assert sides.warmup_steps(fixed, args) == sides.CACHED_WARMUP > CopyRows.QUIET_READINGS + 8
    assert sides.warmup_steps(by_name["criteo-adagrad"], args) == args.warmup  # nothing cached
    assert sides.batches_needed(ragged, args) == sides.VARIABLE_SIZE_WARMUP + args.steps + sides.COUNTED_STEPS
    args.warmup = 100
    assert sides.warmup_steps(ragged, args) == 100


def test_bench_fbgemm_tables_give_ratios_against_the_same_run():
    """The cached summary puts each phase beside FBGEMM's (ours / FBGEMM and their ratio), the step of
    the pipelined twin beside the serial one, and our best step against FBGEMM's best step of the
    same shape in the run (its LFU here); each side's rows and bytes moved beside the bus rate of its
    own prefetch; nothing is judged against a target."""
    tables = importlib.import_module("tiered_tbe.benchmarks.fbgemm_tables")
    moved = dict(rows_in_per_batch=100.0, rows_out_per_batch=40.0, bytes_in_per_batch=100 * 516.0,
                 bytes_out_per_batch=40 * 516.0, rows_in_place_per_batch=7.0, state_bytes_per_row=4,
                 prefetch_total=2.0, steps=2)
    results = [{"config": "criteo-adagrad", "ours": {"forward": 0.3, "backward": 0.6, "step": 1.0},
                "fbgemm": {"forward": 0.4, "backward": 0.8, "step": 1.2}},
               {"config": "cached-managed-lru", "ours": {"prefetch": 1.0, "forward": 0.5, "backward": 0.8, "step": 2.5,
                                                        **moved},
                "fbgemm": {"prefetch": 0.8, "forward": 0.5, "backward": 1.0, "step": 2.6, "rows_in_per_batch": 110.0,
                           "rows_out_per_batch": 90.0, "bytes_in_per_batch": 110 * 512.0,
                           "bytes_out_per_batch": 90 * 512.0, "prefetch_total": 1.6, "steps": 2}},
               {"config": "cached-managed-lfu", "ours": {"step": 2.4}, "fbgemm": {"step": 2.0}},
               {"config": "cached-managed-lru-pipelined", "ours": {"step": 1.9}, "fbgemm": {"step": 3.0}}]
    text = "\n".join(tables.table_of(results))
    assert "| criteo-adagrad | step | 1.200 | 1.000 | 0.83 |" in text
    assert ("| cached-managed-lru | 1.000 / 0.800 (1.25) | 0.500 / 0.500 (1.00) | 0.800 / 1.000 (0.80) | "
            "2.500 / 2.600 (0.96) | 1.900 / 3.000 (0.63) | 0.95 |") in text  # 1.9 against LFU's 2.0
    # Ours: (100 + 40) x 516 bytes in 1 ms a prefetch; FBGEMM: (110 + 90) x 512 bytes in 0.8 ms.
    assert "| cached-managed-lru | ours | 100 | 40 | 0.1 | 0.0 | 0.1 | 7 | - |" in text
    assert "| cached-managed-lru | FBGEMM | 110 | 90 | 0.1 | 0.0 | 0.1 | - | - |" in text
    fbgemm_moved = tables.moved(results[1]["fbgemm"])
    assert fbgemm_moved["rows_out_per_batch"] == 90 and fbgemm_moved["bus_gbs"] == (110 + 90) * 512 / 0.8 / 1e6
    assert tables.moved(results[1]["ours"])["bus_gbs"] == (100 + 40) * 516 / 1.0 / 1e6
    # Pipelined, the prefetch phase is the training stream's wait: rows and bytes, no rate.
    pipelined_moved = tables.moved(dict(moved, prefetch_total=0.006), pipelined=True)
    assert pipelined_moved["rows_in_per_batch"] == 100 and pipelined_moved["bus_gbs"] is None
    assert_no_verdicts(text)


@pytest.mark.parametrize("name, short", [
    ("void split_embedding_backward_codegen_sgd_unweighted_kernel_warp_per_row<float, float, 8>(at::Tensor)",
     "split_embedding_backward_codegen_sgd_unweighted_kernel_warp_per_row"),
    # FBGEMM's cache kernels live in an anonymous namespace (a profile once summed them all as "void").
    ("void fbgemm_gpu::(anonymous namespace)::lru_cache_insert_kernel<float, float, float>(at::PackedTensorAccessor64"
     "<float, 2ul, at::RestrictPtrTraits>, int, at::PackedTensorAccessor32<long, 1ul, at::RestrictPtrTraits>)",
     "lru_cache_insert_kernel"),
    ("void (anonymous namespace)::linearize_index_kernel<int, unsigned int>(int const*, long*)",
     "linearize_index_kernel"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::launch_clamp_scalar("
     "at::TensorIteratorBase&, c10::Scalar, c10::Scalar, at::native::detail::ClampLimits)::{lambda()#1}::operator()"
     "() const::{lambda()#7}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul> >(int, float, "
     "std::array<char*, 2ul>)", "vectorized_elementwise_kernel"),
    ("void cub::_V_300600_SM_900::detail::radix_sort::DeviceRadixSortOnesweepKernel<cub::_V_300600_SM_900::detail"
     "::radix_sort::policy_hub<long, cub::NullType, unsigned int>::Policy900, false, long>(int*, long*)",
     "DeviceRadixSortOnesweepKernel"),
    ("tiered_tbe::cache::_kernels::move_rows_kernel[abi:v23][abi:cw51cXTLSUwv1sCUt9Uw1VEw0NRRQPKiLTj0gIGIFp_2AA]"
     "(Array<signed char, 1, C, mutable, aligned>, Array<long long, 1, C, mutable, aligned>)", "move_rows_kernel"),
    ("Memcpy DtoD (Device -> Device)", "Memcpy DtoD"),
    ("Memset (Device)", "Memset"),
    ("_row_update_kernel", "_row_update_kernel"),
])
def test_kernel_profile_names_a_kernel_by_its_function(name, short):
    kernel_profile = importlib.import_module("tiered_tbe.benchmarks.kernel_profile")
    assert kernel_profile.short_kernel_name(name) == short


def test_kernel_profile_counts_each_kernel_in_the_phase_it_ran_in():
    """The profile's phases on the CPU, CPU ops standing in for kernels: each op is counted in the
    phase of step_times that ran it (a cumsum in the prefetch, tanh forward, its gradient backward),
    an op outside every phase as "other", and nothing is marked when no profile runs."""
    from tiered_tbe.benchmarks import fbgemm_timing, kernel_profile

    weight = torch.randn(4, 8, requires_grad=True)
    batches = [(torch.randn(16), None, None) for _ in range(3)]

    def step(i, indices, offsets, weights):
        return torch.tanh(weight * indices[:4, None])

    def run_steps():
        torch.cumsum(torch.ones(3), 0)  # outside every phase
        fbgemm_timing.step_times(step, batches, torch.ones(4, 8), warmup=0,
                                 before=lambda i, indices, offsets, weights: torch.cumsum(indices, 0))

    kernels = {"aten::cumsum", "aten::tanh", "aten::tanh_backward"}
    activities = [torch.profiler.ProfilerActivity.CPU]
    profile = kernel_profile.profile_phases(run_steps, 3, activities, lambda event: event.name in kernels)
    assert {(phase, kernel) for phase, kernel, _ in profile} == {
        ("other", "cumsum"), ("prefetch", "cumsum"), ("forward", "tanh"), ("backward", "tanh_backward")}
    assert all(ms > 0 for _, _, ms in profile)
    assert [ms for _, _, ms in profile] == sorted((ms for _, _, ms in profile), reverse=True)
    totals = kernel_profile.phase_totals(profile)
    assert set(totals) == {"other", "prefetch", "forward", "backward"}
    assert sum(totals.values()) == pytest.approx(sum(ms for _, _, ms in profile))
    with torch.profiler.profile(activities=activities) as unmarked:  # a timed step: no marks
        fbgemm_timing.step_times(step, batches, torch.ones(4, 8), warmup=0)
    assert not [event for event in unmarked.events() if event.name.startswith(kernel_profile.PHASE_MARK)]


def test_kernel_profile_bytes_and_simulation():
    kernel_profile = importlib.import_module("tiered_tbe.benchmarks.kernel_profile")
    assert len(kernel_profile.short_kernel_name("k" * 100, width=20)) == 20
    # 10 lookups of 512-byte rows, a [4, 64] fp32 output; 3 unique rows with 4 bytes of state each.
    assert kernel_profile.step_bytes(10, 3, 4, 64, 512, 4) == {"forward": 10 * 512 + 1024,
                                                              "backward": 1024 + 2 * 3 * 516}
    ran = []
    assert kernel_profile.kernel_ms_per_step(lambda: ran.append(1), 1) == []  # simulation: nothing on a device
    assert ran == [1]


def test_bench_fbgemm_profile_adds_the_host_time_of_each_phase(capsys):
    """--profile adds the host time to enqueue each phase (simulation: no kernel table)."""
    assert cli_main(["bench", "fbgemm", "--configs", "criteo-sgd", "cached-lru-pipelined", "--profile", "--steps",
                     "1"]) == 0
    out = capsys.readouterr().out
    assert "| criteo-sgd | backward: host ms to enqueue |" in out
    assert "| cached-lru-pipelined | prefetch: host ms to enqueue |" in out


def test_bench_fbgemm_counts_the_lookups_of_the_timed_and_the_profiled_steps():
    """The kernel profile runs on the batches after the timed ones: each side says how many lookups a
    step of each held (batches whose size changes every step differ)."""
    from tiered_tbe.benchmarks import bench_fbgemm
    from tiered_tbe.benchmarks.fbgemm_configs import PROFILED_STEPS

    batches = [(torch.zeros(10 * (i + 1)), None, None) for i in range(20)]
    warmup, count = 3, 7  # timed: batches 3..6 (40, 50, 60, 70 lookups); profiled: the next PROFILED_STEPS
    found = bench_fbgemm.lookups_of_steps(batches, warmup, count, profiled=True)
    assert found["lookups_per_step"] == 55
    profiled = [10 * (i + 1) for i in range(count, count + PROFILED_STEPS)]
    assert found["profiled_lookups_per_step"] == sum(profiled) / PROFILED_STEPS
    assert "profiled_lookups_per_step" not in bench_fbgemm.lookups_of_steps(batches, warmup, count, profiled=False)


def test_bench_fbgemm_sides_take_turns():
    """time_interleaved: each side warms up, then the sides take turns (the order reversed every
    other round), each timed on the same batches, until each has its count of steps."""
    timing = importlib.import_module("tiered_tbe.benchmarks.fbgemm_timing")
    calls = []

    def side(name):
        def step(i, indices, offsets, weights):
            calls.append((name, int(indices)))
            return torch.ones(1, 2, requires_grad=True) * 2

        return step

    batches = [(torch.tensor(b), torch.tensor(0), None) for b in range(5)]
    result = timing.time_interleaved({"a": side("a"), "b": side("b")}, batches, torch.ones(1, 2), warmup=2,
                                     count=6, round_steps=4)
    warm = [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    rounds = [("a", b) for b in (2, 3, 4, 0)] + [("b", b) for b in (2, 3, 4, 0)] + [("b", 1), ("b", 2), ("a", 1),
                                                                                    ("a", 2)]
    assert calls == warm + rounds
    assert set(result) == {"a", "b"}
    for times in result.values():
        assert {"forward", "backward", "step"} <= set(times) and all(value >= 0 for value in times.values())


def test_bench_fbgemm_interleaves_the_hbm_sides(capsys, monkeypatch):
    """With FBGEMM there (a stand-in: a second module of ours), an HBM configuration's two sides are
    built together and timed taking turns; both get their rows."""
    bench_fbgemm = importlib.import_module("tiered_tbe.benchmarks.bench_fbgemm")
    stand_in_args = argparse.Namespace(seed=1, mover=None, state_layout=None)
    monkeypatch.setattr(bench_fbgemm, "fbgemm_available", lambda: None)
    monkeypatch.setattr(bench_fbgemm, "fbgemm_module",
                        lambda config, **_: bench_fbgemm.ours_module(config, stand_in_args))
    args = bench_fbgemm.check_args(bench_fbgemm.build_parser().parse_args(
        ["--configs", "criteo-sgd", "--steps", "2", "--warmup", "1"]))
    (row,) = bench_fbgemm.run(args)
    assert row["ours"]["step"] > 0 and row["fbgemm"]["step"] > 0 and row["ours"]["kernel_forward"] > 0
    out = capsys.readouterr().out
    assert "criteo-sgd: FBGEMM (interleaved)" in out
    ratio = next(line for line in out.splitlines() if line.startswith("| criteo-sgd | step |")).split("|")[5]
    assert float(ratio) == pytest.approx(row["ours"]["step"] / row["fbgemm"]["step"], abs=0.006)


def test_bench_fbgemm_variants_take_turns_with_their_setting_set():
    """A tuning variant's environment is set during its own steps only, and restored after."""
    timing = importlib.import_module("tiered_tbe.benchmarks.fbgemm_timing")
    seen = []

    def side(name):
        def step(i, indices, offsets, weights):
            seen.append((name, os.environ.get("TIERED_TBE_TEST_TILE")))
            return torch.ones(1, 2, requires_grad=True) * 2

        return step

    os.environ.pop("TIERED_TBE_TEST_TILE", None)
    timing.time_interleaved({"default": side("default"), "variant": side("variant")},
                            [(torch.tensor(0), torch.tensor(0), None)], torch.ones(1, 2), warmup=1, count=2,
                            environments={"variant": {"TIERED_TBE_TEST_TILE": "4,1,2"}})
    assert {value for name, value in seen if name == "default"} == {None}
    assert {value for name, value in seen if name == "variant"} == {"4,1,2"}
    assert "TIERED_TBE_TEST_TILE" not in os.environ


def test_bench_fbgemm_records_each_configuration_once(tmp_path, capsys):
    """--record: one record per configuration, appended as soon as both sides of it are measured (a
    later configuration's failure on the device ends the process and keeps it); an HBM one timed in
    turns with FBGEMM's is appended at the end."""
    from tiered_tbe.cli import main as cli_main

    record = tmp_path / "records.jsonl"
    configs = ["cached-managed-lru", "cached-odd-dims-ragged", "criteo-sgd"]
    assert cli_main(["bench", "fbgemm", "--configs", *configs, "--steps", "1", "--ours-only",
                     "--record", str(record)]) == 0
    out = capsys.readouterr().out
    lines = records.read(record)
    assert sorted(line["configuration"]["name"] for line in lines) == sorted(configs)
    assert out.count("appended 1 records") == len(configs)  # ours only: each as it is done


def test_bench_fbgemm_leaves_out_fbgemms_side_where_it_fails_on_the_device(monkeypatch, capsys):
    """A configuration whose FBGEMM side fails on the device (``fbgemm_fails``: an illegal address
    ends the process) times ours alone and says why; its serial twin still runs FBGEMM's."""
    bench_fbgemm = importlib.import_module("tiered_tbe.benchmarks.bench_fbgemm")
    measured = []
    monkeypatch.setattr(bench_fbgemm, "fbgemm_available", lambda: None)
    monkeypatch.setattr(bench_fbgemm, "measure_fbgemm",
                        lambda config, *args: measured.append(config.name) or dict(prefetch=1.0, forward=1.0,
                                                                                   backward=1.0, step=3.0))
    args = bench_fbgemm.check_args(bench_fbgemm.build_parser().parse_args(
        ["--configs", "cached-mixed-weighted-z0.6", "cached-mixed-weighted-z0.6-pipelined", "--steps", "1",
         "--warmup", "0"]))
    rows = bench_fbgemm.run(args)
    assert measured == ["cached-mixed-weighted-z0.6"]
    assert rows[1]["fbgemm"] == {} and rows[1]["ours"]["step"] > 0
    assert "cached-mixed-weighted-z0.6-pipelined: FBGEMM not run: FBGEMM_GPU 1.6.0's prefetch_pipeline" in \
        capsys.readouterr().out


def test_a_records_step_counts_are_not_named_as_milliseconds():
    """host_forward is ms (host_forward_ms in a record); host_mallocs_per_step is a count and keeps its name."""
    from tiered_tbe.benchmarks.fbgemm_tables import _figures

    figures = _figures({"forward": 1.0, "host_forward": 0.5, "host_mallocs_per_step": 0.0,
                        "device_frees_per_step": 0.0})
    assert figures == {"forward_ms": 1.0, "host_forward_ms": 0.5, "host_mallocs_per_step": 0.0,
                       "device_frees_per_step": 0.0}


def test_bench_fbgemm_reports_what_our_cache_moved_and_read_in_place():
    """Per batch over the timed steps: rows and bytes in and out, and the distinct rows given no slot
    (read and written in place over the bus: what `lfu-admit` trades for the rows it does not move)."""
    bench_fbgemm = importlib.import_module("tiered_tbe.benchmarks.bench_fbgemm")
    from tiered_tbe import RowwiseAdagrad, TableSpec
    from tiered_tbe.cache.stats import CacheStats

    class StandIn:
        tables = [TableSpec(10, 8), TableSpec(10, 16)]
        optimizer = RowwiseAdagrad()

        def cache_stats(self):
            return CacheStats(batches=4, lookups=100, lookup_hits=60, unique_rows=50, unique_hits=20,
                              unique_misses=30, misses_no_slot=12, evictions=18, write_backs=10, bytes_in=1800,
                              bytes_out=1000)

    found = bench_fbgemm.rows_moved(StandIn())
    assert found["rows_in_per_batch"] == (30 - 12) / 4 and found["rows_out_per_batch"] == 10 / 4
    assert found["rows_in_place_per_batch"] == 12 / 4 and found["hit_rate"] == 0.6
    assert found["bytes_in_per_batch"] == 1800 / 4 and found["state_bytes_per_row"] == 4
