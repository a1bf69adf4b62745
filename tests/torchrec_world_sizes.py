"""Across world sizes: what 2 ranks train equals what 1 rank trains on the same global batches.

Each step, rank ``r`` of the 2-rank job trains on ``ranks.batch(step, r)``; the 1-rank job trains on both
ranks' bags of each feature put together (rank 0's samples, then rank 1's), with the same loss weights per
sample, divided by the world size: TorchRec's all-to-all divides the gradients it carries back by the
world size (``torchrec.distributed.comm_ops``' gradient division, on by default), so a 2-rank job trains
as one rank would on the mean of the ranks' losses, as DDP's averaged gradients do. Each sample's gradient
then reaches the rows it looked up at the same scale whatever the world size, so the pooled outputs of
every step and the final weights and optimizer state agree (within 1e-5: the sums of a row's gradients are
taken in another order). Each plan runs on both world sizes with the same kinds of shards:
a table placed table-wise on rank 1 goes to rank 0 in the 1-rank job; column-wise tables keep their two
column shards (their row-wise optimizer state is one per column shard).

``train_on_two_ranks`` writes, from rank 0, each plan's initial weights, every step's outputs and the final
state to ``directory``; ``train_on_one_rank`` then loads the initial weights and checks against them.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torchrec_ranks as ranks
import torchrec_scenarios as scenarios

PLANS = scenarios.PLANS  # table-wise, row-wise, column-wise, table-row-wise, mixed, every table cached


def on_one_rank(layout: dict) -> dict:
    """``layout`` for a 1-rank job: every table-wise table on rank 0, the other kinds of shards kept."""
    return {name: (("tw0" if sharding.startswith("tw") and sharding != "twrw" else sharding), kernel)
            for name, (sharding, kernel) in layout.items()}


def global_batch(step: int, world: int):
    """The KeyedJaggedTensor of every rank's samples of ``step``: per feature, rank 0's bags, then rank 1's."""
    from torchrec import KeyedJaggedTensor

    local = [ranks.batch(step, r) for r in range(world)]
    values, lengths = [], []
    for key in local[0].keys():
        for kjt in local:
            values.append(kjt[key].values())
            lengths.append(kjt[key].lengths())
    return KeyedJaggedTensor.from_lengths_sync(keys=local[0].keys(), values=torch.cat(values),
                                               lengths=torch.cat(lengths))


def global_train_step(model, step: int, world: int) -> torch.Tensor:
    """``ranks.train_step`` on the global batch of ``step``: each sample weighted as on its own rank, the
    loss divided by ``world`` (the mean of the ranks' losses; see the module's docstring)."""
    kjt = global_batch(step, world)
    pooled = model(kjt.to(ranks.DEVICE))
    pooled = pooled.wait() if hasattr(pooled, "wait") else pooled
    by_feature = pooled.to_dict()
    values = torch.cat([by_feature[key] for key in kjt.keys()], dim=1)
    per_rank = values.shape[0] // world
    weights = torch.cat([ranks.loss_weights(step, r, (per_rank, values.shape[1])) for r in range(world)])
    ((values * weights.to(ranks.DEVICE)).sum() / world).backward()
    return values.detach().cpu()


def _params(backend: str) -> dict:
    return scenarios.ours_params(scenarios.fused_params(), backend=backend)


def train_on_two_ranks(rank: int, world: int, directory: str, steps: int, backend: str) -> None:
    for name, layout in PLANS.items():
        model = ranks.dmp(layout, world, ranks.ours_sharder(_params(backend)))
        initial = scenarios.full_state(model)
        outputs = [ranks.train_step(model, ranks.batch(step, rank), step, rank).cpu() for step in range(steps)]
        everyone = [None] * world
        dist.all_gather_object(everyone, outputs)
        final = scenarios.full_state(model)
        if rank == 0:
            torch.save(dict(initial=initial, outputs=everyone, final=final), os.path.join(directory, f"{name}.pt"))
        dist.barrier()


def train_on_one_rank(rank: int, world: int, directory: str, steps: int, backend: str, saved_world: int = 2) -> None:
    for name, layout in PLANS.items():
        saved = torch.load(os.path.join(directory, f"{name}.pt"))
        model = ranks.dmp(on_one_rank(layout), world, ranks.ours_sharder(_params(backend)))
        ranks.load_full_weights(model, {table: saved["initial"][f"model.embedding_bags.{table}.weight"]
                                        for table, _, _ in ranks.TABLES})
        for step in range(steps):
            expected = torch.cat([outputs[step] for outputs in saved["outputs"]])
            torch.testing.assert_close(global_train_step(model, step, saved_world), expected, rtol=0, atol=1e-5,
                                       msg=lambda m, s=step, n=name: f"{n} step {s}: {m}")
        final = scenarios.full_state(model)
        assert final.keys() == saved["final"].keys(), (name, sorted(final), sorted(saved["final"]))
        for key, value in saved["final"].items():
            torch.testing.assert_close(final[key], value, rtol=0, atol=1e-5,
                                       msg=lambda m, k=key, n=name: f"{n} {k}: {m}")
