"""What tests/test_torchrec.py runs inside each rank of a small TorchRec job (gloo, CPU simulation).

``spawn(function, world_size, *args)`` starts ``world_size`` processes (torch.multiprocessing), each
joining one gloo process group and calling ``function(rank, world_size, *args)``; an assertion in
any rank fails the test with that rank's traceback. The helpers build one EmbeddingBagCollection
under two sharders (TorchRec's own, FBGEMM's CPU TBE; ours) with one plan, feed both the same
batches, and compare outputs and every shard of the state.
"""

from __future__ import annotations

import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

# t0..t3: rows that do not divide by 2 (uneven row-wise blocks), dims of 4, 8 and 12 (FBGEMM's CPU
# TBE wants multiples of 4; 8 splits column-wise in two).
TABLES = [("t0", 40, 8), ("t1", 24, 4), ("t2", 17, 12), ("t3", 33, 8)]
BATCH = 3  # samples per rank


DEVICE = torch.device("cpu")  # where a rank's model runs: cuda:<rank> in a job spawned with nccl=True


def spawn(function, world_size: int, *args, nccl: bool = False, cpu_simulation: bool = False) -> None:
    """``nccl``: one GPU per rank, NCCL (gpu-marked tests); else the CPU and gloo. ``cpu_simulation``: the ranks
    run in CPU simulation mode even on a machine with GPUs (a GPU job's checkpoint loaded on the CPU)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    saved = os.environ.get("TIERED_TBE_SIMULATE")
    if cpu_simulation:  # read by the ranks' `import tiered_tbe` (base/mode.py); spawned ranks inherit it
        os.environ["TIERED_TBE_SIMULATE"] = "1"
    try:
        mp.spawn(_rank_entry, args=(function, world_size, port, args, nccl), nprocs=world_size, join=True)
    finally:
        if cpu_simulation and saved is None:
            del os.environ["TIERED_TBE_SIMULATE"]
        elif cpu_simulation:
            os.environ["TIERED_TBE_SIMULATE"] = saved


def _rank_entry(rank: int, function, world_size: int, port: int, args, nccl: bool = False) -> None:
    global DEVICE
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)  # TorchRec logs a warning per plan and kernel
    import tiered_tbe  # noqa: F401  (CPU simulation mode before triton / numba load)

    if nccl:
        DEVICE = torch.device("cuda", rank)
        torch.cuda.set_device(DEVICE)
    dist.init_process_group("nccl" if nccl else "gloo", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        function(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    # A rank that passed leaves without the interpreter's teardown: under a loaded machine a rank once
    # aborted there ("terminate called without an active exception": a C++ thread of the process group's
    # still joinable at exit), after its checks had passed. A failure above still raises as usual.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ------------------------------------------------------------------ models and plans
def table_configs(tables=TABLES, features_of=None):
    from torchrec import EmbeddingBagConfig

    features_of = features_of or {}
    return [EmbeddingBagConfig(name=name, embedding_dim=dim, num_embeddings=rows,
                               feature_names=features_of.get(name, [f"f{name[1:]}"])) for name, rows, dim in tables]


def plan(ebc, layout: dict, world_size: int, path: str = ""):
    """``layout``: table -> (sharding, compute kernel), sharding ``"tw0"`` / ``"tw1"`` (table-wise on that
    rank), ``"rw"``, ``"cw"`` (two column shards, on ranks 0 and 1, or both on rank 0 in a 1-rank job),
    ``"twrw"``."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    from tiered_tbe.torchrec import TieredEmbeddingBagCollectionSharder

    module_plan = construct_module_sharding_plan(ebc, sharding_generators(layout, world_size), world_size=world_size,
                                                 device_type=DEVICE.type, sharder=TieredEmbeddingBagCollectionSharder())
    return ShardingPlan({path: module_plan})


def sharding_generators(layout: dict, world_size: int) -> dict:
    """TorchRec's per-table plan generators for ``layout`` (see :func:`plan`)."""
    from torchrec.distributed.sharding_plan import column_wise, row_wise, table_row_wise, table_wise

    generators = {}
    for name, (sharding, kernel) in layout.items():
        if sharding.startswith("tw") and sharding != "twrw":
            generators[name] = table_wise(rank=int(sharding[2:]), compute_kernel=kernel)
        elif sharding == "rw":
            generators[name] = row_wise(compute_kernel=kernel)
        elif sharding == "cw":
            generators[name] = column_wise(ranks=[0, 1] if world_size > 1 else [0, 0], compute_kernel=kernel)
        else:
            generators[name] = _with_kernel(table_row_wise(host_index=0), kernel)
    return generators


