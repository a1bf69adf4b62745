"""The TorchRec jobs of tests/test_torchrec.py: what each rank runs (tests/torchrec_ranks.py spawns them).

Kept out of the test module: a spawned rank imports the module of its function, and the test
module starts subprocess checks as it is collected.
"""

from __future__ import annotations

import torch
import torchrec_ranks as ranks


def fused_params(optimizer: str = "EXACT_ROWWISE_ADAGRAD", **extra) -> dict:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    return dict(optimizer=EmbOptimType[optimizer], learning_rate=0.1, eps=1e-6) | extra


def ours_params(params: dict, backend: str = "torch", small_cache: bool = True, policy: str = "lru") -> dict:
    from tiered_tbe import CacheConfig

    extra = dict(backend=backend)
    if small_cache:  # 4 slots in 2 sets of 2 ways per rank's cached group: heavy eviction
        extra["cache_config"] = CacheConfig(slots=4, associativity=2, policy=policy)
    return params | extra


# Every table on one kind of sharding, then a mix with HBM, managed and cached tables.
PLANS = {
    "table-wise": {"t0": ("tw0", "fused"), "t1": ("tw1", "fused"), "t2": ("tw1", "fused"), "t3": ("tw0", "fused")},
    "row-wise": {name: ("rw", "fused") for name, _, _ in ranks.TABLES},
    "column-wise": {"t0": ("cw", "fused"), "t1": ("tw1", "fused"), "t2": ("tw0", "fused"), "t3": ("cw", "fused")},
    "table-row-wise": {name: ("twrw", "fused") for name, _, _ in ranks.TABLES},
    "mixed": {"t0": ("tw0", "fused"), "t1": ("rw", "fused_uvm_caching"), "t2": ("twrw", "fused_uvm"),
              "t3": ("cw", "fused_uvm_caching")},
    "cached": {"t0": ("rw", "fused_uvm_caching"), "t1": ("tw1", "fused_uvm_caching"),
               "t2": ("tw0", "fused_uvm_caching"), "t3": ("twrw", "fused_uvm_caching")},
}
STEPS = 4


def _train_side_by_side(rank, world, layout, params, ours, batch_sizes=None, steps=STEPS, label="",
                        weighted=False):
    stock = ranks.dmp(ranks.fbgemm_kernel_layout(layout), world, ranks.stock_sharder(params), weighted=weighted)
    model = ranks.dmp(layout, world, ranks.ours_sharder(ours), weighted=weighted)
    model.load_state_dict(stock.state_dict())
    for step in range(steps):
        kjt = ranks.batch(step, rank, batch_sizes=batch_sizes, weighted=weighted)
        expected = ranks.train_step(stock, kjt, step, rank)
        actual = ranks.train_step(model, kjt, step, rank)
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5, msg=lambda m, s=step: f"{label} step {s}: {m}")
    ranks.assert_states_close(stock, model)
    return stock, model


