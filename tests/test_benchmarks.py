"""The benchmark scripts run end to end at a tiny size (CPU simulation here: their times mean nothing).

Each script's ``main`` is called in-process with tiny flags (3 tables of at most 1000 rows,
batch 8, 2 timed batches) and must print its table; ``--json`` and ``--record`` must write.
The GPU suite is only checked for shell syntax here; it runs on the lent H200.
"""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tiered_tbe  # noqa: F401  (chooses GPU / simulation mode before the scripts import triton or numba)

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TINY_MODEL = ["--num-tables", "3", "--row-cap", "1000", "--dim", "16", "--batch-size", "8", "--alpha", "1.05",
              "--warmup", "1", "--batches", "2"]


@pytest.fixture(scope="module")
def scripts():
    """The benchmark modules, imported as the scripts import each other (benchmarks/ on sys.path)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield {name: importlib.import_module(name) for name in ("common", "bench_cache", "bench_pipeline")}
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_bench_cache_prints_its_table(scripts, capsys, tmp_path):
    results_file, json_file = tmp_path / "RESULTS.md", tmp_path / "cache.json"
    scripts["bench_cache"].main([*TINY_MODEL, "--memcpy-gib", "0.0001", "--record", "--results-file",
                                 str(results_file), "--json", str(json_file)])
    out = capsys.readouterr().out
    assert "| model | lookups | prefetch ms | forward ms | backward ms | step ms |" in out
    assert "| host_cached | zipf 1.05 |" in out and "| all HBM | zipf 1.05 |" in out
    assert "fill / memcpy" in out and "serial step / all-HBM" in out
    if tiered_tbe.SIMULATION:
        assert "timings are meaningless" in out and "not judged in simulation" in out
    document = json.loads(json_file.read_text())
    cached = next(r for r in document["results"] if r.get("model") == "host_cached")
    assert cached["stats"]["batches"] == 2 and cached["stats"]["lookups"] == 2 * 3 * 8
    assert cached["rows_in_per_batch"] >= 0 and cached["step_vs_hbm"] > 0
    recorded = results_file.read_text()
    assert recorded.startswith("# Benchmark results") and "## bench_cache," in recorded
    assert "`python benchmarks/bench_cache.py --num-tables 3" in recorded


def test_bench_cache_big_table_mode(scripts, capsys, tmp_path):
    # 50 kB table of 16-float rows = 781 rows; a 10 kB cache (a few sets).
    json_file = tmp_path / "big.json"
    scripts["bench_cache"].main(["--big-table-gb", "0.00005", "--cache-gb", "0.00001", "--dim", "16",
                                 "--batch-size", "8", "--big-bag-size", "2", "--big-steps", "2",
                                 "--json", str(json_file)])
    out = capsys.readouterr().out
    assert "big table: 781 rows x 16 fp32" in out
    assert "| table GB | cache GB | lookups | steps (timed) |" in out
    result = json.loads(json_file.read_text())["results"][0]
    assert result["steps"] == 2 and result["timed_steps"] == 1 and result["stats"]["lookups"] == 8 * 2


def test_bench_cache_big_table_fails_clearly_without_memory(scripts, monkeypatch):
    monkeypatch.setattr(scripts["common"], "host_memory_available", lambda: 2**20)
    with pytest.raises(SystemExit, match="pinned host memory.*only 0.0 GiB is available"):
        scripts["bench_cache"].main(["--big-table-gb", "0.01", "--dim", "16"])


def test_bench_pipeline_prints_its_table(scripts, capsys, tmp_path):
    json_file = tmp_path / "pipeline.json"
    scripts["bench_pipeline"].main([*TINY_MODEL, "--depth", "2", "--bottom-mlp", "8", "--top-mlp", "8",
                                    "--json", str(json_file)])
    out = capsys.readouterr().out
    assert "| model | lookups | step ms | samples/s | throughput / all-HBM | rows moved / batch |" in out
    for name in ("all HBM", "managed, no cache", "host_cached lru, serial (prefetch in forward)",
                 "host_cached lru, pipelined depth 2", "host_cached lfu, pipelined depth 2",
                 "host_cached lookahead, pipelined depth 2"):
        assert f"| {name}" in out, name
    assert "throughput / all-HBM" in out and "lookahead rows moved / LRU" in out
    results = json.loads(json_file.read_text())["results"]
    pipelined = {r["policy"]: r for r in results if r["run"] == "pipelined"}
    assert set(pipelined) == {"lru", "lfu", "lookahead"}
    assert all(r["available"] and r["rows_in_per_batch"] is not None for r in pipelined.values())
    assert pipelined["lru"]["rows_vs_lru"] == 1.0
    if pipelined["lookahead"]["lookahead_hints"] is False:  # no hints: lookahead is LRU, exactly
        assert pipelined["lookahead"]["rows_in_per_batch"] == pipelined["lru"]["rows_in_per_batch"]


def test_bench_pipeline_says_na_for_a_missing_policy(scripts, capsys, monkeypatch):
    module = scripts["bench_pipeline"]
    real = module.CacheConfig

    def without_lookahead(**kwargs):
        if kwargs.get("policy") == "lookahead":
            raise ValueError("CacheConfig: policy must be 'lru' or 'lfu', got 'lookahead'")
        return real(**kwargs)

    monkeypatch.setattr(module, "CacheConfig", without_lookahead)
    module.main([*TINY_MODEL, "--modes", "pipelined", "--policies", "lookahead"])
    out = capsys.readouterr().out
    assert "host_cached lookahead: not available" in out
    assert "| host_cached lookahead, pipelined depth 2 | zipf 1.05 | n/a |" in out
    assert "lookahead rows moved / LRU: n/a (policy not available)" in out


@pytest.mark.parametrize("name", ["bench_cache", "bench_pipeline"])
def test_help(scripts, capsys, name):
    with pytest.raises(SystemExit) as exit_info:
        scripts[name].parse_args(["--help"])
    assert exit_info.value.code == 0
    assert "--record" in capsys.readouterr().out


def test_zipf_batches_are_tbe_batches_and_seeded(scripts):
    common = scripts["common"]
    rows = [1000, 5, 300]
    source = common.ZipfBatches(rows, 1.05, batch_size=64, bag_size=2, device="cpu", seed=3)
    indices, offsets = source.next()
    assert indices.dtype == torch.int64 and indices.shape == (3 * 64 * 2,)
    assert torch.equal(offsets, torch.arange(0, 3 * 64 * 2 + 1, 2))
    for t, n in enumerate(rows):
        part = indices[t * 128:(t + 1) * 128]
        assert 0 <= int(part.min()) and int(part.max()) < n
    again = common.ZipfBatches(rows, 1.05, batch_size=64, bag_size=2, device="cpu", seed=3).next()[0]
    assert torch.equal(indices, again)
    uniform = common.ZipfBatches(rows, 0.0, batch_size=64, bag_size=1, device="cpu").next()[0]
    assert int(uniform[64:128].max()) < 5
    global_rows = common.global_rows(indices, offsets, rows)
    assert torch.equal(global_rows[128:256], indices[128:256] + 1000)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_suite_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(BENCHMARKS / "gpu_suite.sh")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
