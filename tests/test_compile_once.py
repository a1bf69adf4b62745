"""The Triton kernels compile for the H200 (sm_90) here, without a GPU, and once per model shape.

Both run ``tools/compile_kernels.py`` in a fresh process (started as this module is
collected: tests/background.py) with the interpreter off: the kernels are compiled by
Triton's real compiler for sm_90 and never run. The interpreter that runs the rest of the
suite accepts code the compiler rejects, and cannot show specialization: Triton compiles a
kernel again for every new class of an integer argument (equal to 1, a multiple of 16,
other), so a per-batch count that is not marked ``do_not_specialize`` would compile a kernel
again for batch after batch (the slow first steps of a new model shape).
"""

import atexit
import copy
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from background import run_in_background

from tiered_tbe.base import compiling

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "compile_kernels.py"
REPORT = Path(tempfile.gettempdir()) / f"tiered_tbe_compile_report_{os.getpid()}.json"
sys.path.insert(0, str(SCRIPT.parent))
from compile_reports import compare_reports  # noqa: E402  (tools/, no side effects)

# Triton's disk cache of the compilation runs: empty at the first, kept for the second.
TRITON_CACHE = Path(tempfile.mkdtemp(prefix="tiered_tbe_triton_cache_"))
atexit.register(shutil.rmtree, TRITON_CACHE, ignore_errors=True)


def _start(*flags: str, **env_vars: str):
    """``compile_kernels.py`` with ``flags`` in a fresh process, started now (tests/background.py)."""
    env = dict(os.environ, TRITON_INTERPRET="0", TIERED_TBE_COMPILE_ONLY="1", NUMBA_ENABLE_CUDASIM="1",
               TRITON_DEFAULT_FP_FUSION="1", CUDA_VISIBLE_DEVICES="", **env_vars)
    return run_in_background([sys.executable, str(SCRIPT), *flags], env=env, timeout=600)


# The compile runs start as this module is collected, one after the other (the second after the first).
_RUNS = {"vector loads": _start("--optimizers", "sgd", "rowwise_adagrad", "lamb", "--save", str(REPORT)),
         "compilations": _start("--count-compilations", TRITON_CACHE_DIR=str(TRITON_CACHE)),
         "compilations again": _start("--count-compilations", TRITON_CACHE_DIR=str(TRITON_CACHE))}


def _run(name: str) -> str:
    result = _RUNS[name].result()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_every_kernel_compiles_for_sm90_with_vector_loads():
    out = _run("vector loads")
    lines = [line for line in out.splitlines() if "regs" in line]
    assert len(lines) >= 10, out
    for line in lines:
        if line.startswith(("forward", "row update", "hot row update", "hot window sums", "per-sample")):
            assert "v4 ld   0" not in line, f"lost 16-byte vector loads: {line}"
    # A graphed forward loads its tensors' addresses: with the alignment hints, it loads and stores 16
    # bytes at a time where the directly launched kernel does.
    accesses = {line.split("  ")[0]: re.search(r"v4 ld +\d+ +v4 st +\d+", line).group(0) for line in lines
                if line.startswith("forward")}
    graphed = [name for name in accesses if name.endswith(", addresses")]
    assert graphed, out
    for name in graphed:
        direct = name.removesuffix(", addresses")
        assert accesses[name] == accesses[direct], f"{name}: {accesses[name]} against {accesses[direct]}"


def test_saved_report_compares_and_flags_lost_vector_loads(capsys):
    """``--save`` writes the report that ``--compare`` (tools/compile_reports.py) checks a
    change against: the same report passes; one kernel with fewer 16-byte loads, or with spills,
    fails and is named."""
    _run("vector loads")
    report = json.loads(REPORT.read_text())
    assert report["triton"] and len(report["kernels"]) >= 10
    assert compare_reports(report, report) == 0

    fewer = copy.deepcopy(report)
    victim = next(k for k in fewer["kernels"] if k["kernel"].startswith("row update") and k["v4_loads"] > 0)
    victim["v4_loads"] -= 1
    assert compare_reports(report, fewer) == 1
    assert victim["kernel"] in capsys.readouterr().out

    spilled = copy.deepcopy(report)
    spilled["kernels"][0]["local_bytes"] += 8
    assert compare_reports(report, spilled) == 1
    more_registers = copy.deepcopy(report)
    more_registers["kernels"][0]["registers"] += 8  # reported, not a failure
    assert compare_reports(report, more_registers) == 0
    REPORT.unlink()


