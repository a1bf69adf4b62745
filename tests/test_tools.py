"""The developer tools of ``tools/`` (not installed) and the measurement records in ``results/``.

The trace and profile tools run at a tiny size in CPU simulation (their figures mean nothing
there: this checks their plumbing and their readers of a trace); ``results_table.py --check``
runs on small fixtures and on the README; every committed record is a full record; the GPU
scripts are only checked for shell syntax here.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

import tiered_tbe  # noqa: F401  (chooses GPU / simulation mode before the tools import triton or numba)
from tiered_tbe import records
from tiered_tbe.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"
sys.path.insert(0, str(TOOLS))  # the tools import each other as scripts do (tools/ is not a package)
TINY_MODEL = ["--num-tables", "3", "--row-cap", "1000", "--dim", "16", "--batch-size", "4", "--alpha", "1.05",
              "--warmup", "1"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _one_simulated_thread_per_launch(one_simulated_thread):
    """Plumbing, not the cache's kernels for races: one simulated thread a launch."""


def tool(name: str):
    return importlib.import_module(name)


# ------------------------------------------------------------------ results/ and results_table.py

RECORD_FIELDS = ("date", "device", "simulation", "versions", "commit", "command", "benchmark", "configuration",
                 "figures")


def test_every_committed_record_is_a_full_record():
    """results/measurements.jsonl: one JSON object a line, each with the fields every record has
    (date, device, versions, commit, command, configuration, figures); the lines converted from
    the old results file name the section they came from."""
    lines = records.read(REPO / "results" / "measurements.jsonl")
    assert len(lines) > 1000
    for line in lines:
        assert all(field in line for field in RECORD_FIELDS), line
        assert line["date"] and line["device"] and isinstance(line["versions"], dict)
        assert isinstance(line["configuration"], dict) and isinstance(line["figures"], dict)
        assert line.get("section") or line.get("source") != "benchmarks/RESULTS.md"
    assert {"fbgemm", "cache", "pipeline", "kernels", "hit-rate"} <= {line["benchmark"] for line in lines}


def fbgemm_record(name: str, ours: dict, fbgemm: dict, commit: str = "abc1234", date: str = "2026-12-04") -> dict:
    return {"date": date, "device": "NVIDIA H200", "simulation": False,
            "versions": {"torch": "2.11", "triton": "3.6", "fbgemm_gpu": "1.6.0"}, "commit": commit,
            "command": f"tiered-tbe bench fbgemm --configs {name}", "benchmark": "fbgemm",
            "configuration": {"name": name},
            "figures": {"ours": {f"{k}_ms": v for k, v in ours.items()},
                        "fbgemm": {f"{k}_ms": v for k, v in fbgemm.items()}}}


@pytest.fixture
def fixture_records(tmp_path) -> Path:
    lines = [
        fbgemm_record("criteo-adagrad", dict(forward=0.5, backward=0.9, step=1.4), dict(forward=0.4, backward=0.8,
                                                                                        step=1.2), commit="old0001"),
        fbgemm_record("criteo-adagrad", dict(forward=0.3, backward=0.6, step=0.9), dict(forward=0.4, backward=0.8,
                                                                                        step=1.2)),
        fbgemm_record("criteo-sgd", dict(forward=0.3), dict(forward=0.4)),  # incomplete: not shown
        fbgemm_record("cached-managed-lru", dict(prefetch=2.0, forward=0.6, backward=0.9, step=3.5),
                      dict(prefetch=2.1, forward=0.7, backward=1.1, step=3.9)),
        fbgemm_record("cached-managed-lfu", dict(prefetch=2.0, forward=0.6, backward=0.9, step=3.4),
                      dict(prefetch=2.0, forward=0.7, backward=1.1, step=3.0)),
        fbgemm_record("cached-managed-lfu", dict(step=1.0), dict(step=1.0), commit="other02"),  # another run
        fbgemm_record("cached-managed-lru-pipelined", dict(step=2.4), dict(step=4.0)),
        # A later run of the pipelined shape alone: FBGEMM's serial step unmeasured there, so it is not shown.
        fbgemm_record("cached-managed-lru-pipelined", dict(step=2.0), dict(step=9.0), commit="later03"),
        dict(fbgemm_record("big-zipf-sgd", dict(forward=1, backward=1, step=2), dict(forward=1, backward=1, step=2)),
             simulation=True, device="CPU simulation"),  # simulated: never shown
    ]
    path = tmp_path / "measurements.jsonl"
    records.append(path, lines)
    return path


