"""The models the benchmarks train: the tables of ``bench cache`` and the small DLRM of ``bench pipeline``.

- :func:`build_module`: the benchmark's embedding layer (one table per entry of the rows given,
  row-wise Adagrad, a placement and a cache), shared by ``bench cache``, ``bench pipeline`` and
  the developer tools that profile them;
- :class:`SmallDLRM` and :func:`make_batches`: a bottom MLP over dense features, the pooled
  embeddings, DLRM's pairwise dot interactions and a top MLP, and its batches
  ``(indices, offsets, dense, labels)``;
- :func:`add_dlrm_flags`, :func:`check_dlrm_args`: its ``--bottom-mlp --top-mlp --dense-precision``.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from torch import nn

from tiered_tbe.base.mode import default_device  # first: picks GPU / simulation mode
from tiered_tbe.benchmarks import common, sampling
from tiered_tbe.module import TieredEmbeddingBags
from tiered_tbe.optimizers import RowwiseAdagrad
from tiered_tbe.specs import CacheConfig, Placement, TableSpec

NUM_DENSE = 13  # dense features of a sample (Criteo's)


def build_module(table_rows, dim, placement: Placement, cache: CacheConfig | None, args,
                 mover: str | None = None) -> TieredEmbeddingBags:
    """The benchmark's model: one table per entry of ``table_rows``, row-wise Adagrad; ``mover``
    (with a cache) overrides its ``CacheConfig.mover``, and ``args.mover_threads`` /
    ``args.staging_rows`` (when present and set) the staged mover's settings."""
    if cache is not None:
        settings = {"mover": mover} if mover is not None else {}
        for name in ("mover_threads", "staging_rows"):
            if getattr(args, name, None) is not None:
                settings[name] = getattr(args, name)
        cache = dataclasses.replace(cache, **settings)
    tables = [TableSpec(n, dim, name=f"C{t + 1}", placement=placement) for t, n in enumerate(table_rows)]
    return TieredEmbeddingBags(tables, optimizer=RowwiseAdagrad(lr=0.05, eps=1e-8), cache=cache,
                               weights_dtype=common.DTYPES[args.dtype], device=default_device(),
                               bounds_check=args.bounds_check, seed=args.seed)


def add_dlrm_flags(parser: argparse.ArgumentParser) -> None:
    """``--bottom-mlp --top-mlp --dense-precision``: the dense part of :class:`SmallDLRM`."""
    group = parser.add_argument_group("dense model")
    group.add_argument("--bottom-mlp", default="512,256",
                       help="hidden widths of the bottom MLP, then dim (default 512,256)")
    group.add_argument("--top-mlp", default="512,256", help="hidden widths of the top MLP, then 1 (default 512,256)")
    group.add_argument("--dense-precision", default="tf32", choices=["tf32", "fp32"],
                       help="matmuls of the dense MLPs on a GPU (default tf32, as DLRM training on Hopper)")


def check_dlrm_args(args: argparse.Namespace) -> None:
    """``--bottom-mlp`` and ``--top-mlp`` as lists of widths; ``ValueError`` if they are not integers."""
    try:
        if isinstance(args.bottom_mlp, str):
            args.bottom_mlp = [int(w) for w in args.bottom_mlp.split(",") if w]
        if isinstance(args.top_mlp, str):
            args.top_mlp = [int(w) for w in args.top_mlp.split(",") if w]
    except ValueError:
        raise ValueError("--bottom-mlp and --top-mlp take comma-separated integers, e.g. 512,256") from None


def mlp(widths: list[int], last_relu: bool) -> nn.Sequential:
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(fan_in, fan_out))
        if last_relu or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class SmallDLRM(nn.Module):
    """bottom MLP(dense) and the T pooled embeddings -> pairwise dots (DLRM's interaction) -> top MLP -> logit [B]."""

    def __init__(self, embeddings, num_tables: int, dim: int, bottom: list[int], top: list[int]):
        super().__init__()
        self.embeddings = embeddings
        self.num_tables, self.dim = num_tables, dim
        self.bottom = mlp([NUM_DENSE, *bottom, dim], last_relu=True)
        features = num_tables + 1
        self.register_buffer("pairs", torch.triu_indices(features, features, offset=1), persistent=False)
        self.top = mlp([dim + features * (features - 1) // 2, *top, 1], last_relu=False)

    def forward(self, indices, offsets, dense) -> torch.Tensor:
        pooled = self.embeddings(indices, offsets)  # [B, T * dim]
        bottom = self.bottom(dense)
        features = torch.cat([bottom.unsqueeze(1), pooled.view(-1, self.num_tables, self.dim)], dim=1)
        dots = torch.bmm(features, features.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([bottom, dots], dim=1)).squeeze(1)


def make_batches(table_rows, alpha, args, device) -> list[tuple[torch.Tensor, ...]]:
    """``warmup + batches + depth + lookahead`` batches ``(indices, offsets, dense, labels)`` on
    the device: the pipeline keeps ``depth`` batches prefetched and ``lookahead`` more pulled
    ahead of the last timed step."""
    count = args.warmup + args.batches + args.depth + args.lookahead
    lookups = sampling.ZipfBatches(table_rows, alpha, args.batch_size, args.bag_size, device, seed=args.seed)
    generator = torch.Generator(device=device).manual_seed(args.seed + 1)
    batches = []
    for _ in range(count):
        indices, offsets = lookups.next()
        dense = torch.randn(args.batch_size, NUM_DENSE, device=device, generator=generator)
        labels = (torch.rand(args.batch_size, device=device, generator=generator) < 0.25).float()
        batches.append((indices, offsets, dense, labels))
    return batches
