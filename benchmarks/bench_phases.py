"""Device time of each phase of our HBM training step, free of the host: CUDA-graph replays.

The step's phases (``pooled_forward``; ``sort_lookups``, the backward's grouping of the lookups by
row; ``backward_update`` given that grouping, the update kernels) are each captured once as a
CUDA graph on one batch of a ``bench_fbgemm`` configuration, then replayed: a replay costs the
host one call, so the times are the GPU's alone, however slow the host. ``bench_fbgemm``'s step
times include the host when it falls behind (on the lent H200 its enqueue time varied 0.43-0.81
ms for one backward between calls of one day: benchmarks/RESULTS.md, 2026-12-02).

Printed per configuration (medians of ``--reps`` replays, CUDA events), ms:

- ``forward``, ``sort``, ``update``: each phase alone;
- ``serial``: the three in order on one stream (the step, as the GPU runs it);
- ``overlapped``: the sort on a side stream beside the forward, the update after both (would
  sorting ahead of the backward hide the sort? On the H200 it did not: the forward fills the GPU).

GPU only (CUDA graphs); in CPU simulation it says so and exits 0.

    python benchmarks/bench_phases.py --configs big-zipf-sgd criteo-adagrad
    TIERED_TBE_BACKWARD=2,1,2,32 python benchmarks/bench_phases.py   # a backward tile shape
"""

from __future__ import annotations

import argparse
import sys

import torch

from tiered_tbe.base.mode import SIMULATION, default_device, describe_mode  # first: picks GPU / simulation mode
from tiered_tbe.benchmarks import bench_fbgemm, common
from tiered_tbe.benchmarks.bench_cache import free
from tiered_tbe.benchmarks.fbgemm_configs import CONFIGS, Config
from tiered_tbe.kernels.backward import backward_update, sort_lookups
from tiered_tbe.kernels.forward import pooled_forward
from tiered_tbe.kernels.rows import Lookups

HBM_CONFIGS = [c.name for c in CONFIGS if not c.cached]
DEFAULT_CONFIGS = ["big-zipf-sgd", "big-uniform-sgd", "criteo-sgd", "criteo-adagrad"]


def capture(fn, device: torch.device):
    """``(graph, outputs)``: ``fn`` run three times eagerly (every kernel compiled and tuned), then
    captured on a side stream (a graph cannot be captured on the default stream)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        graph.capture_begin()
        outputs = fn()
        graph.capture_end()
    torch.cuda.synchronize(device)
    return graph, outputs


def measure(config: Config, args) -> dict[str, float]:
    device = default_device()
    emb = bench_fbgemm.ours_module(config, args)
    sampler = common.ZipfBatches(config.tables, config.alpha, config.batch_size, config.bag_size, device,
                                 seed=args.seed)
    indices, offsets = sampler.batches(1)[0]
    grad = torch.randn(config.batch_size, config.dim * len(config.tables), device=device)
    lookups = Lookups(indices, offsets, config.batch_size)
    stores = emb.row_stores
    forward_graph, _ = capture(lambda: pooled_forward(stores, lookups, None, "sum"), device)
    sort_graph, grouped = capture(lambda: sort_lookups(stores, lookups, need_order=False), device)
    update_graph, _ = capture(lambda: backward_update(grad, stores, lookups, None, "sum", emb.optimizer, 1,
                                                      sorted_lookups=grouped), device)
    main = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    inputs_ready, sorted_ready = torch.cuda.Event(), torch.cuda.Event()

    def serial():
        forward_graph.replay()
        sort_graph.replay()
        update_graph.replay()

    def overlapped():
        inputs_ready.record(main)
        side.wait_event(inputs_ready)
        with torch.cuda.stream(side):
            sort_graph.replay()
        sorted_ready.record(side)
        forward_graph.replay()
        main.wait_event(sorted_ready)
        update_graph.replay()

    return {name: common.event_ms(fn, args.reps, warmup=5) for name, fn in (
        ("forward", forward_graph.replay), ("sort", sort_graph.replay), ("update", update_graph.replay),
        ("serial", serial), ("overlapped", overlapped))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/bench_phases.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=HBM_CONFIGS, metavar="NAME",
                        help=f"bench_fbgemm's HBM configurations (default: {' '.join(DEFAULT_CONFIGS)})")
    parser.add_argument("--reps", type=int, default=50, help="replays timed per phase (default 50)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the lookups")
    args = parser.parse_args(argv)
    print(f"bench_phases: {describe_mode()}")
    if SIMULATION:
        print("CUDA graphs need a GPU: nothing measured in CPU simulation")
        return 0
    args.mover, args.state_layout = None, None  # bench_fbgemm.ours_module's other flags: the defaults
    print("configuration | forward | sort | update | serial | overlapped (ms, CUDA-graph replays)")
    for name in args.configs:
        config = next(c for c in CONFIGS if c.name == name)
        times = measure(config, args)
        print(f"{name} | " + " | ".join(f"{times[key]:.3f}" for key in
                                         ("forward", "sort", "update", "serial", "overlapped")), flush=True)
        free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