def test_a_commit_given_in_the_environment_is_recorded_as_git_prints_it(monkeypatch):
    monkeypatch.setenv("TIERED_TBE_COMMIT", "21584d4b367ccf6ad3154e9fc3364c361d4b9d54")
    assert records.git_commit() == "21584d4"
    monkeypatch.setenv("TIERED_TBE_COMMIT", "21584d4+uncommitted")
    assert records.git_commit() == "21584d4+uncommitted"


def test_results_table_prints_the_latest_complete_records(fixture_records, capsys):
    results_table = tool("results_table")
    assert results_table.main(["--results", str(fixture_records)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("NVIDIA H200, 2026-12-04: torch 2.11, Triton 3.6, FBGEMM_GPU 1.6.0; commits abc1234.")
    assert ("| 26 Criteo tables x 128, B=65536, 1 lookup a table, Zipf 1.05, HBM |  | 0.300 / 0.400 (0.75) | "
            "0.600 / 0.800 (0.75) | 0.900 / 1.200 (**0.75**) |") in out
    assert "the same, SGD" not in out and "Zipf 1.05, SGD" not in out  # incomplete, simulated
    assert "| 2.000 / 2.100 (0.95) | 0.600 / 0.700 (0.86) | 0.900 / 1.100 (0.82) | 3.500 / 3.900 (**0.90**) |" in out
    # The pipelined step against FBGEMM's best step of the same run: its LFU's 3.0, not another run's 1.0;
    # the later run that measured no serial step is passed over.
    assert "| Criteo cached, pipelined (depth 2), against FBGEMM's best step |  |  |  | 2.400 / 3.000 (**0.80**) |" \
        in out


def test_results_table_check_of_a_readme(fixture_records, tmp_path, capsys):
    """--check passes when the README's table between the markers is what it prints, or when the
    README has no markers; else exit 1 with a diff."""
    results_table = tool("results_table")
    assert results_table.main(["--results", str(fixture_records)]) == 0
    table = capsys.readouterr().out
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Performance\n\n{results_table.BEGIN}\n{table}\n{results_table.END}\n\nmore\n")
    assert results_table.main(["--results", str(fixture_records), "--check", str(readme)]) == 0
    assert "matches" in capsys.readouterr().out
    readme.write_text(readme.read_text().replace("0.900 / 1.200", "0.850 / 1.200"))
    assert results_table.main(["--results", str(fixture_records), "--check", str(readme)]) == 1
    out = capsys.readouterr().out
    assert "-| 26 Criteo tables" in out and "+| 26 Criteo tables" in out and "0.850 / 1.200" in out
    readme.write_text("# a README without the markers\n")
    assert results_table.main(["--results", str(fixture_records), "--check", str(readme)]) == 0
    assert "nothing to check" in capsys.readouterr().out


def test_the_readme_table_matches_the_records(capsys):
    """The README's performance table is the one results/measurements.jsonl gives (or the README has
    no markers yet)."""
    assert tool("results_table").main(["--check", str(REPO / "README.md")]) == 0, capsys.readouterr().out


# ------------------------------------------------------------------ trace, profile, compile, plot


def test_trace_pipeline_measures_busy_overlap_and_idle_time_per_stream(capsys):
    trace = tool("trace_pipeline")
    events_of = tool("trace_events")
    assert events_of.union_ms([(0, 1000), (500, 1500), (3000, 4000)]) == 2.5  # us in, ms out
    assert events_of.intersect([(0, 1000), (2000, 3000)], [(500, 2500)]) == [(500, 1000), (2000, 2500)]

    def kernel(name, stream, start, end):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": end - start, "args": {"stream": stream}}

    # Two steps: the training stream (7) runs 0-4 ms and 6-10 ms; the side stream (13) 3-5 ms.
    events = [kernel("gemm", 7, 0, 4000), kernel("gemm", 7, 6000, 10000), kernel("copy_rows", 13, 3000, 5000),
              {"ph": "X", "cat": "user_annotation", "name": "forward", "ts": 0, "dur": 300}]
    lines = "\n".join(trace.summarize(events, steps=2, top=3))
    assert "forward 0.15" in lines  # host ms per step of each phase
    assert "GPU span of the 2 steps: 10.00 ms = 5.00 ms / step" in lines
    assert "stream 7: busy 4.000 ms / step (80% of the span), idle 1.000 ms / step, 1 kernels / step" in lines
    assert "stream 13: busy 1.000 ms / step" in lines
    assert "streams 7 and 13 both busy: 0.500 ms / step" in lines
    gpu_only = "\n".join(trace.summarize(events, steps=2, top=3, host=False))  # a trace of the GPU's work alone
    assert "host ms" not in gpu_only and "streams 7 and 13 both busy: 0.500 ms / step" in gpu_only

    # The first traced step is left out: its annotations and the GPU work launched before the second began.
    def launch(correlation, ts):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 5,
                "args": {"correlation": correlation}}

    def step(ts):
        return {"ph": "X", "cat": "user_annotation", "name": "step", "ts": ts, "dur": 100}

    late_first = kernel("gemm", 7, 9000, 9500) | {"args": {"stream": 7, "correlation": 1}}
    second = kernel("gemm", 7, 9600, 9900) | {"args": {"stream": 7, "correlation": 2}}
    steady = events_of.steady_steps([step(0), step(200), launch(1, 50), launch(2, 250), late_first, second])
    assert [e["name"] for e in steady] == ["step", "cudaLaunchKernel", "gemm"] and steady[2]["ts"] == 9600
    assert events_of.steady_steps(events) == events  # one step, or no correlation ids: whole
    trace.main([*TINY_MODEL, "--steps", "1", "--runs", "hbm", "lru-pipelined", "--placement", "managed_cached",
                "--bottom-mlp", "8", "--top-mlp", "8"])
    out = capsys.readouterr().out
    assert "== lru-pipelined (managed_cached, zero_copy mover)" in out and "host ms / step: step" in out


def test_trace_step_splits_each_phase_into_lag_busy_and_idle(capsys):
    trace = tool("trace_step")

    def mark(name, ts, dur):
        return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur}

    def launch(correlation, ts):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 5,
                "args": {"correlation": correlation}}

    def kernel(correlation, start, end):
        return {"ph": "X", "cat": "kernel", "name": "k", "ts": start, "dur": end - start,
                "args": {"correlation": correlation, "stream": 7}}

    events = []
    for step in range(3):  # each step 1000 us: forward host 0-100, backward host 100-600 (us after its start)
        t, c = 1000 * step, 10 * step
        events += [mark("forward", t, 100), launch(c, t + 50), kernel(c, t + 60, t + 160),
                   # the backward: its first kernel waits for the host (lag), two kernels with a gap (idle)
                   mark("backward", t + 100, 500), launch(c + 1, t + 300), kernel(c + 1, t + 310, t + 410),
                   launch(c + 2, t + 550), kernel(c + 2, t + 560, t + 660)]
    table = trace.phase_table(events)  # the first step left out
    # forward: host start to its kernel 60 us; the span runs from its host start (the GPU was idle) to its end.
    assert table["forward"] == pytest.approx({"host": 0.1, "lag": 0.06, "busy": 0.1, "span": 0.16, "idle": 0.06})
    backward = table["backward"]
    assert backward["host"] == 0.5 and backward["busy"] == 0.2
    assert backward["lag"] == pytest.approx(0.15)  # forward's GPU end (160) to the first backward kernel (310)
    assert backward["span"] == pytest.approx(0.5) and backward["idle"] == pytest.approx(0.3)  # 160 -> 660
    # A cached configuration of mixed dims, ragged weighted bags: each step prefetches first. A pipelined one
    # is read by stream (no GPU events in simulation, but the host time of its steps).
    trace.main(["--configs", "big-zipf-sgd", "cached-mixed-weighted", "cached-odd-dims-ragged-lfu-admit-pipelined",
                "--ours-only", "--warmup", "1", "--steps", "2"])
    out = capsys.readouterr().out
    assert "== big-zipf-sgd, ours" in out and "== cached-mixed-weighted, ours" in out
    pipelined = out.split("== cached-odd-dims-ragged-lfu-admit-pipelined, ours (pipelined, depth 2")[1]
    assert "host ms / step: step " in pipelined and "(no GPU events: simulation mode)" in pipelined
    host = dict(item.rsplit(" ", 1) for item in pipelined.split("host ms / step: ")[1].splitlines()[0].split(", "))
    assert float(host["step"]) > 0 and float(host["forward"]) > 0 and float(host["backward"]) > 0


