"""The configurations ``bench_fbgemm`` measures, ours beside FBGEMM_GPU's, and their targets.

One :class:`Config` a side-by-side measurement (table shapes, batch, lookups, optimizer, weights
dtype, placement and cache); ``CONFIGS`` lists them by name (``tiered-tbe bench fbgemm --list``).
"""

from __future__ import annotations

import dataclasses

from tiered_tbe.pipeline import DEFAULT_LOOKAHEAD
from tiered_tbe.traces import CRITEO_KAGGLE_TABLE_ROWS

HYPER = {"sgd": dict(lr=0.01), "rowwise_adagrad": dict(lr=0.01, eps=1e-8), "adam": dict(lr=0.001, eps=1e-8)}
# ours / FBGEMM at most (issue 10, 11): steps and backwards 0.9, forwards 1.0, Adam 0.7, cached steps 0.8.
TARGETS = {"forward": 1.0, "backward": 0.9, "step": 0.9}
PROFILED_STEPS = 5  # steps run under torch.profiler with --profile (after the timed ones)
PROFILED_KERNELS = 8  # kernels listed per side


@dataclasses.dataclass(frozen=True)
class Config:
    """One side-by-side measurement."""

    name: str
    tables: tuple[int, ...]  # rows of each table
    dim: int = 128
    batch_size: int = 65536
    bag_size: int = 1
    alpha: float = 1.05  # Zipf exponent, 0 = uniform
    optimizer: str = "rowwise_adagrad"
    dtype: str = "fp32"
    placement: str = "device"  # device, host_cached, managed_cached
    policy: str = "lru"
    pipelined: bool = False
    cache_fraction: float = 0.05
    state_layout: str = "separate"  # ours: TieredEmbeddingBags(state_layout=...); FBGEMM has one layout

    @property
    def lookahead_window(self) -> int:
        """Batches after the one prefetched whose rows a lookahead cache is told (the pipeline's
        default); 0 for the other policies."""
        return DEFAULT_LOOKAHEAD if self.cached and self.policy == "lookahead" else 0

    @property
    def cached(self) -> bool:
        return self.placement != "device"

    def target(self, phase: str) -> float:
        if self.cached:  # the cached targets are against other rows' steps (cached_targets_of)
            return float("nan")
        if self.optimizer == "adam" and phase != "forward":
            return 0.7
        return TARGETS[phase]


CRITEO = tuple(CRITEO_KAGGLE_TABLE_ROWS)
BIG = (20_000_000,)
CONFIGS = [
    Config("criteo-adagrad", CRITEO),
    Config("criteo-adagrad-z1.2", CRITEO, alpha=1.2),
    Config("criteo-adagrad-fp16", CRITEO, dtype="fp16"),
    Config("criteo-sgd", CRITEO, optimizer="sgd"),
    Config("criteo-adam", CRITEO, optimizer="adam"),
    Config("big-uniform-sgd", BIG, bag_size=32, alpha=0.0, optimizer="sgd"),
    Config("big-uniform-adagrad", BIG, bag_size=32, alpha=0.0),
    Config("big-zipf-sgd", BIG, bag_size=32, optimizer="sgd"),
    Config("big-zipf-adagrad", BIG, bag_size=32),
    Config("big-zipf-adagrad-fp16", BIG, bag_size=32, dtype="fp16"),
    Config("cached-lru", CRITEO, placement="host_cached"),
    Config("cached-lfu", CRITEO, placement="host_cached", policy="lfu"),
    Config("cached-lru-z1.2", CRITEO, placement="host_cached", alpha=1.2),
    Config("cached-lfu-z1.2", CRITEO, placement="host_cached", policy="lfu", alpha=1.2),
    Config("cached-managed-lru", CRITEO, placement="managed_cached"),
    Config("cached-managed-lfu", CRITEO, placement="managed_cached", policy="lfu"),
    Config("cached-managed-lru-z1.2", CRITEO, placement="managed_cached", alpha=1.2),
    Config("cached-managed-lfu-z1.2", CRITEO, placement="managed_cached", policy="lfu", alpha=1.2),
    Config("cached-managed-lru-pipelined", CRITEO, placement="managed_cached", pipelined=True),
    # A lookahead cache is told the rows of the batches ahead (by the pipeline, or serially by
    # hint_upcoming before each prefetch): it moves ~0.64 of LRU's rows (RESULTS.md), and the
    # cached prefetch is bound by the bytes it moves. FBGEMM has no lookahead: its side runs LRU.
    Config("cached-managed-lookahead", CRITEO, placement="managed_cached", policy="lookahead"),
    Config("cached-managed-lookahead-z1.2", CRITEO, placement="managed_cached", policy="lookahead", alpha=1.2),
    Config("cached-managed-lookahead-pipelined", CRITEO, placement="managed_cached", policy="lookahead",
           pipelined=True),
    Config("cached-managed-lookahead-pipelined-z1.2", CRITEO, placement="managed_cached", policy="lookahead",
           pipelined=True, alpha=1.2),
    Config("cached-managed-lru-pipelined-z1.2", CRITEO, placement="managed_cached", pipelined=True, alpha=1.2),
    Config("cached-managed-lru-with-rows", CRITEO, placement="managed_cached", state_layout="with_rows"),
    Config("criteo-adagrad-with-rows", CRITEO, state_layout="with_rows"),
    Config("cached-lru-pipelined", CRITEO, placement="host_cached", pipelined=True),
]
CONFIG_NAMES = [c.name for c in CONFIGS]
# Keys of a result row holding a tuning sweep's measurement (--backward-configs, --forward-tiles).
SWEEP_PREFIXES = ("ours backward ", "ours forward ")
SIMULATION_SHAPE = dict(tables=(50, 7, 300), dim=8, batch_size=8)
