"""Which calls make the CUDA caching allocator ask the driver for memory during our steps.

``tiered-tbe bench fbgemm`` counts ``cudaMalloc`` calls a step (``device_mallocs_per_step``); a step in a
steady state makes none. This trains ``--warmup`` steps of our side of a configuration (serial, or through a
``PrefetchPipeline`` for the ``*-pipelined`` ones, as the benchmark does), then records the allocator's
history (``torch.cuda.memory._record_memory_history``) over ``--steps`` more and prints each new segment
(a ``cudaMalloc``): its step, size, stream and the project's frames of the call that asked for it, most
frequent call first. GPU only.

    python tools/find_allocations.py --configs cached-managed-lru-pipelined --warmup 20 --steps 40
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

import torch

from tiered_tbe.base.mode import SIMULATION  # first: picks GPU / simulation mode
from tiered_tbe.benchmarks import common, sampling
from tiered_tbe.benchmarks.fbgemm_configs import CONFIGS
from tiered_tbe.benchmarks.fbgemm_sides import batches_of, ours_module, shape_of
from tiered_tbe.pipeline import PrefetchPipeline

PROJECT_FRAMES = ("tiered_tbe", "/cache/", "/kernels/", "/base/", "/benchmarks/")


def project_frames(frames: list[dict], depth: int) -> str:
    """The innermost ``depth`` frames of the project's files in one allocation's stack."""
    ours = [f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}" for f in frames
            if any(part in f["filename"] for part in PROJECT_FRAMES)]
    return " <- ".join(ours[:depth]) or "(no project frame)"


def steps_of(emb, config, batches, grad, count: int, sync: bool = False):
    """Yield after each of ``count`` training steps of ``emb`` (serial prefetch, or a depth-2 pipeline);
    ``sync``: the host waits for each step's GPU work (a loop that reads its loss every step)."""
    stream = sampling.cycle(batches, count)
    if config.pipelined:
        stream = PrefetchPipeline(emb, stream, depth=2)
    for i, (indices, offsets, weights) in enumerate(stream):
        if not config.pipelined:
            emb.prefetch(indices, offsets)
        out = emb(indices, offsets, per_sample_weights=weights)
        out.backward(grad[: out.shape[0]])
        del out
        if sync:
            torch.cuda.synchronize()
        yield i


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", required=True, help="bench fbgemm configuration names (cached)")
    parser.add_argument("--warmup", type=int, default=20, help="steps before the recording")
    parser.add_argument("--steps", type=int, default=40, help="steps recorded")
    parser.add_argument("--depth", type=int, default=4, help="project frames printed per allocation")
    parser.add_argument("--sync", action="store_true",
                        help="synchronize after each step: without it the host may run steps ahead of the GPU, and "
                             "each step ahead holds its batch's memory a while longer")
    args = parser.parse_args(argv)
    if SIMULATION:
        print("find_allocations: a GPU only (the CPU has no caching allocator to watch)")
        return 0
    bench_args = argparse.Namespace(mover=None, state_layout=None, in_place_copies=None, fit_cache=False,
                                    seed=0)
    for config in (shape_of(c) for c in CONFIGS if c.name in args.configs):
        batches, grad = batches_of(config, 0, args.warmup + args.steps)
        emb = ours_module(config, bench_args)
        step_of_segment: list[int] = []
        recording = False
        for i in steps_of(emb, config, batches, grad, args.warmup + args.steps, args.sync):
            if i + 1 == args.warmup:
                torch.cuda.synchronize()
                torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
                recording = True
            elif recording:
                step_of_segment.append(i)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        segments = [event for trace in snapshot["device_traces"] for event in trace
                    if event["action"] == "segment_alloc"]
        print(f"== {config.name}: {len(segments)} cudaMalloc over {args.steps} steps after {args.warmup}"
              + (", a synchronize after each step" if args.sync else ""))
        by_call = Counter(project_frames(event.get("frames", []), args.depth) for event in segments)
        sizes: dict[str, list[int]] = {}
        for event in segments:
            sizes.setdefault(project_frames(event.get("frames", []), args.depth), []).append(event["size"])
        for call, count in by_call.most_common():
            mib = sorted({round(size / 2**20, 1) for size in sizes[call]})
            print(f"  {count:4d} x  MiB {mib[:6]}  {call}")
        del emb, batches, grad
        common.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