def test_trace_step_warms_up_as_bench_fbgemm(monkeypatch):
    """On a GPU a configuration whose batch size changes every step is traced after bench fbgemm's
    warm-up (its graphs captured), not after --warmup alone, on a new batch every step."""
    trace = tool("trace_step")
    sides = importlib.import_module("tiered_tbe.benchmarks.fbgemm_sides")
    seen = []
    monkeypatch.setattr(sides, "SIMULATION", False)  # warmup_steps as on a GPU
    monkeypatch.setattr(trace, "batches_of", lambda config, seed, count: (list(range(count)), None))
    monkeypatch.setattr(trace, "ours_module", lambda config, args: None)
    monkeypatch.setattr(trace, "trace_steps", lambda emb, batches, grad, warmup, steps, *rest, **named: (
        seen.append((warmup, steps, len(batches))), [])[1])
    monkeypatch.setattr(trace, "summarize", lambda events, steps, top, **named: [])
    trace.main(["--configs", "cached-odd-dims-ragged-lfu-admit-pipelined", "--ours-only", "--warmup", "1",
                "--steps", "2"])
    assert seen == [(sides.VARIABLE_SIZE_WARMUP, 2, sides.VARIABLE_SIZE_WARMUP + 1 + 2)]


def test_trace_step_gpu_only_records_the_gpus_work_alone_without_a_synchronize(monkeypatch, capsys):
    """--gpu-only: on a GPU the profiler records CUDA activity alone (recording the host's ops slowed a
    host-bound step by half), the traced steps start without a synchronize (no start-up gap to leave
    out), and a serial configuration is read per stream, without host figures."""
    trace = tool("trace_step")
    seen = {"syncs": 0}

    class RecordingProfile:
        def __init__(self, activities):
            seen["activities"] = activities

        def start(self):
            seen["syncs_before_start"] = seen["syncs"]

        def stop(self):
            pass

    monkeypatch.setattr(trace, "SIMULATION", False)  # the tool's choices as on a GPU; the kernels still simulated
    monkeypatch.setattr(trace, "profile", RecordingProfile)
    monkeypatch.setattr(trace.common, "synchronize", lambda: seen.__setitem__("syncs", seen["syncs"] + 1))
    monkeypatch.setattr(trace, "trace_events", lambda prof, path: [])
    trace.main(["--configs", "cached-mixed-weighted", "--ours-only", "--warmup", "1", "--steps", "1", "--gpu-only"])
    out = capsys.readouterr().out
    assert seen["activities"] == [trace.ProfilerActivity.CUDA] and seen["syncs_before_start"] == 0
    assert "== cached-mixed-weighted, ours (serial; GPU work only)" in out and "host ms" not in out
    seen["syncs"] = 0
    trace.main(["--configs", "cached-mixed-weighted", "--ours-only", "--warmup", "1", "--steps", "1"])
    assert seen["activities"] == [trace.ProfilerActivity.CPU, trace.ProfilerActivity.CUDA]
    assert seen["syncs_before_start"] >= 1  # the default: host marks, and a synchronize before the traced steps


