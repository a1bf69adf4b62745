"""Where a pipelined training step's time goes, on the GPU timeline: what each stream is busy
with, how much the prefetch stream overlaps the training stream, and how long the training
stream sits idle.

The model and batches of ``bench_pipeline.py`` (same flags). For each run (``--runs``: all-HBM,
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

    python benchmarks/trace_pipeline.py --alpha 1.05 --steps 5 --trace-dir $OUT
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from tiered_tbe.base.mode import SIMULATION, default_device, describe_mode  # first: picks GPU / simulation mode
from tiered_tbe.benchmarks import bench_pipeline, common
from tiered_tbe.benchmarks.bench_cache import build_module, free
from tiered_tbe.pipeline import PrefetchPipeline
from tiered_tbe.specs import CacheConfig, Placement

RUNS = {  # name: (cached, policy, pipelined); cached runs take --placement and --mover (their first)
    "hbm": (False, None, False),
    "lru-serial": (True, "lru", False),
    "lru-pipelined": (True, "lru", True),
    "lfu-pipelined": (True, "lfu", True),
    "lookahead-pipelined": (True, "lookahead", True),
}
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
PHASES = ("pipeline", "forward", "backward", "optimizer")


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


def trace_events(prof, trace_path: Path | None) -> list[dict]:
    """The chrome-trace events of a stopped profiler; written gzipped to ``trace_path`` if given."""
    path = trace_path or Path(f"/tmp/trace_{id(prof)}.json")
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    if trace_path is not None:
        with gzip.open(f"{path}.gz", "wt") as gz:
            json.dump({"traceEvents": events}, gz)
    path.unlink()
    return events


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """Total length (ms) of the union of ``(start_us, end_us)`` intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total / 1e3


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intervals where both ``a`` and ``b`` (each made disjoint first) are busy."""
    def merged(xs):
        out = []
        for start, stop in sorted(xs):
            if out and start <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], stop))
            else:
                out.append((start, stop))
        return out
    a, b = merged(a), merged(b)
    i = j = 0
    both = []
    while i < len(a) and j < len(b):
        start, stop = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < stop:
            both.append((start, stop))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return both


def launch_times(events: list[dict]) -> dict[int, float]:
    """Host timestamp (us) of each CUDA launch or copy call, by its correlation id (which its GPU
    event carries too)."""
    return {e["args"]["correlation"]: e["ts"] for e in events
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}


def steady_steps(events: list[dict]) -> list[dict]:
    """``events`` less the first traced step's: its host annotations and the GPU work launched
    before the second ``step`` annotation began (matched to its launch by correlation id).

    The trace starts after a synchronize, so in its first step the GPU waits for the host to
    queue work again; that start-up gap (9 ms on the H200) is no idle time of training.
    Traces without two steps or without correlation ids come back whole."""
    starts = sorted(e["ts"] for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                    and e["name"] == "step")
    if len(starts) < 2:
        return events
    cutoff = starts[1]
    launched = launch_times(events)
    if not launched:
        return events
    kept = []
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") in GPU_CATEGORIES:
            if launched.get(e["args"].get("correlation"), cutoff) < cutoff:
                continue
        elif e.get("ts", cutoff) < cutoff:
            continue
        kept.append(e)
    return kept


def summarize(events: list[dict], steps: int, top: int) -> list[str]:
    """The per-stream and per-phase table of one run, as printed lines."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    lines = []
    host = defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e["name"] in PHASES + ("step",):
            host[e["name"]] += e["dur"] / 1e3
    lines.append("   host ms / step: " + ", ".join(f"{name} {host[name] / steps:.2f}" for name in ("step",) + PHASES))
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
    parser = bench_pipeline.build_parser(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--runs", nargs="+", default=["hbm", "lru-serial", "lru-pipelined", "lookahead-pipelined"],
                        choices=list(RUNS), help="what to trace (default: hbm lru-serial lru-pipelined "
                                                 "lookahead-pipelined)")
    parser.add_argument("--steps", type=int, default=5, help="steps recorded per run (default 5)")
    parser.add_argument("--top", type=int, default=8, help="kernels listed per stream (default 8)")
    parser.add_argument("--trace-dir", type=Path, help="write each run's chrome trace here (gzipped)")
    args = bench_pipeline.check_args(parser.parse_args(argv))
    args.batches = args.steps
    device = default_device()
    print(describe_mode(), flush=True)
    if not SIMULATION:
        torch.backends.cuda.matmul.allow_tf32 = args.dense_precision == "tf32"
    table_rows = common.table_rows_of(args)
    alpha = args.alpha[0]
    batches = bench_pipeline.make_batches(table_rows, alpha, args, device)
    print(f"{common.describe_tables(args)}; batch {args.batch_size}; cache {args.cache_fraction:g}; zipf {alpha:g}; "
          f"depth {args.depth}; lookahead {args.lookahead}; {args.warmup} warm-up + {args.steps} traced steps",
          flush=True)
    for name in args.runs:
        cached, policy, pipelined = RUNS[name]
        placement = Placement(args.placement[0]) if cached else Placement.DEVICE
        cache = CacheConfig(fraction=args.cache_fraction, policy=policy,
                            associativity=args.associativity) if cached else None
        emb = build_module(table_rows, args.dim, placement, cache, args, mover=args.mover[0] if cached else None)
        model = bench_pipeline.SmallDLRM(emb, len(table_rows), args.dim, args.bottom_mlp, args.top_mlp).to(device)
        trace_path = args.trace_dir / f"trace_{name}.json" if args.trace_dir else None
        events = train_and_trace(model, batches, args, pipelined, trace_path)
        print(f"== {name}" + (f" ({placement.value}, {args.mover[0]} mover)" if cached else ""))
        for line in summarize(steady_steps(events), args.steps, args.top):
            print(line, flush=True)
        del model, emb
        free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
