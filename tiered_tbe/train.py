"""The main job: train a small DLRM-style click model whose embedding tables are tiered.

A dense MLP ("bottom") embeds the dense features, :class:`TieredEmbeddingBags` pools one bag
per table, and a top MLP turns their concatenation into a click logit. Clicks come from a
hidden ground truth (a fixed score per row plus a linear function of the dense features), so
the loss falls as the tables learn the row scores. On a GPU the tables sit in pinned host
memory behind the slot cache; without one, the same code runs in CPU simulation mode at a
small size.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from tiered_tbe.base.mode import SIMULATION, default_device, describe_mode
from tiered_tbe.module import TieredEmbeddingBags
from tiered_tbe.optimizers import RowwiseAdagrad
from tiered_tbe.specs import CacheConfig, Placement, TableSpec
from tiered_tbe.traces import zipf_sampler


@dataclass
class ClickBatch:
    dense: torch.Tensor  # fp32 [B, num_dense]
    indices: torch.Tensor  # int64 [N]
    offsets: torch.Tensor  # int64 [T*B+1]
    labels: torch.Tensor  # fp32 [B], 0 or 1


class SyntheticClicks:
    """Seeded click batches: Zipf lookups, ``bag_size`` per table per sample, labels from a hidden truth."""

    def __init__(self, tables: list[TableSpec], batch_size: int, bag_size: int, alpha: float,
                 num_dense: int, device: torch.device, seed: int = 0):
        self.tables, self.batch_size, self.bag_size = tables, batch_size, bag_size
        self.num_dense, self.device = num_dense, device
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.samplers = [zipf_sampler(t.num_embeddings, alpha, seed=seed + i) for i, t in enumerate(tables)]
        self.dense_truth = torch.randn(num_dense, generator=self.generator) / math.sqrt(num_dense)
        self.row_offset = torch.tensor([0] + [t.num_embeddings for t in tables]).cumsum(0)[:-1]

    def __iter__(self) -> Iterator[ClickBatch]:
        while True:
            yield self.next_batch()

    def next_batch(self) -> ClickBatch:
        B, L, T = self.batch_size, self.bag_size, len(self.tables)
        rows = torch.stack([torch.from_numpy(s(B * L)) for s in self.samplers])  # [T, B*L]
        dense = torch.randn(B, self.num_dense, generator=self.generator)
        # The hidden score of a row: a fixed pseudo-random value in [-1, 1] per global row id.
        global_rows = (rows + self.row_offset[:, None]).double()
        row_score = torch.sin(global_rows * 12.9898 + 78.233).float().view(T, B, L).sum(dim=(0, 2))
        logit = row_score / math.sqrt(T * L) * 3 + dense @ self.dense_truth
        labels = torch.bernoulli(torch.sigmoid(logit), generator=self.generator)
        offsets = torch.arange(0, T * B * L + 1, L, dtype=torch.int64)
        to = dict(device=self.device, non_blocking=True)
        return ClickBatch(dense.to(**to), rows.reshape(-1).to(**to), offsets.to(**to), labels.to(**to))


class TinyDLRM(nn.Module):
    """bottom MLP(dense) ‖ pooled embeddings -> top MLP -> click logit [B]."""

    def __init__(self, embeddings: TieredEmbeddingBags, num_dense: int, hidden: int = 64):
        super().__init__()
        total_dim = sum(t.embedding_dim for t in embeddings.tables)
        self.bottom = nn.Sequential(nn.Linear(num_dense, hidden), nn.ReLU())
        self.embeddings = embeddings
        self.top = nn.Sequential(nn.Linear(hidden + total_dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, batch: ClickBatch) -> torch.Tensor:
        pooled = self.embeddings(batch.indices, batch.offsets)
        return self.top(torch.cat([self.bottom(batch.dense), pooled], dim=1)).squeeze(1)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="tiered-tbe train", description=__doc__)
    small = SIMULATION
    parser.add_argument("--tables", type=int, default=4 if small else 8, help="number of embedding tables")
    parser.add_argument("--rows", type=int, default=500 if small else 2_000_000, help="rows per table")
    parser.add_argument("--dim", type=int, default=8 if small else 64, help="embedding dim")
    parser.add_argument("--batch-size", type=int, default=32 if small else 8192)
    parser.add_argument("--bag-size", type=int, default=2 if small else 8, help="lookups per table per sample")
    parser.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the lookups")
    parser.add_argument("--steps", type=int, default=40 if small else 300)
    parser.add_argument("--placement", default="host_cached", choices=[p.value for p in Placement])
    parser.add_argument("--cache-fraction", type=float, default=0.05, help="slot cache size, fraction of rows")
    parser.add_argument("--policy", default="lru", choices=["lru", "lfu", "lookahead"])
    parser.add_argument("--pipeline-depth", type=int, default=0,
                        help="prefetch this many batches ahead on a side stream (0: prefetch in forward)")
    parser.add_argument("--lr", type=float, default=0.2, help="row-wise Adagrad learning rate of the tables")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def run(args: argparse.Namespace) -> dict:
    """Train; return the final loss, hit rate and throughput."""
    torch.manual_seed(args.seed)
    device = default_device()
    print(f"tiered-tbe train: {describe_mode()}")
    placement = Placement(args.placement)
    tables = [TableSpec(args.rows, args.dim, name=f"t{t}", placement=placement) for t in range(args.tables)]
    cache = CacheConfig(fraction=args.cache_fraction, policy=args.policy) if placement.is_cached else None
    embeddings = TieredEmbeddingBags(tables, optimizer=RowwiseAdagrad(lr=args.lr), cache=cache, device=device,
                                     seed=args.seed)
    num_dense = 13
    model = TinyDLRM(embeddings, num_dense).to(device)
    dense_optimizer = torch.optim.Adam([p for p in model.parameters()], lr=1e-3)
    data = SyntheticClicks(tables, args.batch_size, args.bag_size, args.alpha, num_dense, device, args.seed)
    batches = (data.next_batch() for _ in range(args.steps))
    if args.pipeline_depth > 0:
        from tiered_tbe.pipeline import PrefetchPipeline

        batches = PrefetchPipeline(model, batches, depth=args.pipeline_depth,
                                   lookups=lambda b: {"embeddings": (b.indices, b.offsets)})
    loss_fn = nn.BCEWithLogitsLoss()
    smoothed_loss = first_loss = None
    start = time.perf_counter()
    samples = 0
    progress = tqdm(batches, total=args.steps, unit="batch", dynamic_ncols=True)
    for step, batch in enumerate(progress):
        loss = loss_fn(model(batch), batch.labels)
        dense_optimizer.zero_grad(set_to_none=True)
        loss.backward()  # the embedding tables update here, fused
        dense_optimizer.step()
        samples += args.batch_size
        if step % 5 == 0 or step == args.steps - 1:
            value = loss.item()
            first_loss = value if first_loss is None else first_loss
            smoothed_loss = value if smoothed_loss is None else 0.8 * smoothed_loss + 0.2 * value
            rate = samples / (time.perf_counter() - start)
            hit_rate = embeddings.cache_stats().hit_rate_by_lookup if embeddings.cache else 1.0
            progress.set_postfix(loss=f"{smoothed_loss:.4f}", hit_rate=f"{hit_rate:.3f}", samples_s=f"{rate:,.0f}")
    progress.close()
    elapsed = time.perf_counter() - start
    stats = embeddings.cache_stats()
    result = dict(first_loss=first_loss, final_loss=smoothed_loss, samples_per_s=samples / elapsed,
                  hit_rate=stats.hit_rate_by_lookup if embeddings.cache else 1.0, steps=args.steps)
    print(f"loss {first_loss:.4f} -> {smoothed_loss:.4f} over {args.steps} steps; "
          f"{result['samples_per_s']:,.0f} samples/s; cache hit rate (by lookup) {result['hit_rate']:.3f}")
    if SIMULATION:
        print("(simulation mode: throughput is of the CPU interpreter, not of any GPU)")
    return result


def main(argv: list[str] | None = None) -> None:
    run(build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