def test_profile_step_reports_host_and_device_time_per_phase(capsys):
    profile_step = tool("profile_step")
    profile_step.main([*TINY_MODEL, "--steps", "1", "--top", "3", "--skip-hbm"])
    out = capsys.readouterr().out
    assert "== host_cached, zipf 1.05: phase: host ms to enqueue / device ms" in out
    for phase in ("prefetch", "forward", "backward"):
        assert f"   {phase} " in out
    assert "host time of one SlotCache.lookup of 8 rows" in out
    assert "Self CPU" in out  # the profiler's table


def test_compile_cache_kernels_records_a_launch_of_every_cache_kernel():
    """tools/compile_cache_kernels.py compiles the signatures a small cache launches in simulation
    (the compiling half needs NVVM, not installed here): its driver must reach every Numba kernel
    of the cache, or a kernel would go unchecked."""
    from numba import types
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    from tiered_tbe.cache import _kernels, batch_kernels, policy_kernels

    compile_cache_kernels = tool("compile_cache_kernels")
    every = {name for module in (_kernels, batch_kernels, policy_kernels) for name, value in vars(module).items()
             if isinstance(value, FakeCUDAKernel) and not getattr(value, "_device", False)}
    launches = compile_cache_kernels.record_launches()
    assert {entry["kernel"] for entry in launches} == every
    prefetch_keys = {tuple(entry["args"][4]) for entry in launches if entry["kernel"] == "sort_keys_kernel"}
    assert prefetch_keys == {("array", "int32", 1, "C")}  # int32 keys: the rows fit
    assert {tuple(entry["args"][0]) for entry in launches if entry["kernel"] == "sort_keys_kernel"} == {
        ("array", "int64", 1, "C"), ("array", "int32", 1, "C")}  # int64 and int32 rows prefetched
    assert compile_cache_kernels.numba_type(["array", "uint8", 2, "A"]) == types.Array(types.uint8, 2, "A")
    assert compile_cache_kernels.numba_type(["boolean"]) == types.boolean


def test_plot_of_several_hit_rate_reports(capsys, tmp_path):
    plot_hit_rates = tool("plot_hit_rates")
    reports = []
    for alpha in ("1.05", "1.2"):
        reports.append(tmp_path / f"zipf{alpha}.json")
        assert cli_main(["bench", "hit-rate", "--rows", "5000", "--batch-size", "64", "--bag-size", "4", "--batches",
                         "20", "--no-progress", "--alpha", alpha, "--cache-sizes", "1%,5%", "--policies",
                         "lru,belady", "--json", str(reports[-1])]) == 0
        assert json.loads(reports[-1].read_text())["results"]
    png = tmp_path / "both.png"
    assert plot_hit_rates.main([*map(str, reports), "--titles", "a", "b", "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("script", ["gpu_suite.sh", "gpu_fbgemm.sh", "gpu_torchrec.sh", "pack_gpu_site.sh",
                                    "compile_like_device.sh", "bench_commits.sh"])
