"""Where the host time of one backward call goes: ours split into its parts, FBGEMM's whole beside it.

``trace_step.py`` shows the GPU timeline under ``torch.profiler``, which slows the host several
times; this measures host time with ``time.perf_counter`` marks only. For each configuration
(``bench_fbgemm``'s names, HBM ones) and side it runs ``--calls`` training steps, each starting
with the GPU idle (a synchronize before the forward and before the backward), and prints the
median microseconds of:

- forward call: ``module(indices, offsets)`` until the GPU has run it (a synchronize);
- backward call: ``out.backward(grad)``, until it returns (the GPU still running it);
- ours only: the hand-over (the call's start to our autograd Function's ``backward`` starting, on
  autograd's device thread), our Python before the graph's replay, the replay's input copies,
  ``cudaGraphLaunch``, the rest of our ``backward``, and the hand-back (its end to the call's
  return). Nothing reaches the GPU before the launch: the sum up to it is how long the GPU
  waits for our backward.

    python benchmarks/host_split.py --configs big-zipf-sgd criteo-adagrad
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext

import torch

from tiered_tbe.base import graphs as graphs_module
from tiered_tbe.base.mode import SIMULATION, describe_mode  # first: picks GPU / simulation mode
from tiered_tbe.benchmarks import common
from tiered_tbe.benchmarks.bench_cache import free
from tiered_tbe.benchmarks.bench_fbgemm import (
    DEFAULT_MODULE_ARGS,
    batches_of,
    fbgemm_available,
    fbgemm_module,
    ours_module,
    shape_of,
)
from tiered_tbe.benchmarks.fbgemm_configs import CONFIGS
from tiered_tbe.function import TieredEmbeddingBagsFunction

# (name, first mark, second mark) of our backward's parts; "call" and "return" bound the whole call.
PARTS = (("hand-over", "call", "enter"), ("python before replay", "enter", "replay"),
         ("replay: input copies", "replay", "launch"), ("replay: cudaGraphLaunch", "launch", "launched"),
         ("after replay", "replayed", "exit"), ("hand-back", "exit", "return"))


@contextmanager
def marked(marks: dict):
    """Record perf_counter marks at our Function's backward, the StepGraphs replay and its graph
    launch while inside (the patches are removed on exit)."""
    backward = TieredEmbeddingBagsFunction.backward
    replay = graphs_module.StepGraphs._replay
    launch = torch.cuda.CUDAGraph.replay

    def marked_backward(ctx, grad_output):
        marks["enter"] = time.perf_counter()
        try:
            return backward(ctx, grad_output)
        finally:
            marks["exit"] = time.perf_counter()

    # The forward replays a graph too: only the backward's replay (after "enter") is marked.
    def marked_replay(self, *args, **kwargs):
        if "enter" not in marks:
            return replay(self, *args, **kwargs)
        marks["replay"] = time.perf_counter()
        try:
            return replay(self, *args, **kwargs)
        finally:
            marks["replayed"] = time.perf_counter()

    def marked_launch(self):
        if "enter" not in marks:
            return launch(self)
        marks["launch"] = time.perf_counter()
        launch(self)
        marks["launched"] = time.perf_counter()

    TieredEmbeddingBagsFunction.backward = staticmethod(marked_backward)
    graphs_module.StepGraphs._replay = marked_replay
    torch.cuda.CUDAGraph.replay = marked_launch
    try:
        yield
    finally:
        TieredEmbeddingBagsFunction.backward = staticmethod(backward)
        graphs_module.StepGraphs._replay = replay
        torch.cuda.CUDAGraph.replay = launch


def split_calls(emb, batches, grad, calls: int, warmup: int, ours: bool) -> dict[str, float]:
    """Median µs of each part over ``calls`` steps after ``warmup`` (parts whose marks a step did
    not reach, such as the replay's in simulation, are left out)."""
    parts: dict[str, list[float]] = {}
    marks: dict[str, float] = {}
    with marked(marks) if ours else nullcontext():
        for i in range(warmup + calls):
            indices, offsets = batches[i % len(batches)]
            marks.clear()
            common.synchronize()
            start = time.perf_counter()
            out = emb(indices, offsets)
            common.synchronize()
            marks["call"] = time.perf_counter()
            out.backward(grad)
            marks["return"] = time.perf_counter()
            common.synchronize()
            del out
            if i < warmup:
                continue
            parts.setdefault("forward call", []).append(marks["call"] - start)
            parts.setdefault("backward call", []).append(marks["return"] - marks["call"])
            for name, first, second in PARTS if ours else ():
                if first in marks and second in marks:
                    parts.setdefault(name, []).append(marks[second] - marks[first])
    return {name: statistics.median(values) * 1e6 for name, values in parts.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [c.name for c in CONFIGS if not c.cached]
    parser.add_argument("--configs", nargs="+", choices=names, default=["big-zipf-sgd"])
    parser.add_argument("--calls", type=int, default=2 if SIMULATION else 40, help="timed steps a side")
    parser.add_argument("--warmup", type=int, default=1 if SIMULATION else 10)
    parser.add_argument("--ours-only", action="store_true")
    args = parser.parse_args(argv)
    print(describe_mode(), flush=True)
    missing = "not asked for" if args.ours_only else fbgemm_available()
    for base in (c for c in CONFIGS if c.name in args.configs):
        config = shape_of(base)
        batches, grad = batches_of(config, 0, 4)
        for side in ("ours", "FBGEMM"):
            if side == "FBGEMM" and missing:
                print(f"== {base.name}, FBGEMM: {missing}")
                continue
            emb = ours_module(config, DEFAULT_MODULE_ARGS) if side == "ours" else fbgemm_module(config)
            result = split_calls(emb, batches, grad, args.calls, args.warmup, ours=side == "ours")
            print(f"== {base.name}, {side} (host µs, medians of {args.calls} calls)")
            print("   " + "  ".join(f"{name} {value:.0f}" for name, value in result.items()), flush=True)
            del emb
            free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
