"""How long a fresh process takes to train at full speed: cold (empty kernel caches) and warm.

Each measurement is a new Python process (started here) that imports tiered_tbe, builds a model
and trains it for ``--steps`` steps, timing each step (synchronized on a GPU). Reported, from the
moment the process was started: the time to the end of the first step, and the time to full
speed (the end of the first step from which three steps in a row take at most 1.2x the median of
the last steps), with how many kernels the process compiled and how many it loaded from the
disk caches. "cold" runs with empty caches (``TRITON_CACHE_DIR``, ``NUMBA_CACHE_DIR`` and
``TIERED_TBE_CUB_CACHE_DIR`` pointed at new temporary folders), "warm" is a second process with the
caches the cold one left.

Models: ``main`` is ``tiered-tbe train``'s (a DLRM-style click model, tables in managed memory
behind the slot cache, the dense part included); ``bench`` is the shape ``tiered-tbe bench fbgemm``
times first (the 26 Criteo tables x 128 in HBM, one lookup per bag, B=65536, row-wise Adagrad).
``--tiny`` shrinks both to a few rows (CPU simulation: proves the mechanics, never the times).

    python tools/startup.py                          # both models, on the GPU
    python tools/startup.py --models bench --steps 80 --json startup.json
    python tools/startup.py --tiny --steps 4         # in CPU simulation
"""

from __future__ import annotations

import time

_STARTED = time.time()  # the child's own start, before its heavy imports (see --child)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

MODELS = ("main", "bench")
FULL_SPEED = 1.2  # a step within this factor of the median of the last steps runs at full speed
IN_A_ROW = 3  # ... and so do the next ones


def build(model: str, tiny: bool):
    """``(step, batches)`` of ``model``: ``step(batch)`` trains one batch; ``batches`` a few batches."""
    import numpy as np
    import torch

    from tiered_tbe import CacheConfig, Placement, RowwiseAdagrad, TableSpec, TieredEmbeddingBags
    from tiered_tbe.base.mode import default_device
    from tiered_tbe.zipf import ZipfSampler

    device = default_device()
    if model == "main":
        from torch import nn

        from tiered_tbe.train import NUM_DENSE, SyntheticClicks, TinyDLRM

        num_tables, rows, dim, batch_size, bag_size = (2, 200, 8, 8, 2) if tiny else (8, 2_000_000, 64, 8192, 8)
        tables = [TableSpec(rows, dim, name=f"t{t}", placement=Placement.MANAGED_CACHED) for t in range(num_tables)]
        embeddings = TieredEmbeddingBags(tables, optimizer=RowwiseAdagrad(lr=0.2), device=device,
                                         cache=CacheConfig(fraction=0.05))
        dlrm = TinyDLRM(embeddings, NUM_DENSE).to(device)
        dense_optimizer = torch.optim.Adam(list(dlrm.parameters()), lr=1e-3)
        data = SyntheticClicks(tables, batch_size, bag_size, 1.05, NUM_DENSE, device)
        loss_fn = nn.BCEWithLogitsLoss()

        def step(batch):
            loss = loss_fn(dlrm(batch), batch.labels)
            dense_optimizer.zero_grad(set_to_none=True)
            loss.backward()
            dense_optimizer.step()

        return step, [data.batch(i) for i in range(4)]

    from tiered_tbe.traces import CRITEO_KAGGLE_TABLE_ROWS

    rows, dim, batch_size = ([min(r, 100) for r in CRITEO_KAGGLE_TABLE_ROWS[:3]], 16, 16) if tiny else (
        list(CRITEO_KAGGLE_TABLE_ROWS), 128, 65536)
    tables = [TableSpec(n, dim, name=f"t{t}", placement=Placement.DEVICE) for t, n in enumerate(rows)]
    embeddings = TieredEmbeddingBags(tables, optimizer=RowwiseAdagrad(lr=0.01), device=device, bounds_check="off")
    rng = np.random.default_rng(0)
    samplers = [ZipfSampler(n, 1.05, rng) for n in rows]
    offsets = torch.arange(len(rows) * batch_size + 1, device=device)
    batches = [(torch.from_numpy(np.concatenate([s.sample(rng, batch_size) for s in samplers])).to(device), offsets)
               for _ in range(4)]
    grad = torch.randn(batch_size, dim * len(rows), device=device)

    def step(batch):
        embeddings(*batch).backward(grad)

    return step, batches


