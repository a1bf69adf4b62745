"""Where a training step's time goes: host time to enqueue each phase against its GPU time, and
the top operators of ``torch.profiler`` (host and device), for the model of ``tiered-tbe bench cache``.

A phase whose host time exceeds its GPU time is launch-bound (Python, argument conversion,
kernel launches): the GPU waits for the host, and faster kernels would not help.

    python tools/profile_step.py                 # 26 Criteo tables, HOST_CACHED and all-HBM
    python tools/profile_step.py --alpha 1.05 --steps 3
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from tiered_tbe.base.mode import SIMULATION, default_device, describe_mode  # first: picks GPU / simulation mode
from tiered_tbe.benchmarks import common, sampling
from tiered_tbe.benchmarks.models import build_module
from tiered_tbe.cache.mover import MOVERS
from tiered_tbe.cache.policy import POLICIES
from tiered_tbe.specs import CacheConfig, Placement

GPU_DEFAULTS = dict(tables=26, row_cap=0, dim=128, batch_size=65536, bag_size=1, warmup=20)
SIMULATION_DEFAULTS = dict(tables=3, row_cap=1000, dim=16, batch_size=8, bag_size=1, warmup=2)


def host_and_device_ms(emb, batches, grad) -> dict[str, tuple[float, float]]:
    """Median (host ms to enqueue, device ms between events) of prefetch, forward and backward,
    each phase started on an idle GPU (a sync before it), so the two compare."""
    host: dict[str, list[float]] = {}
    device: dict[str, list[float]] = {}
    for indices, offsets in batches:
        out = None
        for name in ("prefetch", "forward", "backward"):
            common.synchronize()
            start = common.StepTimer()
            start.start()
            begin = time.perf_counter()
            if name == "prefetch":
                emb.prefetch(indices, offsets)
            elif name == "forward":
                out = emb(indices, offsets)
            else:
                out.backward(grad)
            host.setdefault(name, []).append((time.perf_counter() - begin) * 1e3)
            start.mark(name)
            device.setdefault(name, []).append(start.phases()[name][0])
        del out
    return {name: (common.median(host[name]), common.median(device[name])) for name in host}


def launch_overhead(cache, device, repeats: int = 200) -> None:
    """Host microseconds of the pieces under every cache call: a small torch op, a Numba launch
    (through the cache's launcher, and bare), converting a tensor for Numba (fresh and cached)."""
    from tiered_tbe.cache import _kernels, launch

    rows = torch.arange(8, device=device)
    no_slots = torch.full((8,), -1, dtype=torch.int32, device=device)
    pieces = [("torch op (rows + 1)", lambda: rows + 1),
              ("SlotCache.lookup of 8 rows", lambda: cache.lookup(rows)),
              ("a launch of a 2-argument kernel", lambda: cache._launcher.launch(_kernels.mark_dirty_kernel, 8,
                                                                                  no_slots, cache._k_metadata.dirty))]
    if not SIMULATION:
        from numba import cuda

        k_no_slots = cuda.as_cuda_array(no_slots)
        stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
        pieces += [("bare numba launch, 2 arguments", lambda: _kernels.mark_dirty_kernel[1, 32, stream](
                        k_no_slots, cache._k_metadata.dirty)),
                   ("numba.cuda.as_cuda_array", lambda: cuda.as_cuda_array(rows)),
                   ("cached device array", lambda: launch.device_array(rows))]
    for name, fn in pieces:
        fn()
        common.synchronize()
        begin = time.perf_counter()
        for _ in range(repeats):
            fn()
        print(f"   host time of one {name}: {(time.perf_counter() - begin) / repeats * 1e6:.1f} us")
        common.synchronize()


def train_steps(emb, batches, grad) -> None:
    """A prefetch, a forward and a backward per batch (without a cache the prefetch only prepares
    the batch ahead of its forward)."""
    for indices, offsets in batches:
        emb.prefetch(indices, offsets)
        out = emb(indices, offsets)
        out.backward(grad)
        del out


def profile(emb, batches, grad, top: int) -> None:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if not SIMULATION:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        train_steps(emb, batches, grad)
        common.synchronize()
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))
    if not SIMULATION:
        print(averages.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=60))


def python_profile(emb, batches, grad, top: int) -> None:
    """cProfile of the host side of whole steps: the Python functions (and launches) a step's time
    on the host goes to, by own time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    train_steps(emb, batches, grad)
    profiler.disable()
    common.synchronize()
    print(f"   host functions over {len(batches)} steps, by own time (ms per step = tottime / steps * 1000):")
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(top)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/profile_step.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_table_flags(parser, GPU_DEFAULTS, SIMULATION_DEFAULTS)
    common.add_cache_flags(parser, list(POLICIES))
    parser.add_argument("--mover", choices=MOVERS, help="the cache's row mover (default: the placement's)")
    parser.add_argument("--warmup", type=int, help="steps before profiling (default 20; 2 in simulation)")
    parser.add_argument("--bounds-check", default="off", choices=["off", "raise"], help="the module's bounds_check")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the lookups")
    parser.add_argument("--steps", type=int, default=3, help="steps profiled per model")
    parser.add_argument("--top", type=int, default=25, help="operators listed per table")
    parser.add_argument("--skip-hbm", action="store_true", help="profile only the cached model")
    parser.add_argument("--skip-cached", action="store_true", help="profile only the all-HBM model")
    parser.add_argument("--python", action="store_true", help="also cProfile the host side of the steps")
    args = parser.parse_args(argv)
    try:
        common.check_table_args(args, GPU_DEFAULTS, SIMULATION_DEFAULTS)
    except ValueError as error:
        parser.error(str(error))
    device = default_device()
    print(describe_mode(), flush=True)
    table_rows = common.table_rows_of(args)
    alpha = args.alpha[0]
    batches = sampling.ZipfBatches(table_rows, alpha, args.batch_size, args.bag_size, device,
                                 seed=args.seed).batches(args.warmup + 2 * args.steps)
    grad = torch.randn(args.batch_size, len(table_rows) * args.dim, device=device)
    models = [] if args.skip_cached else [
        ("host_cached", Placement.HOST_CACHED,
         CacheConfig(fraction=args.cache_fraction, policy=args.policy, associativity=args.associativity))]
    if not args.skip_hbm:
        models.append(("all HBM", Placement.DEVICE, None))
    for label, placement, cache in models:
        emb = build_module(table_rows, args.dim, placement, cache, args, mover=args.mover if cache else None)
        for indices, offsets in batches[:args.warmup]:  # a steady-state cache
            emb(indices, offsets).backward(grad)
        timed = host_and_device_ms(emb, batches[args.warmup:args.warmup + args.steps], grad)
        print(f"== {label}, zipf {alpha:g}: phase: host ms to enqueue / device ms (each from an idle GPU)")
        for name, (host, dev) in timed.items():
            print(f"   {name:<9} {host:8.3f} / {dev:8.3f}{'   <- launch-bound' if host > dev else ''}")
        if emb.cache is not None:
            launch_overhead(emb.cache, device)
        profile(emb, batches[args.warmup + args.steps:], grad, args.top)
        if args.python:
            python_profile(emb, batches[args.warmup:], grad, args.top)
        del emb
        common.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