def _with_kernel(generator, kernel):
    """table_row_wise() takes no compute kernel: set it on the ParameterSharding it makes."""

    def with_kernel(*args, **kwargs):
        sharding = generator(*args, **kwargs)
        sharding.compute_kernel = kernel
        return sharding

    return with_kernel


def dmp(layout: dict, world_size: int, sharder, tables=TABLES, features_of=None, weighted: bool = False):
    """An EmbeddingBagCollection of ``tables`` under ``sharder``, planned by ``layout``."""
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed import DistributedModelParallel

    ebc = EmbeddingBagCollection(tables=table_configs(tables, features_of), device=torch.device("meta"),
                                 is_weighted=weighted)
    return DistributedModelParallel(ebc, device=DEVICE, plan=plan(ebc, layout, world_size), sharders=[sharder])


def stock_sharder(fused_params: dict, sequence: bool = False):
    """TorchRec's own sharder (FBGEMM's CPU TBE), offering every sharding type and kernel on the CPU;
    ``sequence``: its EmbeddingCollectionSharder, else its EmbeddingBagCollectionSharder."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    class CpuSharder(EmbeddingCollectionSharder if sequence else EmbeddingBagCollectionSharder):
        def sharding_types(self, compute_device_type):
            return super().sharding_types("cuda")

        def compute_kernels(self, sharding_type, compute_device_type):
            return super().compute_kernels(sharding_type, "cuda")

    return CpuSharder(fused_params=dict(fused_params))


def ours_sharder(fused_params: dict):
    from tiered_tbe.torchrec import TieredEmbeddingBagCollectionSharder

    return TieredEmbeddingBagCollectionSharder(fused_params=dict(fused_params))


def fbgemm_kernel_layout(layout: dict) -> dict:
    """The plan for TorchRec's own kernels: on GPUs the same plan (FBGEMM's CUDA TBE runs every kernel); on
    the CPU every kernel ``fused`` (FBGEMM's CPU TBE keeps every table in host memory whatever the kernel,
    and has no cache)."""
    if DEVICE.type == "cuda":
        return dict(layout)
    return {name: (sharding, "fused") for name, (sharding, _) in layout.items()}


# ------------------------------------------------------------------ batches
def features_of_tables(tables=TABLES, features_of=None) -> list[tuple[str, int]]:
    """``(feature, rows of its table)`` of every feature, in the collection's order."""
    features_of = features_of or {}
    return [(feature, rows) for name, rows, _ in tables for feature in features_of.get(name, [f"f{name[1:]}"])]


def batch(step: int, rank: int, tables=TABLES, batch_sizes=None, seed: int = 0, features_of=None,
          weighted: bool = False):
    """This rank's KeyedJaggedTensor of ``step``: bags of 0-3 lookups (empty bags, repeated rows).
    ``batch_sizes``: per feature (a variable batch, TorchRec's VBE), else ``BATCH`` for all.
    ``features_of``: table -> its features, when not one ``f<i>`` per table ``t<i>``. ``weighted``: a
    weight per lookup (a weighted collection's per-sample weights)."""
    from torchrec import KeyedJaggedTensor

    generator = torch.Generator().manual_seed(1000 * seed + 10 * step + rank)
    features = features_of_tables(tables, features_of)
    sizes = batch_sizes or [BATCH] * len(features)
    values, lengths = [], []
    for (_, rows), size in zip(features, sizes):
        length = torch.randint(0, 4, (size,), generator=generator)
        hot = step % 2 == 1  # every other step a few hot rows, repeated within and across bags
        values.append(torch.randint(0, 3 if hot else rows, (int(length.sum()),), generator=generator))
        lengths.append(length)
    keys = [feature for feature, _ in features]
    values, lengths = torch.cat(values), torch.cat(lengths)
    if weighted:
        weights = torch.rand(values.numel(), generator=generator) + 0.5
        return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths, weights=weights)
    if batch_sizes is None:
        return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
    inverse = torch.stack([torch.randint(0, max(size, 1), (max(sizes),), generator=generator) for size in sizes])
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, stride_per_key_per_rank=[[s] for s in sizes],
                             inverse_indices=(keys, inverse))


def loss_weights(step: int, rank: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(7919 * step + rank))


