"""tiered-tbe: table-batched embedding bags for tables larger than GPU memory."""

from tiered_tbe._mode import SIMULATION, default_device, describe_mode  # first: picks the kernel mode
from tiered_tbe.cache.stats import CacheStats
from tiered_tbe.module import TieredEmbeddingBags
from tiered_tbe.optimizers import SGD, Adam, RowwiseAdagrad
from tiered_tbe.pipeline import PrefetchPipeline
from tiered_tbe.specs import CacheConfig, Placement, TableSpec

__all__ = [
    "SIMULATION", "default_device", "describe_mode",
    "CacheStats", "TieredEmbeddingBags", "PrefetchPipeline",
    "SGD", "Adam", "RowwiseAdagrad",
    "CacheConfig", "Placement", "TableSpec",
]
