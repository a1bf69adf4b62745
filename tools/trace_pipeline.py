"""Where a pipelined training step's time goes, on the GPU timeline: what each stream is busy
with, how much the prefetch stream overlaps the training stream, and how long the training
stream sits idle.

The model and batches of ``tiered-tbe bench pipeline`` (its model flags). For each run (``--runs``: all-HBM,
serial LRU, pipelined LRU, pipelined lookahead) it trains ``--warmup`` steps, then records
``--steps`` steps with ``torch.profiler`` (after one more that settles the profiler's start and is
left out, ``steady_steps``) and reads the kernels of the trace back:

- per CUDA stream: busy ms per step (the union of its kernel and copy intervals), kernels per
  step, and its top kernels by time;
- the overlap of the two busiest streams (ms per step when both run), and the idle ms per step
  of the busiest (the training stream): time it waits for the host or for the other stream;
- host ms per step of each phase (``pipeline``: handing the next batch out, which issues a
  prefetch; ``forward``, ``backward``, ``optimizer``).

A pipelined step that gains little over a serial one either has prefetch kernels that slow the
training kernels down (compare the training stream's busy time with all-HBM's), or a training
stream that waits (idle time), for the host or for a prefetch. The traces are written to
``--trace-dir`` (chrome://tracing or https://ui.perfetto.dev).

    python tools/trace_pipeline.py --alpha 1.05 --steps 5 --trace-dir $OUT
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function
from trace_events import GPU_CATEGORIES, intersect, steady_steps, trace_events, union_ms

from tiered_tbe.base.mode import SIMULATION, default_device, describe_mode  # first: picks GPU / simulation mode
from tiered_tbe.benchmarks import common
from tiered_tbe.benchmarks.models import SmallDLRM, add_dlrm_flags, build_module, check_dlrm_args, make_batches
from tiered_tbe.cache.mover import MOVERS
from tiered_tbe.cache.policy import POLICIES
from tiered_tbe.pipeline import DEFAULT_LOOKAHEAD, PrefetchPipeline
from tiered_tbe.specs import CacheConfig, Placement

RUNS = {  # name: (cached, policy, pipelined); cached runs take --placement and --mover (their first)
    "hbm": (False, None, False),
    "lru-serial": (True, "lru", False),
    "lru-pipelined": (True, "lru", True),
    "lfu-pipelined": (True, "lfu", True),
    "lookahead-pipelined": (True, "lookahead", True),
}
PHASES = ("pipeline", "forward", "backward", "optimizer")
GPU_DEFAULTS = dict(tables=26, row_cap=0, dim=128, batch_size=65536, bag_size=1)
SIMULATION_DEFAULTS = dict(tables=3, row_cap=1000, dim=16, batch_size=8, bag_size=1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python tools/trace_pipeline.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_table_flags(parser, GPU_DEFAULTS, SIMULATION_DEFAULTS)
    common.add_cache_flags(parser, list(POLICIES))
    add_dlrm_flags(parser)
    run = parser.add_argument_group("run")
    run.add_argument("--runs", nargs="+", default=["hbm", "lru-serial", "lru-pipelined", "lookahead-pipelined"],
                     choices=list(RUNS),
                     help="what to trace (default: hbm lru-serial lru-pipelined lookahead-pipelined)")
    run.add_argument("--depth", type=int, default=2, help="batches the pipeline prefetches ahead (default 2)")
    run.add_argument("--lookahead", type=int, default=DEFAULT_LOOKAHEAD,
                     help=f"batches a lookahead cache learns from (default {DEFAULT_LOOKAHEAD})")
    run.add_argument("--placement", default="host_cached", choices=[p.value for p in Placement if p.is_cached],
                     help="backing store of the cached runs (default host_cached)")
    run.add_argument("--mover", default="zero_copy", choices=MOVERS, help="row mover of the cached runs")
    run.add_argument("--training-priority", default="high", choices=["default", "high"],
                     help="PrefetchPipeline(high_priority=...) of the pipelined runs (default high)")
    run.add_argument("--bounds-check", default="off", choices=["off", "raise"], help="the module's bounds_check")
    run.add_argument("--warmup", type=int, default=15, help="steps before the trace (default 15)")
    run.add_argument("--steps", type=int, default=5, help="steps recorded per run (default 5)")
    run.add_argument("--top", type=int, default=8, help="kernels listed per stream (default 8)")
    run.add_argument("--trace-dir", type=Path, help="write each run's chrome trace here (gzipped)")
    run.add_argument("--seed", type=int, default=0, help="seed of the weights, the lookups and the dense data")
    return parser


def train_and_trace(model, batches, args, pipelined: bool, trace_path: Path | None) -> dict:
    """Train ``warmup`` steps, record ``1 + steps`` more; return the trace's events (chrome JSON)."""
    dense_optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    loss_fn = nn.BCEWithLogitsLoss()
    lookahead = args.lookahead if model.embeddings.uses_lookahead else 0
    source = iter(PrefetchPipeline(model, batches, depth=args.depth, lookahead=lookahead,
                                   high_priority=args.training_priority == "high") if pipelined else batches)
    activities = [ProfilerActivity.CPU] + ([] if SIMULATION else [ProfilerActivity.CUDA])
    prof = profile(activities=activities)
    try:
        for i in range(args.warmup + 1 + args.steps):  # one settling step first (see steady_steps)
            if i == args.warmup:
                common.synchronize()
                prof.start()
            with record_function("step"):
                with record_function("pipeline"):
                    indices, offsets, dense, labels = next(source)
                with record_function("forward"):
                    loss = loss_fn(model(indices, offsets, dense), labels)
                with record_function("backward"):
                    dense_optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                with record_function("optimizer"):
                    dense_optimizer.step()
        common.synchronize()
        prof.stop()
    finally:
        if pipelined:
            source.close()
    return trace_events(prof, trace_path)