def train_step(model, kjt, step: int, rank: int) -> torch.Tensor:
    """Forward, ``loss = sum(pooled * fixed random weights)``, backward (the fused update). Returns the
    pooled values ``[B, sum of dims]``, the features in the input's order (TorchRec's output puts them in
    the order of its shardings)."""
    pooled = model(kjt.to(DEVICE))
    pooled = pooled.wait() if hasattr(pooled, "wait") else pooled
    by_feature = pooled.to_dict()
    values = torch.cat([by_feature[key] for key in kjt.keys()], dim=1)
    (values * loss_weights(step, rank, values.shape).to(DEVICE)).sum().backward()
    return values.detach()


# ------------------------------------------------------------------ state
def local_shards(state: dict) -> dict:
    """``{key: [(offsets, tensor), ...]}`` of every sharded tensor in a (nested) state dict."""
    found = {}

    def visit(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                visit(f"{prefix}{k}.", v)
        elif hasattr(value, "local_shards"):
            found[prefix[:-1]] = [(tuple(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()]

    visit("", state)
    return found


def assert_states_close(expected_model, model, atol=1e-5, exact=False) -> None:
    """Every local shard of the weights and of the fused optimizer's state of two models, compared."""
    for get in (lambda m: m.state_dict(), lambda m: m.fused_optimizer.state_dict()):
        theirs, ours = local_shards(get(expected_model)), local_shards(get(model))
        assert theirs.keys() == ours.keys(), (sorted(theirs), sorted(ours))
        for key in theirs:
            for (offsets, expected), (our_offsets, actual) in zip(theirs[key], ours[key]):
                assert offsets == our_offsets, key
                if exact:
                    assert torch.equal(expected, actual), key
                else:
                    torch.testing.assert_close(actual, expected, rtol=0, atol=atol, msg=lambda m, k=key: f"{k}: {m}")


def load_full_weights(model, weights: dict) -> None:
    """Write whole tables (``{table: [rows, dim]}``) into a model's shards, through load_state_dict."""
    state = model.state_dict()
    for name, full in weights.items():
        for shard in state[f"embedding_bags.{name}.weight"].local_shards():
            (row, column), (rows, columns) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            shard.tensor.copy_(full[row:row + rows, column:column + columns].to(shard.tensor.device))
    model.load_state_dict(state)


def assert_weights_equal_reference(model, reference, names, atol=1e-5) -> None:
    state = model.state_dict()
    for t, name in enumerate(names):
        for shard in state[f"embedding_bags.{name}.weight"].local_shards():
            (row, column), (rows, columns) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            expected = reference.weights[t][row:row + rows, column:column + columns].float()
            torch.testing.assert_close(shard.tensor.cpu(), expected, rtol=0, atol=atol,
                                       msg=lambda m, n=name: f"{n}: {m}")


# ------------------------------------------------------------------ a model for the train pipelines
NUM_DENSE = 2


class ClickModel(nn.Module):
    """EmbeddingBagCollection + dense features -> a linear click logit; ``forward(batch) -> (loss, logits)``,
    as TorchRec's train pipelines call a model."""

    def __init__(self, ebc, total_dim: int):
        super().__init__()
        self.ebc = ebc
        self.head = nn.Linear(total_dim + NUM_DENSE, 1)

    def forward(self, batch):
        pooled = self.ebc(batch.sparse_features)
        logits = self.head(torch.cat([pooled.values(), batch.dense_features], dim=1)).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels), logits.detach()


def click_dmp(layout: dict, world_size: int, sharder):
    """A ClickModel whose collection is sharded by ``layout``, with its dense optimizer beside the fused one."""
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed import DistributedModelParallel
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    ebc = EmbeddingBagCollection(tables=table_configs(), device=torch.device("meta"))
    torch.manual_seed(5)  # the same head in every model
    model = ClickModel(ebc, sum(dim for _, _, dim in TABLES))
    model = DistributedModelParallel(model, device=DEVICE, plan=plan(ebc, layout, world_size, "ebc"),
                                     sharders=[sharder])
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=0.05))
    return model, CombinedOptimizer([model.fused_optimizer, dense])


def click_batches(rank: int, steps: int, seed: int = 0):
    """TorchRec ``Batch``es of this rank: dense features, the KJT of :func:`batch`, 0/1 labels."""
    from torchrec.datasets.utils import Batch

    for step in range(steps):
        generator = torch.Generator().manual_seed(100 + 10 * step + rank)
        yield Batch(dense_features=torch.randn(BATCH, NUM_DENSE, generator=generator),
                    sparse_features=batch(step, rank, seed=seed),
                    labels=(torch.rand(BATCH, generator=generator) < 0.5).float())
