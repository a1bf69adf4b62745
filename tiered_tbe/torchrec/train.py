"""``tiered-tbe train --torchrec``: the DLRM of :mod:`tiered_tbe.train`, its tables in a TorchRec
``EmbeddingBagCollection`` sharded by ``DistributedModelParallel`` with our sharder, on N processes.

One process per GPU (NCCL), or per CPU worker in simulation (gloo)::

    torchrun --nproc-per-node 8 -m tiered_tbe train --torchrec --tables 26 --rows 10000000
    tiered-tbe train --torchrec                # one process: a process group of one

Each process trains its own batches (process ``r`` of ``N`` takes batch ``N * step + r`` of the
synthetic stream, ``--batch-size`` samples each); TorchRec's input distribution brings every rank the
lookups of its shards. ``--sharding`` picks the plan (TorchRec's planner by default, on a GPU),
``--placement`` the compute kernel of every table (``device``: ``fused``, ``managed``: ``fused_uvm``,
``managed_cached``: ``fused_uvm_caching`` at ``--cache-fraction``).
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from tiered_tbe.base.mode import SIMULATION, describe_mode
from tiered_tbe.specs import CacheConfig, Placement, TableSpec
from tiered_tbe.train import NUM_DENSE, SyntheticClicks

KERNEL_OF_PLACEMENT = {Placement.DEVICE: "fused", Placement.MANAGED: "fused_uvm",
                       Placement.MANAGED_CACHED: "fused_uvm_caching"}
SHARDINGS = ("auto", "table-wise", "row-wise", "column-wise", "table-row-wise")
PIPELINES = ("none", "sparse-dist", "prefetch")
# fused_params names of our optimizers' FBGEMM counterparts (tiered_tbe.fbgemm_names).
_FBGEMM_OPTIMIZER = {"sgd": "EXACT_SGD", "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD", "adagrad": "EXACT_ADAGRAD",
                     "adam": "ADAM", "partial_rowwise_adam": "PARTIAL_ROWWISE_ADAM", "lamb": "LAMB"}


def add_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("TorchRec (--torchrec)")
    group.add_argument("--torchrec", action="store_true",
                       help="train through TorchRec's DistributedModelParallel with tiered-tbe's sharder, on every "
                            "process torchrun started (one without torchrun); needs torchrec (default: "
                            "tiered-tbe's own module, one process)")
    group.add_argument("--sharding", choices=SHARDINGS, default="auto",
                       help="the plan of every table: auto = TorchRec's planner on a GPU (row-wise in CPU "
                            "simulation, where the planner cannot cost managed or cached kernels); default auto")
    group.add_argument("--torchrec-pipeline", choices=PIPELINES, default="none",
                       help="TorchRec's train pipeline: none (a plain loop), sparse-dist (TrainPipelineSparseDist), "
                            "prefetch (PrefetchTrainPipelineSparseDist: cached tables prefetched a batch ahead on "
                            "TorchRec's prefetch stream; needs CUDA); default none")


class CollectionDLRM(nn.Module):
    """The DLRM of :class:`tiered_tbe.train.TinyDLRM`, its tables in an ``EmbeddingBagCollection``:
    bottom MLP(dense) ‖ pooled embeddings -> top MLP -> click logit. ``forward(batch) -> (loss, logits)``,
    as TorchRec's train pipelines call a model."""

    def __init__(self, collection: nn.Module, total_dim: int, num_dense: int, hidden: int = 64):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(num_dense, hidden), nn.ReLU())
        self.embeddings = collection
        self.top = nn.Sequential(nn.Linear(hidden + total_dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.embeddings(batch.sparse_features).values()
        logits = self.top(torch.cat([self.bottom(batch.dense_features), pooled], dim=1)).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels), logits.detach()


def join_process_group() -> tuple[bool, torch.device]:
    """Join torchrun's process group (or make one of one process). Returns (whether we made it, device)."""
    made = not dist.is_initialized()
    if made and "RANK" not in os.environ:  # no torchrun: a group of one on a free local port
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cpu") if SIMULATION else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if not SIMULATION:
        torch.cuda.set_device(device)  # before NCCL makes a communicator: each rank on its own GPU, none on GPU 0
    if made:
        dist.init_process_group("gloo" if SIMULATION else "nccl")
    return made, device


def _plan(model: CollectionDLRM, args, world_size: int, device: torch.device, sharder):
    """The plan of ``model.embeddings`` by ``--sharding``, every table on ``--placement``'s kernel."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        row_wise,
        table_row_wise,
        table_wise,
    )
    from torchrec.distributed.types import CacheParams, ShardingPlan

    kernel = KERNEL_OF_PLACEMENT[Placement(args.placement)]
    sharding = args.sharding if args.sharding != "auto" or device.type == "cuda" else "row-wise"
    if sharding == "auto":
        cache = CacheParams(load_factor=args.cache_fraction) if kernel == "fused_uvm_caching" else None
        constraints = {f"t{t}": ParameterConstraints(compute_kernels=[kernel], cache_params=cache)
                       for t in range(args.tables)}
        topology = Topology(world_size=world_size, compute_device=device.type,
                            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
        planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
        return planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)

    def generator(t):
        if sharding == "table-wise":
            return table_wise(rank=t % world_size, compute_kernel=kernel)
        if sharding == "row-wise":
            return row_wise(compute_kernel=kernel)
        if sharding == "column-wise":
            return column_wise(ranks=list(range(world_size)), compute_kernel=kernel)
        make = table_row_wise(host_index=0)

        def with_kernel(*a, **k):  # table_row_wise() takes no compute kernel
            parameter_sharding = make(*a, **k)
            parameter_sharding.compute_kernel = kernel
            return parameter_sharding

        return with_kernel

    module_plan = construct_module_sharding_plan(model.embeddings, {f"t{t}": generator(t) for t in range(args.tables)},
                                                 world_size=world_size, device_type=device.type, sharder=sharder)
    if kernel == "fused_uvm_caching":
        for parameter_sharding in module_plan.values():
            parameter_sharding.cache_params = CacheParams(load_factor=args.cache_fraction)
    return ShardingPlan({"embeddings": module_plan})


def check_args(args: argparse.Namespace) -> None:
    """``ValueError`` for flags ``--torchrec`` cannot honour."""
    for flag in ("save", "resume", "save_every"):
        if getattr(args, flag, None) is not None:
            raise ValueError(f"--{flag.replace('_', '-')} is not supported with --torchrec (save TorchRec's sharded "
                             "state with torch.distributed.checkpoint)")
    if args.pipeline_depth:
        raise ValueError("--pipeline-depth is tiered-tbe's own pipeline; with --torchrec use --torchrec-pipeline")
    if args.torchrec_pipeline == "prefetch" and SIMULATION:
        raise ValueError("--torchrec-pipeline prefetch needs CUDA streams (a GPU)")
    if args.sharding == "column-wise" and args.dim % 4:
        raise ValueError(f"--sharding column-wise needs --dim a multiple of 4, got {args.dim}")


def run_torchrec(args: argparse.Namespace) -> dict:
    """Train through DistributedModelParallel; return the losses and throughput (every rank's mean)."""
    from tiered_tbe.torchrec import require_torchrec

    require_torchrec()
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed import DistributedModelParallel
    from torchrec.modules.embedding_configs import DataType
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from tiered_tbe.torchrec import TieredEmbeddingBagCollectionSharder
    from tiered_tbe.torchrec.batch import SparseBatch

    check_args(args)
    made_group, device = join_process_group()
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(args.seed)  # the same dense model on every rank
        data_type = {"fp32": DataType.FP32, "fp16": DataType.FP16, "bf16": DataType.BF16}[args.dtype]
        configs = [EmbeddingBagConfig(name=f"t{t}", embedding_dim=args.dim, num_embeddings=args.rows,
                                      feature_names=[f"f{t}"], data_type=data_type) for t in range(args.tables)]
        collection = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
        fused_params = dict(optimizer=_FBGEMM_OPTIMIZER[args.optimizer], learning_rate=args.lr, backend=args.backend,
                            stochastic_rounding=args.backend == "triton")  # the torch backend rounds to nearest
        if Placement(args.placement).is_cached:
            fused_params["cache_config"] = CacheConfig(policy=args.policy)
        sharder = TieredEmbeddingBagCollectionSharder(fused_params=fused_params)
        model = CollectionDLRM(collection, args.tables * args.dim, NUM_DENSE)
        plan = _plan(model, args, world_size, device, sharder)
        model = DistributedModelParallel(model, device=device, plan=plan, sharders=[sharder])
        dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                      lambda params: torch.optim.Adam(params, lr=1e-3))
        optimizer = CombinedOptimizer([model.fused_optimizer, dense])
        if rank == 0:
            print(f"tiered-tbe train --torchrec: {describe_mode()}; {world_size} process(es), "
                  f"{'gloo' if SIMULATION else 'nccl'}")
            print(f"model: {args.tables} tables of {args.rows:,} rows x {args.dim} {args.dtype} "
                  f"({KERNEL_OF_PLACEMENT[Placement(args.placement)]}), {args.optimizer} lr {args.lr:g}; "
                  f"DLRM on top (hidden 64, {NUM_DENSE} dense features)")
            print(plan, flush=True)

        tables = [TableSpec(args.rows, args.dim, name=f"t{t}") for t in range(args.tables)]
        data = SyntheticClicks(tables, args.batch_size, args.bag_size, args.alpha, NUM_DENSE, torch.device("cpu"),
                               args.seed)
        keys = [f"f{t}" for t in range(args.tables)]

        def batches():
            for step in range(args.steps):
                click = data.batch(world_size * step + rank)
                yield SparseBatch(dense_features=click.dense, labels=click.labels,
                            sparse_features=KeyedJaggedTensor.from_offsets_sync(keys, click.indices, click.offsets))

        return _train(model, optimizer, batches(), args, device, rank, world_size)
    finally:
        if made_group:
            dist.destroy_process_group()


def _train(model, optimizer, batches, args, device, rank: int, world_size: int) -> dict:
    from torchrec.distributed.train_pipeline import PrefetchTrainPipelineSparseDist, TrainPipelineSparseDist

    if args.torchrec_pipeline == "none":
        def steps():
            for batch in batches:
                batch = batch.to(device)
                optimizer.zero_grad()
                loss, _ = model(batch)
                loss.backward()
                optimizer.step()
                yield loss.detach()
    else:
        kind = TrainPipelineSparseDist if args.torchrec_pipeline == "sparse-dist" else PrefetchTrainPipelineSparseDist
        pipeline = kind(model, optimizer, device)

        def steps():
            # The pipelines return the model's output (its logits): the loss comes from a forward hook.
            captured = {}
            handle = model.register_forward_hook(lambda module, inputs, output: captured.update(loss=output[0]))
            try:
                while True:
                    try:
                        pipeline.progress(batches)
                    except StopIteration:
                        return
                    yield captured["loss"].detach()
            finally:
                handle.remove()

    logged = []
    start = time.perf_counter()
    progress = tqdm(steps(), total=args.steps, unit="batch", dynamic_ncols=True, disable=rank != 0)
    for step, loss in enumerate(progress):
        if step % 5 == 0 or step == args.steps - 1:
            value = float(loss)
            logged.append((step, value))
            progress.set_postfix(loss=f"{value:.4f}")
    elapsed = time.perf_counter() - start
    first_and_last = torch.tensor([logged[0][1], logged[-1][1]], device=device)
    dist.all_reduce(first_and_last)  # every rank's losses, averaged
    first, last = (float(value) / world_size for value in first_and_last)
    samples_per_s = args.steps * args.batch_size * world_size / elapsed
    if rank == 0:
        print(f"loss {first:.4f} -> {last:.4f} over {args.steps} steps (mean of {world_size} ranks); "
              f"{samples_per_s:,.0f} samples/s")
        if SIMULATION:
            print("(simulation mode: throughput is of the CPU interpreter, not of any GPU)")
    return dict(first_loss=first, final_loss=last, losses=logged, samples_per_s=samples_per_s, steps=args.steps,
                world_size=world_size)