def every_plan_equals_fbgemm(rank, world, backend: str = "torch", steps: int = STEPS):
    """Every plan of PLANS, then SGD, Adagrad and a weighted collection on the mixed plan, and FBGEMM's LFU
    (our lfu-admit) on the cached plan: ``steps`` steps of ours (``backend``) equal TorchRec's own kernels
    (FBGEMM's CPU TBE on the CPU, its CUDA TBE under the same plan on GPUs)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm

    for name, layout in PLANS.items():
        _train_side_by_side(rank, world, layout, fused_params(), ours_params(fused_params(), backend), steps=steps,
                            label=name)
    for optimizer in ("EXACT_SGD", "EXACT_ADAGRAD"):
        _train_side_by_side(rank, world, PLANS["mixed"], fused_params(optimizer),
                            ours_params(fused_params(optimizer), backend), steps=steps, label=optimizer)
    # A weighted collection: a weight per lookup (per-sample weights) scales its row in the bag.
    _train_side_by_side(rank, world, PLANS["mixed"], fused_params(), ours_params(fused_params(), backend),
                        steps=steps, label="weighted", weighted=True)
    # lfu-admit, what FBGEMM's LFU maps to: with 4 slots most misses are refused and read in place.
    lfu = fused_params(cache_algorithm=CacheAlgorithm.LFU)
    _train_side_by_side(rank, world, PLANS["cached"], lfu, ours_params(lfu, backend, policy="lfu-admit"), steps=steps,
                        label="lfu-admit")
    # The Triton kernels (the others ran their plain-torch reference, far faster in simulation).
    _train_side_by_side(rank, world, PLANS["mixed"], fused_params(), ours_params(fused_params(), backend="triton"),
                        steps=2, label="triton")


def _reference_batch(kjts):
    """All ranks' batches as one TBE-layout batch for the fp64 reference: rank 0's samples first."""
    keys = kjts[0].keys()
    indices, lengths = [], []
    for key in keys:
        for kjt in kjts:
            indices.append(kjt[key].values())
            lengths.append(kjt[key].lengths())
    lengths = torch.cat(lengths)
    return torch.cat(indices).long(), torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])


def optimizers_and_lr_schedule_equal_the_reference(rank, world):
    """Adam, PartialRowwiseAdam and LAMB (no FBGEMM CPU kernel) against the fp64 reference trained on every
    rank's batch, with the learning rate changed between steps through model.fused_optimizer (an LR
    schedule, TorchRec's way: param_groups, then step()) and by hand in the reference."""
    import dataclasses

    from reference_model import ReferenceBags

    from tiered_tbe.optimizers import LAMB, Adam, PartialRowwiseAdam

    names = [name for name, _, _ in ranks.TABLES]
    schedule = {1: 0.02, 3: 0.2}
    # No column-wise table: a row-wise quantity (PartialRowwiseAdam's second moment, LAMB's norms) is
    # then each column shard's, as in FBGEMM, where the reference has whole rows.
    layout = {"t0": ("tw0", "fused"), "t1": ("rw", "fused_uvm_caching"), "t2": ("twrw", "fused_uvm"),
              "t3": ("tw1", "fused_uvm_caching")}
    for optimizer in (Adam(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.01),
                      PartialRowwiseAdam(lr=0.05, betas=(0.8, 0.95), eps=1e-6), LAMB(lr=0.05, eps=1e-6)):
        model = ranks.dmp(layout, world, ranks.ours_sharder(ours_params({"optimizer": optimizer})))
        generator = torch.Generator().manual_seed(11)
        weights = {name: torch.rand(rows, dim, generator=generator) - 0.5 for name, rows, dim in ranks.TABLES}
        ranks.load_full_weights(model, weights)
        reference = ReferenceBags([weights[name] for name in names], "sum", optimizer)
        for step in range(STEPS):
            if step in schedule:
                for group in model.fused_optimizer.param_groups:
                    group["lr"] = schedule[step]
                model.fused_optimizer.step()
                reference.optimizer = dataclasses.replace(reference.optimizer, lr=schedule[step])
            kjts = [ranks.batch(step, r) for r in range(world)]
            actual = ranks.train_step(model, kjts[rank], step, rank)
            indices, offsets = _reference_batch(kjts)
            expected = reference.forward(indices, offsets)[rank * ranks.BATCH:(rank + 1) * ranks.BATCH]
            torch.testing.assert_close(actual.double(), expected, rtol=0, atol=1e-5,
                                       msg=lambda m, s=step, o=optimizer: f"{o} step {s}: {m}")
            # TorchRec averages the gradient over the ranks, as data parallelism does.
            grad = torch.cat([ranks.loss_weights(step, r, actual.shape) for r in range(world)]) / world
            reference.backward(indices, offsets, grad.double())
        ranks.assert_weights_equal_reference(model, reference, names)
        assert all(m.get_learning_rate() == schedule[3] for m in model.module.tiered_modules())

    # Row-wise Adagrad under the same schedule against TorchRec's own kernel, which sets it in FBGEMM.
    stock = ranks.dmp(ranks.fbgemm_kernel_layout(PLANS["mixed"]), world, ranks.stock_sharder(fused_params()))
    model = ranks.dmp(PLANS["mixed"], world, ranks.ours_sharder(ours_params(fused_params())))
    model.load_state_dict(stock.state_dict())
    for step in range(STEPS):
        for side in (stock, model):
            if step in schedule:
                for group in side.fused_optimizer.param_groups:
                    group["lr"] = schedule[step]
                side.fused_optimizer.step()
        kjt = ranks.batch(step, rank)
        torch.testing.assert_close(ranks.train_step(model, kjt, step, rank), ranks.train_step(stock, kjt, step, rank),
                                   rtol=0, atol=1e-5)
    ranks.assert_states_close(stock, model)