def child(model: str, steps: int, tiny: bool) -> dict:
    """In the measured process: import, build, train; the moments (``time.time()``) of each phase."""
    import torch

    import tiered_tbe  # noqa: F401  (picks GPU or simulation mode)
    from tiered_tbe.base import compiling
    from tiered_tbe.base.mode import SIMULATION

    imported = time.time()
    step, batches = build(model, tiny)
    built = time.time()
    ends = []
    for i in range(steps):
        step(batches[i % len(batches)])
        if not SIMULATION:
            torch.cuda.synchronize()
        ends.append(time.time())
    return dict(started=_STARTED, imported=imported, built=built, step_ends=ends, counts=dict(compiling.COUNTS),
                simulation=SIMULATION)


def measure(model: str, steps: int, tiny: bool, caches: Path) -> dict:
    """One fresh process of ``model`` with its kernel caches in ``caches``; its times from its start."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(caches / "triton"), NUMBA_CACHE_DIR=str(caches / "numba"),
               TIERED_TBE_CUB_CACHE_DIR=str(caches / "cub"))
    launched = time.time()
    command = [sys.executable, __file__, "--child", model, "--steps", str(steps)] + (["--tiny"] if tiny else [])
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"startup child {model} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    return summarize(report, launched)


def summarize(report: dict, launched: float) -> dict:
    """Times (s) from ``launched`` and the step where full speed is reached (``FULL_SPEED``)."""
    ends = report["step_ends"]
    durations = [b - a for a, b in zip([report["built"], *ends], ends)]
    last = durations[-max(3, len(durations) // 4):]
    median = statistics.median(last)
    fast = [d <= FULL_SPEED * median for d in durations]
    first_fast = next((i for i in range(len(fast)) if all(fast[i:i + IN_A_ROW])), len(fast) - 1)
    return dict(process_start_s=report["started"] - launched, imported_s=report["imported"] - launched,
                build_s=report["built"] - report["imported"], first_step_s=durations[0],
                to_first_step_s=ends[0] - launched, steps_to_full_speed=first_fast + 1,
                to_full_speed_s=ends[first_fast] - launched, median_step_ms=1000 * median,
                counts=report["counts"], simulation=report["simulation"])


def run(models, steps: int, tiny: bool) -> list[dict]:
    results = []
    for model in models:
        with tempfile.TemporaryDirectory(prefix=f"tiered_tbe_startup_{model}_") as folder:
            for state in ("cold", "warm"):  # warm: a second process, with the caches the cold one left
                results.append(dict(model=model, caches=state, **measure(model, steps, tiny, Path(folder))))
    return results


def print_table(results: list[dict]) -> None:
    print("seconds from the process's start (imported, first step, full speed); durations (built in, first step)")
    print(f"{'model':<6} {'caches':<6} {'imported':>8} {'built in':>8} {'1st step':>10} {'1st step at':>13} "
          f"{'full speed':>13} {'full speed at':>15} {'step ms':>8}  compiled / loaded (triton, numba, cub sorts)")
    for r in results:
        c = r["counts"]
        print(f"{r['model']:<6} {r['caches']:<6} {r['imported_s']:>8.2f} {r['build_s']:>8.2f} "
              f"{r['first_step_s']:>10.2f} "
              f"{r['to_first_step_s']:>13.2f} {'at step ' + str(r['steps_to_full_speed']):>13} "
              f"{r['to_full_speed_s']:>15.2f} {r['median_step_ms']:>8.2f}  "
              f"{c.get('triton compiled', 0)}/{c.get('triton loaded', 0)}, "
              f"{c.get('numba compiled', 0)}/{c.get('numba loaded', 0)}, "
              f"{c.get('cub compiled', 0)}/{c.get('cub loaded', 0)}")
    if results and results[0]["simulation"]:
        print("(CPU simulation: the kernels are interpreted, nothing is compiled; the times mean nothing)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="models (default both)")
    parser.add_argument("--steps", type=int, default=None, help="steps per process (default 60; 6 with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="a few rows per table (CPU simulation, tests)")
    parser.add_argument("--json", metavar="PATH", help="also write the results to this file")
    parser.add_argument("--child", choices=MODELS, help=argparse.SUPPRESS)  # the measured process
    args = parser.parse_args(argv)
    steps = args.steps or (6 if args.tiny else 60)
    if steps < IN_A_ROW + 1:
        parser.error(f"--steps must be at least {IN_A_ROW + 1}")
    if args.child:
        print(json.dumps(child(args.child, steps, args.tiny)))
        return 0
    results = run(args.models, steps, args.tiny)
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