def summarize(events: list[dict], steps: int, top: int, host: bool = True) -> list[str]:
    """The per-stream and per-phase table of one run, as printed lines (``host``: with the host's time in
    each phase, from the trace's marks)."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    lines = []
    if host:
        host_ms = defaultdict(float)
        for e in events:
            if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e["name"] in PHASES + ("step",):
                host_ms[e["name"]] += e["dur"] / 1e3
        lines.append("   host ms / step: " + ", ".join(f"{name} {host_ms[name] / steps:.2f}"
                                                       for name in ("step",) + PHASES))
    if not gpu:
        lines.append("   (no GPU events: simulation mode)")
        return lines
    by_stream: dict[int, list[dict]] = defaultdict(list)
    for e in gpu:
        by_stream[e["args"].get("stream", -1)].append(e)
    window = (min(e["ts"] for e in gpu), max(e["ts"] + e["dur"] for e in gpu))
    span = (window[1] - window[0]) / 1e3
    intervals = {s: [(e["ts"], e["ts"] + e["dur"]) for e in es] for s, es in by_stream.items()}
    ranked = sorted(by_stream, key=lambda s: -union_ms(intervals[s]))
    lines.append(f"   GPU span of the {steps} steps: {span:.2f} ms = {span / steps:.2f} ms / step")
    for s in ranked:
        busy = union_ms(intervals[s])
        lines.append(f"   stream {s}: busy {busy / steps:.3f} ms / step ({busy / span:.0%} of the span), "
                     f"idle {(span - busy) / steps:.3f} ms / step, {len(by_stream[s]) / steps:.0f} kernels / step")
        totals = defaultdict(lambda: [0.0, 0])
        for e in by_stream[s]:
            totals[e["name"][:70]][0] += e["dur"] / 1e3
            totals[e["name"][:70]][1] += 1
        for name, (ms, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"      {ms / steps:8.3f} ms  x{count / steps:5.1f}  {name}")
    if len(ranked) >= 2:
        both = union_ms(intersect(intervals[ranked[0]], intervals[ranked[1]]))
        lines.append(f"   streams {ranked[0]} and {ranked[1]} both busy: {both / steps:.3f} ms / step")
    return lines


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        common.check_table_args(args, GPU_DEFAULTS, SIMULATION_DEFAULTS)
        check_dlrm_args(args)
    except ValueError as error:
        parser.error(str(error))
    args.batches = args.steps
    device = default_device()
    print(describe_mode(), flush=True)
    if not SIMULATION:
        torch.backends.cuda.matmul.allow_tf32 = args.dense_precision == "tf32"
    table_rows = common.table_rows_of(args)
    alpha = args.alpha[0]
    batches = make_batches(table_rows, alpha, args, device)
    print(f"{common.describe_tables(args)}; batch {args.batch_size}; cache {args.cache_fraction:g}; zipf {alpha:g}; "
          f"depth {args.depth}; lookahead {args.lookahead}; {args.warmup} warm-up + {args.steps} traced steps",
          flush=True)
    for name in args.runs:
        cached, policy, pipelined = RUNS[name]
        placement = Placement(args.placement) if cached else Placement.DEVICE
        cache = CacheConfig(fraction=args.cache_fraction, policy=policy,
                            associativity=args.associativity) if cached else None
        emb = build_module(table_rows, args.dim, placement, cache, args, mover=args.mover if cached else None)
        model = SmallDLRM(emb, len(table_rows), args.dim, args.bottom_mlp, args.top_mlp).to(device)
        trace_path = args.trace_dir / f"trace_{name}.json" if args.trace_dir else None
        events = train_and_trace(model, batches, args, pipelined, trace_path)
        print(f"== {name}" + (f" ({placement.value}, {args.mover} mover)" if cached else ""))
        for line in summarize(steady_steps(events), args.steps, args.top):
            print(line, flush=True)
        del model, emb
        common.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