def variable_batch_and_train_pipeline(rank, world):
    """TorchRec's variable batch size per feature (VBE; one row-wise lookup of two kernels writes into one
    output), then TrainPipelineSparseDist, then an evaluation batch under no_grad: no slot stays locked."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    layout = {"t0": ("tw0", "fused"), "t1": ("rw", "fused"), "t2": ("tw1", "fused_uvm"),
              "t3": ("rw", "fused_uvm_caching")}
    for optimizer in ("EXACT_ROWWISE_ADAGRAD", "EXACT_SGD"):  # FBGEMM's VBE has these two on the CPU
        stock = ranks.dmp(ranks.fbgemm_kernel_layout(layout), world, ranks.stock_sharder(fused_params(optimizer)))
        model = ranks.dmp(layout, world, ranks.ours_sharder(ours_params(fused_params(optimizer))))
        model.load_state_dict(stock.state_dict())
        for step in range(STEPS):
            # Per feature, and per rank for the table-wise ones (TorchRec's row-wise VBE over gloo
            # gathers the gradient with all_gather, which needs the same sizes on every rank).
            sizes = [2 + rank, 3, 1 + rank + step % 2, 4 - step % 2]
            kjt = ranks.batch(step, rank, batch_sizes=sizes)
            expected = ranks.train_step(stock, kjt, step, rank)
            actual = ranks.train_step(model, kjt, step, rank)
            torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
        ranks.assert_states_close(stock, model)

    models = [ranks.click_dmp(PLANS["mixed"], world, sharder) for sharder in (
        ranks.stock_sharder(fused_params()), ranks.ours_sharder(ours_params(fused_params())))]
    models[1][0].load_state_dict(models[0][0].state_dict())
    outputs, pipelines = [], []
    for model, optimizer in models:
        pipelines.append(TrainPipelineSparseDist(model, optimizer, device=torch.device("cpu")))
        batches = iter(ranks.click_batches(rank, STEPS))
        outputs.append([pipelines[-1].progress(batches) for _ in range(STEPS)])
    for expected, actual in zip(*outputs):
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
    ranks.assert_states_close(models[0][0], models[1][0])

    # Evaluation: through a pipeline in eval mode under no_grad, then called directly.
    model, optimizer = models[1]
    pipelines[1].detach()
    cached = [m for m in model.module.ebc.tiered_modules() if m.cache is not None]
    assert cached, "the mixed plan has cached tables"
    before = ranks.local_shards(model.state_dict())
    model.eval()
    with torch.no_grad():
        evaluation = TrainPipelineSparseDist(model, optimizer, device=torch.device("cpu"))
        batches = iter(ranks.click_batches(rank, 2, seed=1))
        for _ in range(2):
            evaluation.progress(batches)
        evaluation.detach()
        model(next(ranks.click_batches(rank, 1, seed=2)))
    assert all(m.cache.num_locked() == 0 and not m._prefetched for m in cached)
    after = ranks.local_shards(model.state_dict())
    assert all(torch.equal(a, b) for key in before for (_, a), (_, b) in zip(before[key], after[key]))


PLAN_A = {"t0": ("rw", "fused_uvm_caching"), "t1": ("tw0", "fused"), "t2": ("twrw", "fused_uvm_caching"),
          "t3": ("tw1", "fused_uvm_caching")}
PLAN_B = {"t0": ("tw1", "fused"), "t1": ("rw", "fused_uvm_caching"), "t2": ("tw0", "fused"),
          "t3": ("twrw", "fused_uvm")}
PLAN_ONE_RANK = {name: ("tw0", "fused_uvm_caching") for name, _, _ in ranks.TABLES}


def full_state(model) -> dict:
    """Every sharded tensor of the model and of its fused optimizer, whole, on every rank (a rank's
    optimizer state dict names only the tables it holds shards of)."""
    import torch.distributed as dist

    shards = []

    def visit(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                visit(f"{prefix}{k}.", v)
        elif hasattr(value, "local_shards"):
            for shard in value.local_shards():
                shards.append((prefix[:-1], tuple(value.size()), shard.metadata.shard_offsets,
                               shard.metadata.shard_sizes, shard.tensor.detach().cpu().clone()))

    visit("", {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()})
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, shards)
    found = {}
    for key, size, offsets, sizes, tensor in (shard for rank_shards in everyone for shard in rank_shards):
        full = found.setdefault(key, torch.zeros(size, dtype=tensor.dtype))
        full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))] = tensor
    return found


def _save(model, path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}, checkpoint_id=path)


def _load(model, path, step: int) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    model.fused_optimizer.load_state_dict(state["optim"])
    model.fused_optimizer.set_optimizer_step(step)  # TorchRec keeps the step out of its state dicts


def checkpoints(rank, world, directory):
    """Sharded checkpoints through torch.distributed.checkpoint: a resumed run equals the uninterrupted one
    bitwise; a model with another plan loads the same state and trains on like the uninterrupted one."""
    import os

    from tiered_tbe.optimizers import Adam

    for label, params in (("rowwise_adagrad", fused_params()),
                          ("adam", {"optimizer": Adam(lr=0.05, betas=(0.8, 0.95), eps=1e-6)})):
        path = os.path.join(directory, label)

        def make(layout, params=params):
            return ranks.dmp(layout, world, ranks.ours_sharder(ours_params(params)))

        uninterrupted, interrupted = make(PLAN_A), make(PLAN_A)
        interrupted.load_state_dict(uninterrupted.state_dict())
        for step in range(STEPS):
            ranks.train_step(uninterrupted, ranks.batch(step, rank), step, rank)
            if step < STEPS // 2:
                ranks.train_step(interrupted, ranks.batch(step, rank), step, rank)
        _save(interrupted, path)
        saved = full_state(interrupted)
        if rank == 0:
            torch.save(saved, os.path.join(directory, f"{label}.pt"))

        resumed, resharded = make(PLAN_A), make(PLAN_B)
        for model in (resumed, resharded):
            _load(model, path, STEPS // 2)
            loaded = full_state(model)
            assert loaded.keys() == saved.keys()
            assert all(torch.equal(loaded[key], saved[key]) for key in saved), label
            for step in range(STEPS // 2, STEPS):
                ranks.train_step(model, ranks.batch(step, rank), step, rank)
        ranks.assert_states_close(uninterrupted, resumed, exact=True)
        final = full_state(uninterrupted)
        if rank == 0:  # what checkpoint_on_one_rank's continued training must reach
            torch.save(final, os.path.join(directory, f"{label}-final.pt"))
        for key, value in full_state(resharded).items():
            torch.testing.assert_close(value, final[key], rtol=0, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


def checkpoint_on_one_rank(rank, world, directory):
    """The 2-rank checkpoints loaded by a 1-rank job (another world size, every table on rank 0), which then
    trains on both ranks' samples of the remaining steps (tests/torchrec_world_sizes.py) and reaches the
    uninterrupted 2-rank run's weights and optimizer state within 1e-5."""
    import os

    from torchrec_world_sizes import global_train_step

    from tiered_tbe.optimizers import Adam

    for label, params in (("rowwise_adagrad", fused_params()),
                          ("adam", {"optimizer": Adam(lr=0.05, betas=(0.8, 0.95), eps=1e-6)})):
        model = ranks.dmp(PLAN_ONE_RANK, world, ranks.ours_sharder(ours_params(params)))
        _load(model, os.path.join(directory, label), STEPS // 2)
        saved = torch.load(os.path.join(directory, f"{label}.pt"))
        loaded = full_state(model)
        assert loaded.keys() == saved.keys()
        assert all(torch.equal(loaded[key], saved[key]) for key in saved), label
        for step in range(STEPS // 2, STEPS):
            global_train_step(model, step, 2)
        final = torch.load(os.path.join(directory, f"{label}-final.pt"))
        for key, value in full_state(model).items():
            torch.testing.assert_close(value, final[key], rtol=0, atol=1e-5,
                                       msg=lambda m, k=key, n=label: f"{n} {k}: {m}")


SHARED = {"t1": ["f1", "f4"], "t3": ["f3", "f5", "f6"]}  # t1 and t3 looked up by several features


def shared_tables_equal_fbgemm(rank, world):
    def side_by_side(layout, batch_sizes=None, optimizer="EXACT_ROWWISE_ADAGRAD"):
        stock = ranks.dmp(ranks.fbgemm_kernel_layout(layout), world, ranks.stock_sharder(fused_params(optimizer)),
                          features_of=SHARED)
        model = ranks.dmp(layout, world, ranks.ours_sharder(ours_params(fused_params(optimizer))), features_of=SHARED)
        model.load_state_dict(stock.state_dict())
        for step in range(STEPS):
            kjt = ranks.batch(step, rank, batch_sizes=batch_sizes and batch_sizes(step), features_of=SHARED)
            expected = ranks.train_step(stock, kjt, step, rank)
            torch.testing.assert_close(ranks.train_step(model, kjt, step, rank), expected, rtol=0, atol=1e-5)
        ranks.assert_states_close(stock, model)

    for name in ("table-wise", "row-wise", "column-wise", "table-row-wise", "mixed"):
        side_by_side(PLANS[name])
    # Variable batch: features of one table with their own batch sizes (table-wise: per rank too).
    side_by_side(PLANS["table-wise"], batch_sizes=lambda step: [2 + rank, 3, 1 + step % 2, 2, 4 - rank, 1, 3])


# ------------------------------------------------------------------ EmbeddingCollection (a row per lookup)
SEQUENCE_TABLES = [("t0", 40, 8), ("t1", 24, 8), ("t2", 17, 8), ("t3", 33, 8)]  # one dim, as an EC's
SEQUENCE_PLANS = {
    "table-wise": {"t0": ("tw0", "fused"), "t1": ("tw1", "fused"), "t2": ("tw1", "fused"), "t3": ("tw0", "fused")},
    "row-wise": {name: ("rw", "fused") for name, _, _ in SEQUENCE_TABLES},
    "column-wise": {"t0": ("cw", "fused"), "t1": ("tw1", "fused"), "t2": ("tw0", "fused"), "t3": ("cw", "fused")},
    "mixed": {"t0": ("tw0", "fused"), "t1": ("rw", "fused_uvm_caching"), "t2": ("cw", "fused_uvm"),
              "t3": ("rw", "fused_uvm_caching")},
}


def _sequence_dmp(layout: dict, world: int, sharder):
    from torchrec import EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    from tiered_tbe.torchrec import TieredEmbeddingCollectionSharder

    collection = EmbeddingCollection(tables=[EmbeddingConfig(name=name, embedding_dim=dim, num_embeddings=rows,
                                                             feature_names=[f"f{name[1:]}"])
                                             for name, rows, dim in SEQUENCE_TABLES], device=torch.device("meta"))
    generators = ranks.sharding_generators(layout, world)
    module_plan = construct_module_sharding_plan(collection, generators, world_size=world,
                                                 device_type=ranks.DEVICE.type,
                                                 sharder=TieredEmbeddingCollectionSharder())
    return DistributedModelParallel(collection, device=ranks.DEVICE, plan=ShardingPlan({"": module_plan}),
                                    sharders=[sharder])


def _sequence_step(model, kjt, step: int, rank: int) -> torch.Tensor:
    """Forward (each feature's rows, a JaggedTensor), ``loss = sum(rows * fixed random weights)``, backward
    (the fused update). Returns the rows ``[lookups, dim]``, the features in the input's order."""
    out = model(kjt.to(ranks.DEVICE))
    out = out.wait() if hasattr(out, "wait") else out
    rows = torch.cat([out[key].values() for key in kjt.keys()])
    (rows * ranks.loss_weights(step, rank, rows.shape).to(ranks.DEVICE)).sum().backward()
    return rows.detach()


def _sequence_steps_equal(stock, model, rank: int, label: str) -> None:
    """``model`` loads ``stock``'s weights, then STEPS steps of both give the same rows (within 1e-5) and
    leave the same weights and optimizer state."""
    model.load_state_dict(stock.state_dict())
    for step in range(STEPS):
        kjt = ranks.batch(step, rank, tables=SEQUENCE_TABLES)
        expected = _sequence_step(stock, kjt, step, rank)
        torch.testing.assert_close(_sequence_step(model, kjt, step, rank), expected, rtol=0, atol=1e-5,
                                   msg=lambda m, s=step: f"{label} step {s}: {m}")
    ranks.assert_states_close(stock, model)


def sequence_plans_equal_fbgemm(rank, world):
    """An EmbeddingCollection under TieredEmbeddingCollectionSharder: table-wise, row-wise, column-wise and a
    plan of HBM, managed and cached tables (a cache of 4 slots), 4 steps each, rows and every shard of the
    weights and optimizer state against TorchRec's own sharder (FBGEMM's CPU TBE without pooling)."""
    from tiered_tbe.torchrec import TieredEmbeddingCollectionSharder, TieredShardedEmbeddingCollection

    for name, layout in SEQUENCE_PLANS.items():
        for optimizer in ("EXACT_ROWWISE_ADAGRAD", "EXACT_SGD") if name == "mixed" else ("EXACT_ROWWISE_ADAGRAD",):
            params = fused_params(optimizer)
            stock = _sequence_dmp(ranks.fbgemm_kernel_layout(layout), world, ranks.stock_sharder(params, sequence=True))
            model = _sequence_dmp(layout, world, TieredEmbeddingCollectionSharder(fused_params=ours_params(params)))
            [sharded] = [m for m in model.modules() if isinstance(m, TieredShardedEmbeddingCollection)]
            assert sharded.tiered_modules() and all(m.pooling == "none" for m in sharded.tiered_modules())
            _sequence_steps_equal(stock, model, rank, name)


# No column-wise table in a checkpoint that reshards (as PLAN_A and PLAN_B): a column-wise table's row-wise
# optimizer state is one per column shard, and does not load into a plan of another shape.
SEQUENCE_CHECKPOINT_PLAN = {"t0": ("rw", "fused_uvm_caching"), "t1": ("tw0", "fused"), "t2": ("tw1", "fused_uvm"),
                            "t3": ("rw", "fused_uvm_caching")}


def sequence_checkpoint_reshards(rank, world, directory):
    """An EmbeddingCollection's sharded checkpoint (torch.distributed.checkpoint, cached tables flushed)
    from a row-wise and table-wise plan of HBM, managed and cached tables loads into an all table-wise
    plan, which trains on as the saved model does."""
    import os

    from tiered_tbe.torchrec import TieredEmbeddingCollectionSharder

    def make(layout):
        return _sequence_dmp(layout, world, TieredEmbeddingCollectionSharder(fused_params=ours_params(fused_params())))

    path = os.path.join(directory, "sequence")
    saved_model = make(SEQUENCE_CHECKPOINT_PLAN)
    for step in range(2):
        _sequence_step(saved_model, ranks.batch(step, rank, tables=SEQUENCE_TABLES), step, rank)
    _save(saved_model, path)
    resharded = make(SEQUENCE_PLANS["table-wise"])
    _load(resharded, path, 2)
    saved = full_state(saved_model)
    loaded = full_state(resharded)
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[key], saved[key]) for key in saved)
    for step in range(2, STEPS):
        kjt = ranks.batch(step, rank, tables=SEQUENCE_TABLES)
        torch.testing.assert_close(_sequence_step(resharded, kjt, step, rank),
                                   _sequence_step(saved_model, kjt, step, rank), rtol=0, atol=1e-5)
    final = full_state(saved_model)
    for key, value in full_state(resharded).items():
        torch.testing.assert_close(value, final[key], rtol=0, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


# ------------------------------------------------------------------ on one GPU (gpu-marked tests, NCCL)
GPU_KERNELS = {"t0": ("tw0", "fused"), "t1": ("tw0", "fused_uvm"), "t2": ("tw0", "fused_uvm_caching"),
               "t3": ("tw0", "fused_uvm_caching")}


def gpu_kernels_equal_fbgemm(rank, world):
    """On the GPU: fused, fused_uvm and fused_uvm_caching tables (a cache of a few slots: heavy eviction), our
    Triton kernels against FBGEMM's CUDA TBE under the same plan, 4 steps, row-wise Adagrad, SGD and Adam."""
    for optimizer in ("EXACT_ROWWISE_ADAGRAD", "EXACT_SGD", "ADAM"):
        params = fused_params(optimizer)
        stock = ranks.dmp(GPU_KERNELS, world, ranks.stock_sharder(params))
        model = ranks.dmp(GPU_KERNELS, world, ranks.ours_sharder(ours_params(params, backend="triton")))
        model.load_state_dict(stock.state_dict())
        for step in range(STEPS):
            kjt = ranks.batch(step, rank)
            expected = ranks.train_step(stock, kjt, step, rank)
            torch.testing.assert_close(ranks.train_step(model, kjt, step, rank), expected, rtol=0, atol=1e-5,
                                       msg=lambda m, o=optimizer, s=step: f"{o} step {s}: {m}")
        ranks.assert_states_close(stock, model)


def gpu_sequence_kernels_equal_fbgemm(rank, world):
    """On the GPU: an EmbeddingCollection of fused, fused_uvm and fused_uvm_caching tables under our sequence
    sharder (Triton kernels, pooling none; the cache of a few slots: heavy eviction) against FBGEMM's CUDA
    TBE under TorchRec's own sharder and the same plan, 4 steps, row-wise Adagrad and SGD."""
    from tiered_tbe.torchrec import TieredEmbeddingCollectionSharder

    for optimizer in ("EXACT_ROWWISE_ADAGRAD", "EXACT_SGD"):
        params = fused_params(optimizer)
        stock = _sequence_dmp(GPU_KERNELS, world, ranks.stock_sharder(params, sequence=True))
        model = _sequence_dmp(GPU_KERNELS, world,
                              TieredEmbeddingCollectionSharder(fused_params=ours_params(params, backend="triton")))
        _sequence_steps_equal(stock, model, rank, optimizer)


def _pipeline_layout(world: int) -> dict:
    """Cached tables for the prefetch pipeline's scenarios: on one rank table-wise with one HBM table; on two,
    PLANS' mixed plan (HBM, managed and cached tables; table-, row-, table-row- and column-wise)."""
    if world > 1:
        return dict(PLANS["mixed"])
    layout = {name: ("tw0", "fused_uvm_caching") for name, _, _ in ranks.TABLES}
    layout["t1"] = ("tw0", "fused")
    return layout


def prefetch_pipeline_equals_serial(rank, world):
    """PrefetchTrainPipelineSparseDist (our prefetch on TorchRec's prefetch stream, a batch ahead) trains
    fused_uvm_caching tables bitwise as a plain serial loop does, and is stopped early (a batch prefetched,
    never trained); evaluation batches through a new pipeline under no_grad then leave no slot locked once
    their deferred unlocks have run (at the next prefetch or forward, here called directly), however many
    there are, and the batch the training pipeline left is released."""
    from torchrec.distributed.train_pipeline import PrefetchTrainPipelineSparseDist

    from tiered_tbe import CacheConfig

    layout = _pipeline_layout(world)
    steps = 12
    # More slots than the cached tables' 90 rows: a leak would show as locks piling up.
    params = ours_params(fused_params(), backend="triton") | dict(cache_config=CacheConfig(slots=128, associativity=8))
    serial, serial_optimizer = ranks.click_dmp(layout, world, ranks.ours_sharder(params))
    model, optimizer = ranks.click_dmp(layout, world, ranks.ours_sharder(params))
    model.load_state_dict(serial.state_dict())
    for batch in ranks.click_batches(rank, steps):
        serial_optimizer.zero_grad()
        loss, _ = serial(batch.to(ranks.DEVICE))
        loss.backward()
        serial_optimizer.step()
    pipeline = PrefetchTrainPipelineSparseDist(model, optimizer, ranks.DEVICE)
    batches = iter(ranks.click_batches(rank, steps + 2))  # stopped early: a batch stays prefetched, untrained
    for _ in range(steps):
        pipeline.progress(batches)
    torch.cuda.synchronize()
    ranks.assert_states_close(serial, model, exact=True)

    pipeline.detach()
    cached = [m for m in model.module.ebc.tiered_modules() if m.cache is not None]
    model.eval()
    with torch.no_grad():
        evaluation = PrefetchTrainPipelineSparseDist(model, optimizer, ranks.DEVICE)
        batches = iter(ranks.click_batches(rank, 3 * steps, seed=1))
        for _ in range(3 * steps):
            evaluation.progress(batches)
            # At most two batches hold locks (the one evaluated, the one prefetched): 27 rows each at most
            # of every rank's batch (row-wise shards take lookups of every rank).
            assert all(m.cache.num_locked() <= 2 * 27 * world for m in cached)
        evaluation.detach()
    for m in cached:
        m.run_deferred_unlocks()
    torch.cuda.synchronize()
    assert all(m.cache.num_locked() == 0 and not m._prefetched for m in cached)


def prefetch_pipeline_equals_fbgemm(rank, world, steps: int = 20):
    """Under PrefetchTrainPipelineSparseDist on GPUs, our sharder (Triton kernels, a cache of 4 slots a rank's
    group: heavy eviction) and TorchRec's own (FBGEMM's CUDA TBE, ``prefetch_pipeline=True``) train the same
    plan on the same batches: every step's logits, then the weights and the fused optimizer's state, within
    1e-5."""
    from torchrec.distributed.train_pipeline import PrefetchTrainPipelineSparseDist

    layout = _pipeline_layout(world)
    params = fused_params(prefetch_pipeline=True)
    stock, stock_optimizer = ranks.click_dmp(layout, world, ranks.stock_sharder(params))
    model, optimizer = ranks.click_dmp(layout, world, ranks.ours_sharder(ours_params(params, backend="triton")))
    model.load_state_dict(stock.state_dict())
    pipelines = [PrefetchTrainPipelineSparseDist(m, o, ranks.DEVICE)
                 for m, o in ((stock, stock_optimizer), (model, optimizer))]
    batches = [iter(ranks.click_batches(rank, steps + 2)) for _ in pipelines]
    for step in range(steps):
        # progress() runs the model's (loss, logits), backward on the loss, and returns the logits.
        expected, actual = (pipeline.progress(b) for pipeline, b in zip(pipelines, batches))
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5, msg=lambda m, s=step: f"step {s}: {m}")
    for pipeline in pipelines:
        pipeline.detach()
    torch.cuda.synchronize()
    ranks.assert_states_close(stock, model)