def _counts(out: str) -> dict[str, int]:
    return {line.split()[0]: int(line.split()[1]) for line in out.splitlines() if line.endswith(" compiled")}


def test_each_kernel_compiles_once_per_model_shape():
    """Batch sizes of 1, 2, 16, 77 and 512 and lookup counts of every class (a multiple of 16 or not)
    compile each kernel once: no per-batch integer is specialized."""
    out = _run("compilations")
    # The autotuner's tiles for the batches' bag-length class (its 6 tuned shapes, with twice the bags at 64
    # columns), each compiled once.
    forward_candidates = 6
    expected = {"_pooled_forward_kernel": forward_candidates, "_linearize_kernel": 1, "_run_starts_kernel": 1,
                "_run_ends_kernel": 1, "hot_window_sums_kernel": 1, "hot_group_sums_kernel": 1,
                "_per_sample_weights_grad_kernel": 1,
                # once per optimizer (two are used)
                "hot_row_update_kernel": 2, "_row_update_kernel": 2}
    assert {name: _counts(out).get(name) for name in expected} == expected, out
    assert "triton: 16 compiled, 0 loaded" in out, out


def test_a_second_process_loads_every_kernel_from_triton_s_disk_cache():
    """A new process of the same model shape compiles nothing (nothing defeats Triton's disk cache:
    no per-process value in a kernel's key), and the forward's autotuner loads its winner from the
    disk (``cache_results``) instead of compiling and timing every candidate tile."""
    first, second = _run("compilations"), _run("compilations again")
    assert "triton: 0 compiled" in second, second
    counts = _counts(second)
    assert counts["_pooled_forward_kernel"] == 1, second
    assert {k: v for k, v in counts.items() if k != "_pooled_forward_kernel"} == \
        {k: v for k, v in _counts(first).items() if k != "_pooled_forward_kernel"}, (first, second)
    assert compiling.MESSAGE in _RUNS["compilations"].result().stderr
    assert compiling.MESSAGE not in _RUNS["compilations again"].result().stderr


@pytest.mark.gpu
def test_training_compiles_each_kernel_once_on_the_gpu(device):
    """The same on the GPU, through the module: batches of varying sizes compile nothing new."""
    import torch
    from triton.runtime.autotuner import Autotuner

    import tiered_tbe.kernels.backward as backward
    import tiered_tbe.kernels.forward as forward
    from tiered_tbe import RowwiseAdagrad, TableSpec, TieredEmbeddingBags

    module = TieredEmbeddingBags([TableSpec(5000, 64), TableSpec(30, 64)], optimizer=RowwiseAdagrad(), device=device,
                                 bounds_check="off")

    def counts():
        functions = {"forward": forward._pooled_forward_kernel, "rows": backward._row_update_kernel,
                     "hot": backward.hot_row_update_kernel, "windows": backward.hot_window_sums_kernel}
        return {k: sum(len(c[0]) for c in (f.fn if isinstance(f, Autotuner) else f).device_caches.values())
                for k, f in functions.items()}

    def step(batch_size, extra):
        lengths = torch.full((2 * batch_size,), 2, device=device)  # one bag-length class for every batch
        lengths[-1] += extra
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        indices = torch.randint(0, 30, (int(offsets[-1]),), device=device)
        module(indices, offsets).sum().backward()

    step(1024, 0)
    before = counts()
    for batch_size, extra in ((1024, 1), (1024, 16), (1000, 3), (17, 0)):
        step(batch_size, extra)
    torch.cuda.synchronize()
    assert counts() == before

