"""Where a side-by-side step's time goes on the GPU timeline: ours and FBGEMM's, phase by phase.

``tiered-tbe bench fbgemm`` times each phase with CUDA events, which count the GPU's idle time as well as
its work: a phase whose host enqueue is slower than its kernels reads slower than its kernels. For
the configurations asked for (``bench fbgemm``'s names, in HBM or cached: then each step prefetches
its batch first, on both sides), this trains ``--warmup`` steps of each side, records
``1 + --steps`` more with ``torch.profiler`` (the first left out: it starts after a
synchronize), and prints per phase (prefetch, forward, backward) and side:

- host ms: how long the phase's Python call took (``out.backward`` returns once the autograd
  thread has enqueued everything);
- lag ms: from the phase's host start to its first GPU work beginning (the GPU idles there when
  the previous phase's work has ended);
- busy ms: the union of the phase's kernels and copies on the GPU (work launched in the phase);
- span ms: from the previous phase's last GPU end to this phase's (what an event pair measures);
- idle ms: span less busy.

A pipelined configuration (ours only: bench fbgemm's ``PrefetchPipeline`` of depth 2) has no phases to
split, since its prefetches run on a side stream beside the step: for it the tool prints what each CUDA
stream is busy with per step, its top kernels, and how long the two busiest streams run together
(``tools/trace_pipeline.py``'s reading), which says whether the training stream waits for the bus or for
the SMs the prefetch holds.

Recording the host's ops costs the host more than the step's own enqueue (a ragged pipelined step of
2.97 ms enqueued at 4.8 ms a step under the profiler, H100): a step bound by its host then idles the GPU,
and the streams' overlap read from such a trace is not the unprofiled one. ``--gpu-only`` records the GPU's
kernels and copies alone (no host ops, no phase marks, no synchronize before the traced steps) and prints
the per-stream reading for every configuration, with the GPU span a step to compare with ``bench fbgemm``'s
step time: the closer the two, the less the tracing moved the timeline.

    python tools/trace_step.py --configs big-zipf-sgd --trace-dir $OUT
    python tools/trace_step.py --configs cached-odd-dims-ragged-lfu-admit-pipelined --ours-only
    python tools/trace_step.py --configs cached-odd-dims-ragged-lfu-admit-pipelined --ours-only --gpu-only --steps 30
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from torch.profiler import ProfilerActivity, profile, record_function
from trace_events import GPU_CATEGORIES, launch_times, steady_steps, trace_events, union_ms
from trace_pipeline import summarize

from tiered_tbe import PrefetchPipeline
from tiered_tbe.base.mode import SIMULATION, describe_mode  # first: picks GPU / simulation mode
from tiered_tbe.benchmarks import common, sampling
from tiered_tbe.benchmarks.fbgemm_configs import CONFIGS
from tiered_tbe.benchmarks.fbgemm_sides import (
    batches_of,
    fbgemm_available,
    fbgemm_module,
    ours_module,
    shape_of,
    warmup_steps,
)

PHASES = ("prefetch", "forward", "backward")


def trace_steps(emb, batches, grad, warmup: int, steps: int, trace_path: Path | None, cached: bool,
                pipelined: bool = False, lookahead: int = 0, gpu_only: bool = False) -> list[dict]:
    """Train ``warmup`` steps, record ``1 + steps`` more; the chrome trace's events. ``cached``: each step
    prefetches its batch first (``prefetch``). ``pipelined``: the batches come through a ``PrefetchPipeline``
    of depth 2 instead, as in ``bench fbgemm``'s pipelined configurations (``pipeline``: handing a batch out,
    which issues the next prefetch; ``lookahead``: batches a lookahead cache is told, 0 for the others).
    ``gpu_only``: record the GPU's work alone, and start without a synchronize (the GPU keeps the queue the
    warm-up left it, as in a long run); in simulation, which has no GPU, the host's ops instead."""
    host = not gpu_only or SIMULATION
    activities = ([ProfilerActivity.CPU] if host else []) + ([] if SIMULATION else [ProfilerActivity.CUDA])
    prof = profile(activities=activities)
    count = warmup + 1 + steps
    source = iter(PrefetchPipeline(emb, sampling.cycle(batches, count + lookahead), depth=2,
                                   lookahead=lookahead or None) if pipelined else sampling.cycle(batches, count))
    try:
        for i in range(count):
            if i == warmup:
                if host:
                    common.synchronize()
                prof.start()
            with record_function("step"):
                with record_function("pipeline" if pipelined else "batch"):
                    indices, offsets, weights = next(source)
                if cached and not pipelined:
                    with record_function("prefetch"):
                        emb.prefetch(indices, offsets)
                with record_function("forward"):
                    out = emb(indices, offsets, per_sample_weights=weights)
                with record_function("backward"):
                    out.backward(grad[: out.shape[0]])
            del out
        common.synchronize()
        prof.stop()
    finally:
        if pipelined:
            source.close()
    return trace_events(prof, trace_path)


