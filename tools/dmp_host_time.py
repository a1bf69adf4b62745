"""Where a DMP step's host time goes, unprofiled: ``bench torchrec``'s models (our sharder and
TorchRec's own kernels under one plan), each step's wall time, and ``time.perf_counter`` totals of
the methods on the path (ours: the kernel's forward, the module's prepare and forward, the cache's
prefetch and unlock, the graph replays and their host-to-device copies, the backward; TorchRec's:
its kernel's forward, FBGEMM's forward and prefetch; both: autograd's backward).

A DMP step on one H200 is host time (the GPU waits), so these totals are the step's parts. The
profiler (``bench torchrec --profile``) and cProfile cost each call enough to change the
comparison; these timers cost ~1 us a call. Usage, on a GPU machine (torchrec and FBGEMM installed)::

    python tools/dmp_host_time.py --configs cached cached-prefetch [--record results/measurements.jsonl]

Prints per side and turn (two turns, the sides alternating) the wall and host ms a step and each
timer's ms a step and calls a step. In CPU simulation it runs at bench torchrec's tiny size.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections import defaultdict

import torch

from tiered_tbe import records
from tiered_tbe.benchmarks import bench_torchrec, torchrec_profile

TURNS = 2


def install_timers(totals: dict, counts: dict) -> list:
    """Wrap the methods on a DMP step's path with perf_counter timers adding to ``totals`` (seconds)
    and ``counts`` by label; returns what :func:`remove_timers` puts back."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
    from torchrec.distributed.batched_embedding_kernel import BatchedFusedEmbeddingBag

    from tiered_tbe import batch, function, module
    from tiered_tbe.base import graphs
    from tiered_tbe.cache import slot_cache
    from tiered_tbe.torchrec import kernel

    originals = []

    def wrap(owner, name: str, label: str) -> None:
        attribute = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)
        originals.append((owner, name, attribute))  # None: inherited (torch.Tensor.clone), deleted again
        raw = attribute.__func__ if isinstance(attribute, staticmethod) else getattr(owner, name)

        @functools.wraps(raw)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return raw(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - start
                counts[label] += 1

        setattr(owner, name, staticmethod(timed) if isinstance(attribute, staticmethod) else timed)

    for owner, name, label in (
            (kernel.TieredBatchedFusedEmbeddingBag, "forward", "ours: kernel forward (adapter and module)"),
            (module.TieredEmbeddingBags, "_prepare", "ours: module _prepare (checks, linearize, prefetch)"),
            (module.TieredEmbeddingBags, "prefetch", "ours: module prefetch (the prefetch pipeline's)"),
            (module.TieredEmbeddingBags, "_pooled_forward", "ours: module _pooled_forward"),
            (module.TieredEmbeddingBags, "_apply_update", "ours: module _apply_update"),
            (function.TieredEmbeddingBagsFunction, "backward", "ours: autograd Function backward"),
            (slot_cache.SlotCache, "prefetch", "ours: SlotCache prefetch"),
            (slot_cache.SlotCache, "_assign_and_move", "ours: SlotCache _assign_and_move (its graph)"),
            (slot_cache.SlotCache, "unlock", "ours: SlotCache unlock"),
            (batch.PreparedBatch, "release", "ours: PreparedBatch release"),
            (graphs.StepGraphs, "run", "ours: StepGraphs run"),
            (graphs.StepGraphs, "_replay", "ours: StepGraphs _replay"),
            (graphs.PinnedRing, "copy", "ours: PinnedRing copy (host inputs)"),
            (torch.cuda.CUDAGraph, "replay", "ours: CUDAGraph replay"),
            (torch.cuda.Event, "query", "any: Event query"),
            (torch.cuda.Event, "record", "any: Event record"),
            (torch.Tensor, "clone", "any: Tensor clone"),
            (torch, "_foreach_copy_", "any: torch _foreach_copy_"),
            (BatchedFusedEmbeddingBag, "forward", "torchrec: kernel forward"),
            (SplitTableBatchedEmbeddingBagsCodegen, "forward", "torchrec: FBGEMM forward"),
            (SplitTableBatchedEmbeddingBagsCodegen, "prefetch", "torchrec: FBGEMM prefetch"),
            (torch.autograd, "backward", "both: autograd backward")):
        wrap(owner, name, label)
    return originals


def remove_timers(originals: list) -> None:
    for owner, name, attribute in reversed(originals):
        if attribute is None:
            delattr(owner, name)
        else:
            setattr(owner, name, attribute)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(args: argparse.Namespace) -> dict:
    """Both sides of each configuration, timed in turns; the timers are removed afterwards."""
    bench = bench_torchrec.check_args(bench_torchrec.build_parser().parse_args(["--configs", *args.configs]))
    totals, counts = defaultdict(float), defaultdict(int)
    originals = install_timers(totals, counts)
    try:
        return _timed_runs(args, bench, totals, counts)
    finally:
        remove_timers(originals)


def _timed_runs(args: argparse.Namespace, bench: argparse.Namespace, totals: dict, counts: dict) -> dict:
    from torchrec.distributed.train_pipeline import PrefetchTrainPipelineSparseDist, TrainPipelineSparseDist

    from tiered_tbe.torchrec.train import join_process_group

    made, device = join_process_group()
    batches = bench_torchrec.host_batches(bench, 64, 0, device)
    results = {}
    for name in args.configs:
        kernel, kind = bench_torchrec.CONFIGS[name]
        pipeline_class = PrefetchTrainPipelineSparseDist if kind == "prefetch" else TrainPipelineSparseDist
        runs = {}
        for side in bench_torchrec.SIDES:
            model, optimizer = bench_torchrec.build_model(bench, side, kernel, kind, device, 1)
            stream = iter(batches * (2 + (args.warmup + TURNS * args.steps) // len(batches)))
            runs[side] = (pipeline_class(model, optimizer, device), stream)
            torchrec_profile.timed_steps(runs[side][0], stream, args.warmup)
        results[name] = {side: [] for side in runs}
        for turn in range(TURNS):
            for side in (bench_torchrec.SIDES if turn % 2 == 0 else bench_torchrec.SIDES[::-1]):
                pipeline, stream = runs[side]
                _synchronize()
                totals.clear()
                counts.clear()
                start = time.perf_counter()
                for _ in range(args.steps):
                    pipeline.progress(stream)
                host = time.perf_counter() - start
                _synchronize()
                wall = time.perf_counter() - start
                parts = {label: dict(ms=totals[label] / args.steps * 1e3, calls=counts[label] / args.steps)
                         for label in sorted(totals)}
                results[name][side].append(dict(wall_ms=wall / args.steps * 1e3, host_ms=host / args.steps * 1e3,
                                                parts=parts))
                print(f"{name} {side} turn {turn}: wall {wall / args.steps * 1e3:.3f} ms a step, host "
                      f"{host / args.steps * 1e3:.3f}")
                for label, part in parts.items():
                    print(f"    {label:56s} {part['ms']:7.3f} ms a step ({part['calls']:.1f} calls)")
        del runs
    if args.record:
        configuration = dict(tables=len(bench_torchrec.table_rows(bench)), dim=bench.dim, batch_size=bench.batch_size,
                             alpha=bench.alpha, cache_load_factor=bench.cache_load_factor, steps=args.steps)
        records.append(args.record, [records.measurement("torchrec-host-time", "python tools/dmp_host_time.py "
                                                         + " ".join(args.argv), dict(configuration, name=name), figures)
                                     for name, figures in results.items()])
    if made:
        torch.distributed.destroy_process_group()
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", choices=list(bench_torchrec.CONFIGS), default=["cached"])
    parser.add_argument("--steps", type=int, default=40, help="timed steps a side and turn (40)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps a side first (20)")
    parser.add_argument("--record", metavar="PATH", help="append one JSON line a configuration to PATH")
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else []
    run(args)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