def test_gpu_scripts_are_valid_bash(script):
    result = subprocess.run(["bash", "-n", str(TOOLS / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("git") is None or not (REPO / ".git").exists(),
                    reason="needs bash and a git checkout")
def test_bench_commits_benchmarks_each_tree_with_its_own_code(tmp_path):
    """bench_commits.sh unpacks a commit's tree, then benchmarks the working tree and the unpacked one, each in a
    process that imports only its own code (the script refuses a tree importing the working tree's), with the
    settings of a variant, and an unpacked tree again with flags of its own; one record each, named by its label."""
    trees, out = tmp_path / "trees", tmp_path / "out"
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                          cwd=REPO).stdout.strip()
    env = {**os.environ, "TREES": str(trees), "OUT": str(out), "CONFIGS": "criteo-sgd",
           "TIERED_TBE_COMMIT": "worktree", "VARIANTS": "nopad:TIERED_TBE_PAD_BATCHES=0",
           "TREE_VARIANTS": f"{head}:seed7:--seed 7"}
    script = str(TOOLS / "bench_commits.sh")
    subprocess.run(["bash", script, "unpack", "HEAD"], env=env, check=True, capture_output=True, cwd=REPO)
    assert (trees / head / "kernels" / "forward.py").is_file() and not (trees / head / "results").exists()
    result = subprocess.run(["bash", script, "run", "--ours-only", "--steps", "1", "--warmup", "1"], env=env,
                            capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "imports" not in result.stdout, result.stdout
    lines = [json.loads(line) for line in (out / "measurements.jsonl").read_text().splitlines()]
    assert [(r["commit"], r.get("settings")) for r in lines] == [
        ("worktree", None), ("worktree-nopad", {"TIERED_TBE_PAD_BATCHES": "0"}), (head, None), (f"{head}-seed7", None)]
    assert "--steps 1 --warmup 1 --seed 7 --record" in lines[-1]["command"] and "--seed" not in lines[-2]["command"]
    assert all(r["figures"]["ours"]["step_ms"] > 0 for r in lines)
    assert (trees / head / "tiered_tbe" / "kernels").resolve() == (trees / head / "kernels").resolve()
    # Two files come back whatever the trees (a device call returns 8): the records and the logs packed.
    assert sorted(path.name for path in out.iterdir()) == ["bench_commits_logs.tgz", "measurements.jsonl"]
    with tarfile.open(out / "bench_commits_logs.tgz") as logs:
        assert sorted(logs.getnames()) == sorted(["bench_commits", *(f"bench_commits/{label}.log" for label in
                                                                      (head, "worktree", "worktree-nopad",
                                                                       f"{head}-seed7"))])


def test_tools_are_not_installed():
    """tools/ is for developers: the package maps no folder to it, and the benchmarks import none of it."""
    assert not re.search(r"""["']tools[."']""", (REPO / "pyproject.toml").read_text())
    names = [path.stem for path in TOOLS.glob("*.py")]
    for path in (REPO / "benchmarks").glob("*.py"):
        source = path.read_text()
        for name in names:
            assert f"import {name}" not in source and f"from {name} import" not in source, (path, name)


def test_results_table_pairs_records_of_one_run_and_shows_committed_code_only(tmp_path, capsys):
    """Records a run appended as each configuration finished (one ``run``, several dates) are one run:
    the pipelined step is set against FBGEMM's serial step of that run; a record of uncommitted code
    (``+`` in its commit) is never shown."""
    results_table = tool("results_table")
    serial = dict(fbgemm_record("cached-mixed-weighted", dict(prefetch=8, forward=0.5, backward=1.7, step=10.4),
                                dict(prefetch=8.5, forward=0.5, backward=3.0, step=12.0), date="2026-12-04T11:49:37"),
                  run="run-1")
    pipelined = dict(fbgemm_record("cached-mixed-weighted-pipelined", dict(step=10.3), dict(step=19.6),
                                   date="2026-12-04T11:49:48"), run="run-1")
    experiment = dict(fbgemm_record("cached-mixed-weighted-pipelined", dict(step=5.0), dict(step=19.6),
                                    commit="abc1234+uncommitted", date="2026-12-04T12:00:00"), run="run-2")
    path = tmp_path / "measurements.jsonl"
    records.append(path, [serial, pipelined, experiment])
    assert results_table.main(["--results", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| mixed dims, pipelined (depth 2), against FBGEMM's best step |  |  |  | 10.3 / 12.0 (**0.86**) |" in out
    assert "uncommitted" not in out and "5.000" not in out


def test_results_table_shows_a_pipelined_step_whose_fbgemm_pipeline_did_not_run_and_says_fit_cache(tmp_path, capsys):
    """FBGEMM_GPU's prefetch_pipeline fails on the Zipf 0.6 shape: the pipelined row is set against its serial
    steps of the run alone, its best of LRU and LFU, and says when our pipeline ran with ``--fit-cache``."""
    results_table = tool("results_table")
    lru = dict(fbgemm_record("cached-mixed-weighted-z0.6", dict(prefetch=31, forward=0.9, backward=2.8, step=35.0),
                             dict(prefetch=35, forward=1.0, backward=4.7, step=41.0)), run="run-1")
    lfu = dict(fbgemm_record("cached-mixed-weighted-z0.6-lfu-admit", dict(prefetch=4, forward=15, backward=18,
                                                                          step=37.0),
                             dict(prefetch=6, forward=13, backward=30, step=49.0)), run="run-1")
    pipelined = dict(fbgemm_record("cached-mixed-weighted-z0.6-lookahead-pipelined", dict(step=30.0), {}), run="run-1")
    pipelined["command"] += " --fit-cache"
    del pipelined["figures"]["fbgemm"]
    other_run = dict(fbgemm_record("cached-mixed-weighted-z0.6-lookahead-pipelined", dict(step=20.0), {}), run="run-2")
    path = tmp_path / "measurements.jsonl"
    records.append(path, [lru, lfu, pipelined, other_run])  # run-2 has no serial step of the shape: not shown
    assert results_table.main(["--results", str(path)]) == 0
    out = capsys.readouterr().out
    assert ("| mixed dims at Zipf 0.6, ours `lookahead`, pipelined (depth 2), against FBGEMM's best step, `fit_cache` "
            "|  |  |  | 30.0 / 41.0 (**0.73**) |") in out
    assert "20.0" not in out


@pytest.mark.skipif(importlib.util.find_spec("torchrec") is None or importlib.util.find_spec("fbgemm_gpu") is None,
                    reason="needs torchrec and fbgemm-gpu (the torchrec extra; its CPU build will do)")
def test_dmp_host_time_times_the_parts_of_a_step_on_both_sides(tmp_path, capsys):
    """tools/dmp_host_time.py in simulation (one process over gloo, bench torchrec's tiny size): each
    side's steps are timed, our module's and FBGEMM's methods on the path are counted once a step,
    and --record appends a full record."""
    import torch

    dmp_host_time = tool("dmp_host_time")
    clone = torch.Tensor.clone
    path = tmp_path / "measurements.jsonl"
    assert dmp_host_time.main(["--configs", "cached", "--steps", "2", "--warmup", "1", "--record", str(path)]) == 0
    out = capsys.readouterr().out
    assert "cached ours turn 0: wall" in out and "cached torchrec turn 1: wall" in out
    [record] = records.read(path)
    assert all(field in record for field in RECORD_FIELDS) and record["benchmark"] == "torchrec-host-time"
    ours, theirs = record["figures"]["ours"][0]["parts"], record["figures"]["torchrec"][0]["parts"]
    assert ours["ours: kernel forward (adapter and module)"]["calls"] == 1
    assert ours["ours: SlotCache prefetch"]["calls"] == 1 and ours["ours: SlotCache unlock"]["calls"] == 1
    assert theirs["torchrec: kernel forward"]["calls"] == 1 and "ours: SlotCache prefetch" not in theirs
    from tiered_tbe.cache.slot_cache import SlotCache
    assert SlotCache.prefetch.__qualname__ == "SlotCache.prefetch" and torch.Tensor.clone is clone  # removed


def test_host_costs_refuses_without_a_gpu_and_times_every_call_with_one(tmp_path, capsys):
    import torch

    host_costs = tool("host_costs")
    if not torch.cuda.is_available():
        assert host_costs.main([]) == 2
        assert "needs a CUDA device" in capsys.readouterr().err
        return
    path = tmp_path / "measurements.jsonl"
    assert host_costs.main(["--calls", "20", "--record", str(path)]) == 0
    [record] = records.read(path)
    assert record["benchmark"] == "host-costs" and all(value > 0 for value in record["figures"]["host_us"].values())


def test_bench_trace_writes_a_configurations_batches_for_the_simulator(tmp_path, monkeypatch, capsys):
    """A ``bench fbgemm`` configuration's batches (here a tiny twin of the ragged one: batch size and bag
    length drawn every batch) written as a trace: the simulator reads every lookup of every batch,
    each in its own table's rows."""
    bench_trace = tool("bench_trace")
    configs = importlib.import_module("tiered_tbe.benchmarks.fbgemm_configs")
    tiny = configs.simulation_shape(next(c for c in configs.CONFIGS if c.name == "cached-odd-dims-ragged"))
    monkeypatch.setattr(configs, "CONFIGS", [tiny])
    monkeypatch.setattr(configs, "CONFIG_NAMES", [tiny.name])
    path = tmp_path / "trace.pt"
    assert bench_trace.main([tiny.name, "6", str(path)]) == 0
    assert f"--table-rows {','.join(map(str, tiny.tables))}" in capsys.readouterr().out
    batches = torch.load(path)
    assert len(batches) == 6 and len({offsets.numel() for _, offsets in batches}) > 1  # batch sizes change
    for indices, offsets in batches:
        assert (offsets.numel() - 1) % len(tiny.tables) == 0 and offsets[-1] == indices.numel()
        bags = (offsets.numel() - 1) // len(tiny.tables)
        table_of_lookup = torch.repeat_interleave(torch.arange(len(tiny.tables)).repeat_interleave(bags),
                                                  offsets.diff())
        assert (indices >= 0).all() and (indices < torch.tensor(tiny.tables)[table_of_lookup]).all()
    report = tmp_path / "hit_rate.json"
    assert cli_main(["bench", "hit-rate", "--trace", "file", "--file", str(path), "--table-rows",
                     ",".join(map(str, tiny.tables)), "--cache-sizes", "10%", "--policies", "lru",
                     "--no-progress", "--json", str(report)]) == 0
    trace = json.loads(report.read_text())["trace"]
    assert trace["lookups"] == sum(indices.numel() for indices, _ in batches) and trace["batches"] == 6
    with pytest.raises(SystemExit, match="unknown configuration"):
        bench_trace.main(["no-such-configuration", "2", str(path)])


def test_bench_host_memory_times_every_kind_and_row_width(tmp_path, capsys):
    """One row per kind of memory and row width, with the rate of each way of moving rows, and one
    record each; the kinds of pinned memory are the tiers' own (one definition)."""
    bench_host_memory = tool("bench_host_memory")
    from tiered_tbe.cache import tiers

    assert set(bench_host_memory.KINDS) == {*tiers.HOST_MEMORY_KINDS, *bench_host_memory.MANAGED_KINDS}
    path = tmp_path / "records.jsonl"
    assert bench_host_memory.main(["--gb", "0.001", "--rows", "40", "--dims", "3", "16", "--repeats", "1",
                                   "--record", str(path)]) == 0
    out = capsys.readouterr().out
    found = records.read(path)
    assert len(found) == 2 * len(bench_host_memory.KINDS)
    assert {(r["configuration"]["memory"], r["configuration"]["row_bytes"]) for r in found} == \
        {(kind, width) for kind in bench_host_memory.KINDS for width in (12, 64)}
    for record in found:
        figures = record["figures"]
        assert all(figures[f"{way}_gbs"] > 0 and figures[f"{way}_ms"] > 0 for way in bench_host_memory.WAYS)
        assert record["configuration"]["transparent_huge_pages"]
        # The command that ran, from the repository root: the tool's own path (a record once named benchmarks/).
        assert record["command"].startswith("python tools/bench_host_memory.py --gb 0.001 --rows 40")
        assert record["benchmark"] == "host_memory"
    assert "| registered_huge_pages |" in out and "| managed |" in out and "| managed_prefetched |" in out
    with pytest.raises(SystemExit):
        bench_host_memory.main(["--gb", "0.00000001", "--dims", "128"])


def test_bench_host_memory_interleaves_a_write_back_and_a_fill_per_program():
    """The interleaved way's kernel writes every leaving row to its row of the table and reads every
    filled row as it was (plain torch beside it), at an odd width; nothing else of the table changes."""
    bench_host_memory = tool("bench_host_memory")
    generator = torch.Generator().manual_seed(5)
    table = torch.randn(64, 5, generator=generator)
    before = table.clone()
    filled = torch.tensor([0, 2, 2, 40, 62])  # a row read twice; even rows only
    written = torch.tensor([1, 3, 33, 51, 63])
    staged = torch.full((5, 5), float("nan"))
    leaving = torch.randn(5, 5, generator=generator)
    bench_host_memory.interleave_rows(table, filled, staged, written, leaving)
    assert torch.equal(staged, before[filled])
    expected = before.clone()
    expected[written] = leaving
    assert torch.equal(table, expected)


@pytest.mark.parametrize("programs,rows_a_step", [(1, 1), (3, 4), (0, 2), (64, 8)])
def test_bench_link_sharing_gathers_every_row_whatever_the_grid(programs, rows_a_step):
    """The grid-stride gather equals plain indexing for grids smaller and larger than its steps (0: one
    program a step), rows repeated, an odd width, a count no step size divides; nothing past the count."""
    bench_link_sharing = tool("bench_link_sharing")
    generator = torch.Generator().manual_seed(programs)
    table = torch.randn(50, 7, generator=generator)
    rows = torch.cat([torch.randint(0, 50, (20,), generator=generator), torch.full((3,), 49)])
    out = torch.full((rows.numel() + 2, 7), float("nan"))
    bench_link_sharing.strided_gather(table, rows, out[: rows.numel()], programs, rows_a_step)
    assert torch.equal(out[: rows.numel()], table[rows])
    assert out[rows.numel():].isnan().all()


def test_bench_host_rows_times_each_copy_and_thread_count(tmp_path, capsys):
    """Every host copy of the staged mover (cache/host_rows.HOST_COPIES, the one definition) at every
    thread count and row count, each a record that names the tool and what it copied."""
    bench_host_rows = tool("bench_host_rows")
    from tiered_tbe.cache.host_rows import HOST_COPIES

    path = tmp_path / "records.jsonl"
    assert bench_host_rows.main(["--gb", "0.002", "--placement", "cpu", "--rows", "50", "--threads", "1",
                                 "--repeats", "1", "--record", str(path)]) == 0
    found = records.read(path)
    assert {r["configuration"]["copy"] for r in found} == set(HOST_COPIES)
    assert {"gather", "scatter"} <= {r["configuration"]["what"] for r in found}
    assert all(r["figures"]["ms"] > 0 and r["figures"]["gbs"] > 0 and r["configuration"]["rows"] == 50
               for r in found)
    assert all(r["command"].startswith("python tools/bench_host_rows.py --gb 0.002") for r in found)
    assert "| gather |" in capsys.readouterr().out


def test_bench_link_sharing_records_each_grid(tmp_path, capsys):
    bench_link_sharing = tool("bench_link_sharing")
    path = tmp_path / "records.jsonl"
    assert bench_link_sharing.main(["--rows", "30", "--keys", "40", "--dim", "5", "--programs", "2", "0",
                                    "--rows-a-step", "1", "4", "--partition", "1", "--repeats", "1",
                                    "--record", str(path)]) == 0
    found = records.read(path)
    assert [tuple(r["configuration"][key] for key in ("programs", "rows_a_step", "sort_sms", "gather_sms"))
            for r in found] == [(2, 1, None, None), (2, 1, 1, 3), (0, 1, None, None), (0, 1, 1, 3),
                                (2, 4, None, None), (2, 4, 1, 3), (0, 4, None, None), (0, 4, 1, 3)]
    assert all(r["figures"]["gather_ms"] > 0 and r["figures"]["both_ms"] > 0 for r in found)
    assert all(r["command"].startswith("python tools/bench_link_sharing.py --rows 30") for r in found)
    out = capsys.readouterr().out
    assert "| shared | one a step | 4 |" in out and "| 1 / 3 | one a step | 4 |" in out
    for wrong in (["--rows-a-step", "3"], ["--partition", "0"]):
        with pytest.raises(SystemExit):
            bench_link_sharing.main(wrong)


def test_bench_link_sharing_checks_what_the_gather_wrote(monkeypatch):
    """A gather that left a row unwritten (a launch that did nothing on a stream) fails the measurement."""
    bench_link_sharing = tool("bench_link_sharing")
    table = torch.randn(40, 3)
    real = bench_link_sharing.strided_gather

    def skips_the_last_row(table, rows, out, programs, rows_a_step):
        real(table, rows[:-1], out[:-1], programs, rows_a_step)

    monkeypatch.setattr(bench_link_sharing, "strided_gather", skips_the_last_row)
    with pytest.raises(AssertionError, match="not the rows it read"):
        bench_link_sharing.measure(table, 10, 20, 2, 1, 1, 0)


def test_find_allocations_names_the_project_frames_of_a_segment():
    """tools/find_allocations.py groups each cudaMalloc by the project's innermost frames of its stack
    (torch's own frames left out), as many as asked; a stack without one says so."""
    find = tool("find_allocations")
    frames = [{"filename": "/usr/lib/python3/site-packages/torch/cuda/graphs.py", "line": 9, "name": "replay"},
              {"filename": "/repo/kernels/linearize.py", "line": 76, "name": "linearize"},
              {"filename": "/repo/tiered_tbe/module.py", "line": 251, "name": "_prepare"},
              {"filename": "/repo/tiered_tbe/module.py", "line": 355, "name": "prefetch"}]
    assert find.project_frames(frames, 2) == "linearize.py:76 linearize <- module.py:251 _prepare"
    assert find.project_frames(frames[:1], 2) == "(no project frame)"