def phase_table(events: list[dict], phases=PHASES[1:]) -> dict[str, dict[str, float]]:
    """Per phase, medians over the steps after the first: host, lag, busy, span and idle ms."""
    marks = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                   if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e["name"] in phases)
    launches = launch_times(events)
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    work: dict[int, list[tuple[float, float]]] = defaultdict(list)  # mark index -> GPU intervals
    for e in gpu:
        launched = launches.get(e["args"].get("correlation"))
        if launched is None:
            continue
        # The phase whose host interval holds the launch (the autograd thread's launches fall inside
        # the main thread's "backward" mark, which waits for them).
        for index, (start, stop, _) in enumerate(marks):
            if start <= launched <= stop:
                work[index].append((e["ts"], e["ts"] + e["dur"]))
                break
    rows: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in phases}
    previous_end = None
    for index, (start, stop, name) in enumerate(marks):
        intervals = work.get(index)
        if not intervals:
            continue
        first = min(s for s, _ in intervals)
        last = max(e for _, e in intervals)
        busy = union_ms(intervals)
        if previous_end is not None and index >= len(phases):  # leave the first traced step out
            span = (last - max(previous_end, min(start, first))) / 1e3
            row = rows[name]
            row["host"].append((stop - start) / 1e3)
            row["lag"].append(max(first - max(start, previous_end), 0.0) / 1e3)
            row["busy"].append(busy)
            row["span"].append(span)
            row["idle"].append(span - busy)
        previous_end = last
    return {name: {key: common.median(values) for key, values in row.items()} for name, row in rows.items() if row}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/trace_step.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["big-zipf-sgd"], metavar="NAME",
                        choices=[c.name for c in CONFIGS],
                        help="bench fbgemm's configurations, in HBM or cached (a pipelined one: ours only); "
                             "default big-zipf-sgd")
    parser.add_argument("--warmup", type=int, default=10,
                        help="steps before tracing (default 10; on a GPU at least bench fbgemm's warm-up of a "
                             "configuration whose batch size changes every step, so that its graphs are captured)")
    parser.add_argument("--steps", type=int, default=8, help="steps traced (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ours-only", action="store_true")
    parser.add_argument("--top", type=int, default=8, help="pipelined: kernels listed per stream (default 8)")
    parser.add_argument("--trace-dir", type=Path, help="write each side's chrome trace here (gzipped)")
    parser.add_argument("--gpu-only", action="store_true",
                        help="record the GPU's work alone (the host runs at its own pace) and print each "
                             "configuration per stream")
    args = parser.parse_args(argv)
    args.mover = args.state_layout = None  # what ours_module reads besides the config
    print(describe_mode(), flush=True)
    sides = ["ours"] + ([] if args.ours_only or fbgemm_available() else ["fbgemm"])
    for base in (c for c in CONFIGS if c.name in args.configs):
        config = shape_of(base)
        # Traced steps of shapes not captured yet run eagerly or capture: a ragged pipelined step traced after
        # 10 steps took ~15 ms (H100, 28be7d6) where a replayed one takes ~3. Warm up as bench fbgemm does.
        warmup = warmup_steps(config, args)
        # A cached configuration gets a new batch every step (a cache that saw a batch misses nothing).
        window = config.lookahead_window
        batches, grad = batches_of(config, args.seed, warmup + 1 + args.steps + window if config.cached else 6)
        phases = PHASES if config.cached else PHASES[1:]
        for side in ["ours"] if config.pipelined else sides:  # FBGEMM's pipelined side is not traced
            emb = ours_module(config, args) if side == "ours" else fbgemm_module(config)
            path = args.trace_dir / f"trace_{base.name}_{side}.json" if args.trace_dir else None
            events = trace_steps(emb, batches, grad, warmup, args.steps, path, config.cached,
                                 pipelined=config.pipelined, lookahead=window, gpu_only=args.gpu_only)
            if config.pipelined or args.gpu_only:
                what = "pipelined, depth 2; FBGEMM's side is not traced" if config.pipelined else "serial"
                print(f"== {base.name}, {side} ({what}{'; GPU work only' if args.gpu_only else ''})")
                # Without host marks the first traced step cannot be told apart: all 1 + steps are read.
                traced = args.steps + 1 if args.gpu_only else args.steps
                lines = summarize(events if args.gpu_only else steady_steps(events), traced, args.top,
                                  host=not args.gpu_only)
            else:
                print(f"== {base.name}, {side} (ms per step, medians)")
                lines = [f"   {name:<9}" + "  ".join(f"{key} {value:.3f}" for key, value in row.items())
                         for name, row in phase_table(events, phases).items()]
            for line in lines:
                print(line, flush=True)
            del emb
            common.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
