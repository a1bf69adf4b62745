"""Start-up: kernels kept on disk between processes, and tools/startup.py.

A new process of a known model shape should load its kernels, not compile them: Triton's own disk
cache (tests/test_compile_once.py checks that a second process compiles nothing and loads only the
forward's winning tile) and numba's, for the slot cache's kernels (here: every kernel is declared
with it, in a folder that changes with any source the kernels are built from). Compiling itself
needs a GPU for numba: the gpu-marked test runs tools/startup.py and checks the warm process
compiles nothing.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from background import run_in_background

from tiered_tbe.base import compiling
from tiered_tbe.cache import launch

ROOT = Path(__file__).resolve().parents[1]
STARTUP = ROOT / "tools" / "startup.py"
NUMBA_CACHE = Path(tempfile.mkdtemp(prefix="tiered_tbe_numba_cache_"))
atexit.register(shutil.rmtree, NUMBA_CACHE, ignore_errors=True)

# What the slot cache's kernels are, declared for a GPU (numba's simulator off; nothing compiled).
_DECLARED = run_in_background([sys.executable, "-c", """
import json
import tiered_tbe
from numba.cuda.dispatcher import CUDADispatcher
from tiered_tbe.cache import _kernels, batch_kernels, launch
kernels = {name: type(value._cache).__name__ + " " + str(value._cache.cache_path)
           for module in (_kernels, batch_kernels) for name, value in vars(module).items()
           if isinstance(value, CUDADispatcher) and not value.targetoptions.get("device")}
print(json.dumps({"kernels": kernels, "folder": str(launch.kernel_cache_dir())}))
"""], env=dict(os.environ, NUMBA_ENABLE_CUDASIM="0", TIERED_TBE_COMPILE_ONLY="1", CUDA_VISIBLE_DEVICES="",
               NUMBA_CACHE_DIR=str(NUMBA_CACHE)), timeout=300)
_TOOL = run_in_background([sys.executable, str(STARTUP), "--tiny", "--models", "bench", "--steps", "4", "--json",
                           str(NUMBA_CACHE / "startup.json")], cwd=ROOT, timeout=600)


def test_every_cache_kernel_keeps_its_compiles_on_disk():
    result = _DECLARED.result()
    assert result.returncode == 0, result.stderr[-3000:]
    declared = json.loads(result.stdout.strip().splitlines()[-1])
    folder = Path(declared["folder"])
    assert folder.parent == NUMBA_CACHE and folder.name.startswith("tiered-tbe-")
    assert len(declared["kernels"]) >= 10, declared
    for name, cache in declared["kernels"].items():
        kind, path = cache.split(" ", 1)
        assert kind == "CUDACache" and Path(path).parent == folder, (name, cache)


def test_kernel_cache_folder_changes_with_any_source(tmp_path, monkeypatch):
    """Numba checks a kernel's own file only; the folder is named by every source the kernels are
    built from, so an edit of the policy alone does not run kernels compiled before it."""
    sources = []
    for path in launch.KERNEL_SOURCES:
        copy = tmp_path / path.name
        copy.write_bytes(path.read_bytes())
        sources.append(copy)
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))
    before = launch.kernel_cache_dir(tuple(sources))
    assert before.parent == tmp_path / "numba" and before == launch.kernel_cache_dir(tuple(sources))
    policy = next(s for s in sources if s.name == "policy.py")
    policy.write_text(policy.read_text() + "\n# edited\n")
    assert launch.kernel_cache_dir(tuple(sources)) != before
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert launch.kernel_cache_dir(tuple(sources)).parent == tmp_path / "xdg" / "tiered-tbe" / "numba"


def test_one_line_when_a_kernel_really_compiles(capsys, monkeypatch):
    monkeypatch.setattr(compiling, "_announced", False)
    monkeypatch.setattr(compiling, "COUNTS", type(compiling.COUNTS)())
    compiling.count("triton", loaded=5)
    assert capsys.readouterr().err == ""  # loading from the disk cache is not compiling
    compiling.count("numba", compiled=1)
    compiling.count("triton", compiled=3)
    assert capsys.readouterr().err == compiling.MESSAGE + "\n"
    assert compiling.COUNTS == {"triton loaded": 5, "triton compiled": 3, "numba compiled": 1, "numba loaded": 0}


def test_the_triton_listener_counts_and_chains(monkeypatch):
    knobs = pytest.importorskip("triton.knobs")
    heard = []
    monkeypatch.setattr(knobs.compilation, "listener", lambda **kwargs: heard.append(kwargs["cache_hit"]))
    monkeypatch.setattr(compiling, "_announced", True)
    monkeypatch.setattr(compiling, "COUNTS", type(compiling.COUNTS)())
    assert compiling.watch_triton_compiles()
    knobs.compilation.listener(src=None, metadata={}, metadata_group={}, times=None, cache_hit=True)
    knobs.compilation.listener(src=None, metadata={}, metadata_group={}, times=None, cache_hit=False)
    assert heard == [True, False]
    assert compiling.COUNTS["triton loaded"] == 1 and compiling.COUNTS["triton compiled"] == 1
    assert compiling.watch_triton_compiles()  # installed once


def test_startup_tool_measures_cold_and_warm_processes():
    """tools/startup.py at a tiny size in CPU simulation: two fresh processes of the model, the
    first with empty caches, the second with what the first left, each timed from its start."""
    result = _TOOL.result()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = json.loads((NUMBA_CACHE / "startup.json").read_text())
    assert [(r["model"], r["caches"]) for r in runs] == [("bench", "cold"), ("bench", "warm")]
    for r in runs:
        assert 0 < r["imported_s"] < r["to_first_step_s"] <= r["to_full_speed_s"]
        assert 1 <= r["steps_to_full_speed"] <= 4 and r["median_step_ms"] > 0
    assert "full speed at" in result.stdout


@pytest.mark.gpu
def test_a_warm_process_compiles_nothing(tmp_path):
    """On the GPU: the second process of a model shape loads every Triton and Numba kernel from the
    disk caches the first one filled, and reaches full speed sooner."""
    out = tmp_path / "startup.json"
    subprocess.run([sys.executable, str(STARTUP), "--models", "main", "bench", "--steps", "30", "--json", str(out)],
                   cwd=ROOT, check=True, timeout=1200)
    runs = {(r["model"], r["caches"]): r for r in json.loads(out.read_text())}
    for model in ("main", "bench"):
        cold, warm = runs[model, "cold"], runs[model, "warm"]
        assert cold["counts"].get("triton compiled", 0) > 0 and warm["counts"].get("triton compiled", 0) == 0
        assert warm["counts"].get("numba compiled", 0) == 0
        assert warm["to_full_speed_s"] < cold["to_full_speed_s"]
    assert runs["main", "cold"]["counts"].get("numba compiled", 0) > 0
    assert runs["main", "warm"]["counts"].get("numba loaded", 0) > 0
