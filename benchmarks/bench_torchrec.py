"""``tiered-tbe bench torchrec``: one DistributedModelParallel training step with our sharder against
TorchRec's own kernels (FBGEMM's TBE) under the same plan.

The model is a TorchRec ``EmbeddingBagCollection`` (the 26 Criteo Kaggle tables x 128 fp32 by
default) and a linear click head; a step is one batch of ``--batch-size`` samples (a
``KeyedJaggedTensor`` of one Zipf lookup per feature, with dense-free labels) handed on the host,
as a data loader hands them (pinned), through TorchRec's train pipeline: input copy, input
distribution, forward, loss, backward (the fused update), the dense optimizer. Both sides get the
same plan (every table table-wise on the ranks), the same ``fused_params`` and the same batches.

Configurations (``--configs``):

- ``fused``: every table in HBM, ``TrainPipelineSparseDist``;
- ``cached``: ``fused_uvm_caching`` at ``--cache-load-factor`` (FBGEMM's UVM cache / our slot cache
  over managed memory), ``TrainPipelineSparseDist``;
- ``cached-prefetch``: the same under ``PrefetchTrainPipelineSparseDist``, each batch's cache
  prefetch on TorchRec's prefetch stream a step ahead (CUDA only).

Prints each side's median step time and samples per second of all ranks (CUDA events on the training
stream at each step's start: nothing waits for the device between steps; both sides built at once and
timed in eight turns each, alternating) and ours / TorchRec. ``--profile`` adds, per side, the
embedding lookups' GPU time (forward, fused backward, prefetch) and where the rest of the step's
GPU time goes, by TorchRec's pipeline stages, NCCL's collectives' share of the step (with several ranks:
the all-to-alls), and the host time of the adapter around our module.
``--record PATH`` appends the results, one JSON line per configuration. One process by default (a process group of
one); under ``torchrun`` every rank runs its share of the tables. In CPU simulation it runs at a tiny
size, to check that it works (the times mean nothing).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics

import torch
import torch.distributed as dist
from torch import nn

from tiered_tbe import records
from tiered_tbe.base.mode import SIMULATION, describe_mode
from tiered_tbe.benchmarks import torchrec_profile
from tiered_tbe.traces import CRITEO_KAGGLE_TABLE_ROWS

CONFIGS = {  # name: (compute kernel, pipeline)
    "fused": ("fused", "sparse-dist"),
    "cached": ("fused_uvm_caching", "sparse-dist"),
    "cached-prefetch": ("fused_uvm_caching", "prefetch"),
}
SIDES = ("torchrec", "ours")
# GPU: the shape; simulation: a few small tables.
_SIZES = dict(tables=(26, 4), max_rows=(None, 300), dim=(128, 8), batch_size=(65536, 16), steps=(120, 3),
              warmup=(20, 1))
PROFILED_STEPS = 5
# Timed turns per side, taken in alternation. A DMP step is host time, and the host's speed wanders: with 4 turns
# of 10 steps the same code's ratios moved by up to 0.1 from run to run (docs/TORCHREC.md).
ROUNDS = 8


def _default(name: str):
    gpu, simulation = _SIZES[name]
    return simulation if SIMULATION else gpu


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="tiered-tbe bench torchrec")
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=None,
                        help="configurations to run (default: all; in CPU simulation those without CUDA streams)")
    parser.add_argument("--tables", type=int, default=_default("tables"),
                        help="the first N Criteo Kaggle tables (26 on a GPU, 4 in simulation)")
    parser.add_argument("--max-rows", type=int, default=_default("max_rows"),
                        help="cap every table's rows (none on a GPU, 300 in simulation)")
    parser.add_argument("--rows-scale", type=int, default=1,
                        help="multiply every table's rows by N (default 1; 4: the 26 Criteo tables x 128 are ~69 GB, "
                             "tables larger than a GPU's share of HBM, for fused_uvm_caching)")
    parser.add_argument("--dim", type=int, default=_default("dim"), help="embedding dim (128; 8 in simulation)")
    parser.add_argument("--batch-size", type=int, default=_default("batch_size"),
                        help="samples per step and rank (65536; 16 in simulation)")
    parser.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the lookups (default 1.05)")
    parser.add_argument("--cache-load-factor", type=float, default=0.05,
                        help="cache size of the cached configurations, a fraction of the rows (default 0.05)")
    parser.add_argument("--steps", type=int, default=_default("steps"), help="timed steps per side (120; 3 in sim.)")
    parser.add_argument("--warmup", type=int, default=_default("warmup"), help="untimed steps first (20; 1 in sim.)")
    parser.add_argument("--vbe", action="store_true",
                        help="variable batch size per feature (TorchRec's VBE): feature f looks up B / 2^(f mod 4) "
                             "distinct samples, expanded to B by the output (default: every feature B)")
    parser.add_argument("--bounds-check", choices=("none", "default"), default="none",
                        help="none: both sides skip the index checks (FBGEMM's BoundsCheckMode.NONE); default: "
                             "each side's default (FBGEMM's WARNING: each side repairs a bad batch on the device, "
                             "no host sync)")
    parser.add_argument("--profile", action="store_true",
                        help=f"profile {PROFILED_STEPS} more steps per side: embedding GPU time, the rest by stage")
    parser.add_argument("--trace", metavar="DIR",
                        help="with --profile: also write each side's profiled steps as a Chrome trace, "
                             "DIR/<config>-<side>.json (chrome://tracing, Perfetto)")
    parser.add_argument("--record", metavar="PATH", help="append the results to PATH, one JSON line per configuration")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def check_args(args: argparse.Namespace) -> argparse.Namespace:
    for name in ("tables", "rows_scale", "dim", "batch_size", "steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 1 <= args.tables <= len(CRITEO_KAGGLE_TABLE_ROWS):
        raise ValueError(f"--tables must be between 1 and {len(CRITEO_KAGGLE_TABLE_ROWS)}, got {args.tables}")
    if args.warmup < 0 or not 0 < args.cache_load_factor <= 1:
        raise ValueError("--warmup must be >= 0 and --cache-load-factor in (0, 1]")
    if args.trace:
        if not args.profile:
            raise ValueError("--trace writes the profiled steps: give --profile too")
        os.makedirs(args.trace, exist_ok=True)
    if args.configs is None:
        args.configs = [name for name, (_, pipeline) in CONFIGS.items() if pipeline != "prefetch" or not SIMULATION]
    if SIMULATION and any(CONFIGS[name][1] == "prefetch" for name in args.configs):
        raise ValueError("cached-prefetch needs CUDA streams (PrefetchTrainPipelineSparseDist): a GPU")
    return args


# ------------------------------------------------------------------ model, plan, batches
class ClickHead(nn.Module):
    """The collection's pooled embeddings -> a linear click logit; ``forward(batch) -> (loss, logits)``."""

    def __init__(self, collection: nn.Module, total_dim: int):
        super().__init__()
        self.embeddings = collection
        self.head = nn.Linear(total_dim, 1)

    def forward(self, batch):
        logits = self.head(self.embeddings(batch.sparse_features).values()).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels), logits.detach()


