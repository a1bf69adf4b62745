"""Training steps one after another, as a user's loop runs them: wall and host ms per step, ours beside FBGEMM's.

``bench_fbgemm`` times each phase of a step with CUDA events; this times what a training loop
gets: rounds of ``--round-steps`` steps (``module(indices, offsets).backward(grad)``, nothing else),
the host's time to issue a round and the wall time until the GPU has run it (a synchronize per
round only), per step. When the host takes longer than the GPU, the wall time is the host's: the
step is bound by the host, and only less host time per step makes it faster. The sides take turns,
round by round (the order reversed every other round), so a host whose speed wanders slows both.

    python benchmarks/steady_step.py --configs big-zipf-sgd criteo-adagrad
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

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


def timed_round(emb, batches, grad, first: int, steps: int) -> tuple[float, float]:
    """``(host ms, wall ms)`` per step of ``steps`` training steps from batch ``first`` on, the GPU
    idle at the start."""
    begin = time.perf_counter()
    for i in range(first, first + steps):
        indices, offsets = batches[i % len(batches)]
        emb(indices, offsets).backward(grad)
    issued = time.perf_counter()
    common.synchronize()
    done = time.perf_counter()
    return (issued - begin) * 1e3 / steps, (done - begin) * 1e3 / steps


def take_turns(sides: dict, batches, grad, rounds: int, round_steps: int, warmup: int) -> dict[str, dict]:
    """Median host and wall ms per step of each side (``sides``: name -> module), taking turns."""
    for emb in sides.values():
        timed_round(emb, batches, grad, 0, warmup)
    times = {name: {"host": [], "wall": []} for name in sides}
    order = list(sides)
    for round_number in range(rounds):
        for name in order if round_number % 2 == 0 else order[::-1]:
            host, wall = timed_round(sides[name], batches, grad, round_number * round_steps, round_steps)
            times[name]["host"].append(host)
            times[name]["wall"].append(wall)
    return {name: {kind: statistics.median(values) for kind, values in kinds.items()} for name, kinds in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [c.name for c in CONFIGS if not c.cached]
    parser.add_argument("--configs", nargs="+", choices=names, default=["big-zipf-sgd"])
    parser.add_argument("--rounds", type=int, default=2 if SIMULATION else 40, help="timed rounds a side")
    parser.add_argument("--round-steps", type=int, default=2 if SIMULATION else 50, help="steps a round")
    parser.add_argument("--warmup", type=int, default=1 if SIMULATION else 40, help="steps a side before timing")
    parser.add_argument("--ours-only", action="store_true")
    args = parser.parse_args(argv)
    print(describe_mode(), flush=True)
    missing = "not asked for" if args.ours_only else fbgemm_available()
    print("| configuration | side | host ms a step | wall ms a step | wall, ours / FBGEMM |")
    print("| --- | --- | ---: | ---: | ---: |")
    for base in (c for c in CONFIGS if c.name in args.configs):
        config = shape_of(base)
        batches, grad = batches_of(config, 0, 6)
        sides = {"ours": ours_module(config, DEFAULT_MODULE_ARGS)}
        if not missing:
            sides["FBGEMM"] = fbgemm_module(config)
        result = take_turns(sides, batches, grad, args.rounds, args.round_steps, args.warmup)
        for name, times in result.items():
            ratio = f"{times['wall'] / result['FBGEMM']['wall']:.2f}" if name == "ours" and "FBGEMM" in result else "-"
            print(f"| {base.name} | {name} | {times['host']:.3f} | {times['wall']:.3f} | {ratio} |", flush=True)
        if missing:
            print(f"| {base.name} | FBGEMM | {missing} | - | - |")
        del sides
        free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