def table_rows(args) -> list[int]:
    rows = [n * args.rows_scale for n in CRITEO_KAGGLE_TABLE_ROWS[: args.tables]]
    return [min(n, args.max_rows) for n in rows] if args.max_rows else rows


def fused_params(args, kernel: str, pipeline: str) -> dict:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode

    params = dict(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.01, eps=1e-8)
    if args.bounds_check == "none":
        params["bounds_check_mode"] = BoundsCheckMode.NONE
    if kernel == "fused_uvm_caching":
        params["prefetch_pipeline"] = pipeline == "prefetch"  # FBGEMM needs it to prefetch a step ahead
    return params


def build_model(args, side: str, kernel: str, pipeline: str, device: torch.device, world_size: int):
    """The DMP model and its combined optimizer for ``side`` (``"torchrec"`` or ``"ours"``)."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import CacheParams, ShardingPlan
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from tiered_tbe.torchrec import TieredEmbeddingBagCollectionSharder

    params = fused_params(args, kernel, pipeline)
    sharder = (TieredEmbeddingBagCollectionSharder if side == "ours" else EmbeddingBagCollectionSharder)(
        fused_params=params)
    configs = [EmbeddingBagConfig(name=f"t{t}", embedding_dim=args.dim, num_embeddings=rows, feature_names=[f"f{t}"])
               for t, rows in enumerate(table_rows(args))]
    collection = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    plan = construct_module_sharding_plan(
        collection, {f"t{t}": table_wise(rank=t % world_size, compute_kernel=kernel) for t in range(args.tables)},
        world_size=world_size, device_type=device.type, sharder=TieredEmbeddingBagCollectionSharder())
    if kernel == "fused_uvm_caching":
        for parameter_sharding in plan.values():
            parameter_sharding.cache_params = CacheParams(load_factor=args.cache_load_factor,
                                                          prefetch_pipeline=pipeline == "prefetch")
    torch.manual_seed(args.seed)
    model = DistributedModelParallel(ClickHead(collection, args.tables * args.dim), device=device,
                                     plan=ShardingPlan({"embeddings": plan}), sharders=[sharder])
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                  lambda p: torch.optim.SGD(p, lr=0.01))
    return model, CombinedOptimizer([model.fused_optimizer, dense])


def host_batches(args, count: int, rank: int, device: torch.device) -> list:
    """``count`` batches on the host (pinned on a GPU machine), one Zipf lookup per feature."""
    import numpy as np
    from torchrec import KeyedJaggedTensor

    from tiered_tbe.torchrec.batch import SparseBatch
    from tiered_tbe.zipf import DeviceZipfSampler, ZipfSampler

    rows = table_rows(args)
    streams = np.random.SeedSequence(args.seed).spawn(len(rows))
    samplers = [ZipfSampler(n, args.alpha, np.random.default_rng(s)) for n, s in zip(rows, streams)]
    draw_on = device if device.type == "cuda" else torch.device("cpu")
    sampler = DeviceZipfSampler(samplers, draw_on, torch.Generator(device=draw_on).manual_seed(args.seed + rank))
    keys = [f"f{t}" for t in range(len(rows))]
    sizes = [max(1, args.batch_size >> (t % 4)) if args.vbe else args.batch_size for t in range(len(rows))]
    lengths = torch.ones(sum(sizes), dtype=torch.int32)
    # VBE: sample b of feature t is its distinct sample b % sizes[t] (TorchRec's inverse indices).
    inverse = torch.stack([torch.arange(args.batch_size) % size for size in sizes])
    batches = []
    for _ in range(count):
        drawn = sampler.sample(args.batch_size).cpu().view(len(rows), args.batch_size)
        values = torch.cat([drawn[t, :size] for t, size in enumerate(sizes)])
        labels = (torch.rand(args.batch_size) < 0.5).float()
        if args.vbe:
            features = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, inverse_indices=(keys, inverse),
                                         stride_per_key_per_rank=[[size] for size in sizes])
        else:
            features = KeyedJaggedTensor.from_lengths_sync(keys, values, lengths)
        batch = SparseBatch(dense_features=torch.zeros(args.batch_size, 0), labels=labels, sparse_features=features)
        batches.append(batch.pin_memory() if device.type == "cuda" else batch)
    return batches


# ------------------------------------------------------------------ run
def run(args: argparse.Namespace) -> dict:
    from tiered_tbe.torchrec import require_torchrec

    require_torchrec()
    from torchrec.distributed.train_pipeline import PrefetchTrainPipelineSparseDist, TrainPipelineSparseDist

    from tiered_tbe.torchrec.train import join_process_group

    check_args(args)

    made, device = join_process_group()
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        count = args.warmup + args.steps + (2 * PROFILED_STEPS if args.profile else 0)
        batches = host_batches(args, count, rank, device)
        results = {}
        for name in args.configs:
            kernel, pipeline_kind = CONFIGS[name]
            kind = PrefetchTrainPipelineSparseDist if pipeline_kind == "prefetch" else TrainPipelineSparseDist
            # Both sides built at once, timed in turns (ROUNDS rounds, the side first in a round alternating),
            # so that a host whose speed wanders (a DMP step is mostly host time) weighs on both alike.
            runs = {}
            for side in SIDES:
                model, optimizer = build_model(args, side, kernel, pipeline_kind, device, world_size)
                runs[side] = (model, kind(model, optimizer, device), iter(batches))
                torchrec_profile.timed_steps(runs[side][1], runs[side][2], args.warmup)
            times = {side: [] for side in SIDES}
            for turn in range(ROUNDS):
                steps = args.steps // ROUNDS + (turn < args.steps % ROUNDS)
                for side in (SIDES if turn % 2 == 0 else SIDES[::-1]):
                    times[side] += torchrec_profile.timed_steps(runs[side][1], runs[side][2], steps)
            results[name] = {side: dict(step_ms=statistics.median(times[side])) for side in SIDES}
            for side in SIDES:  # every rank's samples: weak scaling keeps B per rank
                step_s = results[name][side]["step_ms"] / 1e3
                results[name][side]["samples_per_s"] = world_size * args.batch_size / step_s
            if args.profile:
                for side, (model, pipeline, stream) in runs.items():
                    results[name][side]["adapter_host_ms"] = torchrec_profile.adapter_host_ms(
                        pipeline, model, stream, PROFILED_STEPS)
                    trace = f"{args.trace}/{name}-{side}.json" if args.trace else None
                    results[name][side]["profile"] = torchrec_profile.profile_steps(
                        pipeline, model, stream, PROFILED_STEPS, trace)
            del runs
            gc.collect()  # the sides' tables go before the next configuration's are allocated
            if not SIMULATION:
                torch.cuda.empty_cache()
            results[name]["ratio"] = results[name]["ours"]["step_ms"] / results[name]["torchrec"]["step_ms"]
        if rank == 0:
            _print(args, results, world_size)
            if args.record:
                command = getattr(args, "command_line", "tiered-tbe bench torchrec")
                configuration = dict(world_size=world_size, tables=len(table_rows(args)), rows=sum(table_rows(args)),
                                     rows_scale=args.rows_scale, dim=args.dim,
                                     batch_size=args.batch_size, alpha=args.alpha, vbe=bool(args.vbe),
                                     cache_load_factor=args.cache_load_factor, steps=args.steps,
                                     warmup=args.warmup, turns=ROUNDS)
                records.append(args.record, [records.measurement("torchrec", command, dict(configuration, name=name),
                                                                 result) for name, result in results.items()])
        return results
    finally:
        if made:
            dist.destroy_process_group()


def _print(args, results: dict, world_size: int) -> None:
    rows = table_rows(args)
    print(f"bench torchrec: {describe_mode()}; {world_size} rank(s); {len(rows)} Criteo tables x {args.dim} fp32 "
          f"({sum(rows):,} rows), B={args.batch_size} per rank{' (VBE)' if args.vbe else ''}, one lookup per "
          f"feature, Zipf {args.alpha:g}, "
          f"row-wise Adagrad, a linear head; cache load factor {args.cache_load_factor:g}; median of {args.steps} "
          f"steps after {args.warmup}")
    print(f"{'config':<18}{'TorchRec ms':>13}{'ours ms':>10}{'ours/TorchRec':>15}"
          f"{'TorchRec samples/s':>20}{'ours samples/s':>16}")
    for name, result in results.items():
        print(f"{name:<18}{result['torchrec']['step_ms']:>13.3f}{result['ours']['step_ms']:>10.3f}"
              f"{result['ratio']:>15.3f}{result['torchrec']['samples_per_s']:>20,.0f}"
              f"{result['ours']['samples_per_s']:>16,.0f}")
    for name, result in results.items():
        if "profile" not in result["ours"]:
            continue
        print(f"\n{name}: GPU ms per step by stage (embedding = the lookups' kernels), and the adapter's host ms")
        stages = list(dict.fromkeys([*result["torchrec"]["profile"]["gpu_ms"], *result["ours"]["profile"]["gpu_ms"]]))
        for stage in stages:
            theirs, ours = (result[side]["profile"]["gpu_ms"].get(stage, 0.0) for side in SIDES)
            print(f"  {stage:<40}{theirs:>10.3f}{ours:>10.3f}")
        for side in SIDES:
            gpu = result[side]["profile"]["gpu_ms"]
            result[side]["embedding_gpu_ms"] = sum(v for k, v in gpu.items() if k.startswith("embedding"))
        theirs, ours = result["torchrec"]["embedding_gpu_ms"], result["ours"]["embedding_gpu_ms"]
        ratio = ours / theirs if theirs else float("nan")
        print(f"  {'embedding lookups, all':<40}{theirs:>10.3f}{ours:>10.3f}   ours/TorchRec {ratio:.3f} (a CUDA "
              f"graph's kernels are not: see '{torchrec_profile.UNLINKED_STAGE}')")
        theirs, ours = (result[side]["profile"]["collective_gpu_ms"] for side in SIDES)
        print(f"  {'NCCL collectives (all-to-all, all-reduce)':<40}{theirs:>10.3f}{ours:>10.3f}   share of the step: "
              f"TorchRec {100 * theirs / result['torchrec']['step_ms']:.1f}%, "
              f"ours {100 * ours / result['ours']['step_ms']:.1f}%")
        for side in SIDES:
            host = result[side]["profile"]["host_ms"]
            around = host.get("kernel", 0.0) - host.get("module", 0.0)
            unprofiled = result[side]["adapter_host_ms"]["around"]
            print(f"  {side}: host ms of the kernel forward {host.get('kernel', 0.0):.3f}, of which around the "
                  f"TBE module {around:.3f} ({100 * around / result[side]['step_ms']:.1f}% of the step; unprofiled "
                  f"{unprofiled:.3f}, {100 * unprofiled / result[side]['step_ms']:.1f}%); "
                  f"of the embedding backward {host.get('backward', 0.0):.3f}")
        for side in SIDES:
            profile = result[side]["profile"]
            print(f"  {side}: host ms per step by pipeline stage: " + ", ".join(
                f"{stage} {ms:.3f}" for stage, ms in profile["host_stage_ms"].items()))
            print(f"  {side}: host ms per step in CUDA runtime calls: " + ", ".join(
                f"{call} {ms:.3f}" for call, ms in profile["cuda_runtime_ms"].items()))
    if SIMULATION:
        print("(simulation mode: these times are of the CPU interpreter, not of any GPU)")


def run_command(args: argparse.Namespace) -> int:
    run(args)
    return 0


def main(argv=None) -> int:
    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
