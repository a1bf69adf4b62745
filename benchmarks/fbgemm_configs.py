"""The configurations ``bench fbgemm`` measures, ours beside FBGEMM_GPU's.

One :class:`Config` a side-by-side measurement (table shapes and dims, batch, lookups, bag
lengths, per-sample weights, optimizer, weights dtype, placement and cache); ``CONFIGS`` lists
them by name (``tiered-tbe bench fbgemm --list``).
"""

from __future__ import annotations

import dataclasses

from tiered_tbe.cache.hints import DEFAULT_LOOKAHEAD
from tiered_tbe.cache.policy import policy_named
from tiered_tbe.traces import CRITEO_KAGGLE_TABLE_ROWS

HYPER = {"sgd": dict(lr=0.01), "rowwise_adagrad": dict(lr=0.01, eps=1e-8), "adam": dict(lr=0.001, eps=1e-8)}
PROFILED_STEPS = 5  # steps run under torch.profiler with --profile (after the timed ones)
PROFILED_KERNELS = 6  # kernels listed per side and phase (a record holds them all)


@dataclasses.dataclass(frozen=True)
class Config:
    """One side-by-side measurement.

    ``dim`` is one dim for every table or one per table (FBGEMM's TBE takes a dim per table,
    each a multiple of 4). ``bag_lengths`` (``sampling.BAG_LENGTHS``): every bag ``bag_size``
    lookups (``"fixed"``), each bag's length drawn in ``0..bag_size`` (``"per_bag"``), or one
    length per table and batch in ``1..bag_size`` (``"per_batch"``). ``weighted``: per-sample
    weights on both sides. ``min_batch_size``: each batch's size drawn in
    ``min_batch_size..batch_size`` (None: every batch ``batch_size``). ``fbgemm_fails``: why
    FBGEMM's side is left out (a failure on the device would end the whole run); ours still runs.
    """

    name: str
    tables: tuple[int, ...]  # rows of each table
    dim: int | tuple[int, ...] = 128
    batch_size: int = 65536
    bag_size: int = 1
    alpha: float = 1.05  # Zipf exponent, 0 = uniform
    optimizer: str = "rowwise_adagrad"
    dtype: str = "fp32"
    placement: str = "device"  # device, managed (every row read and updated in place), host_cached, managed_cached
    policy: str = "lru"
    pipelined: bool = False
    cache_fraction: float = 0.05
    state_layout: str = "auto"  # ours: TieredEmbeddingBags(state_layout=...); FBGEMM has one layout
    bag_lengths: str = "fixed"
    weighted: bool = False
    min_batch_size: int | None = None
    # Why FBGEMM's side is not run (it fails on the device, which ends the process), or None.
    fbgemm_fails: str | None = None
    # Batches after the one prefetched whose rows a policy that reads the window is told (None: the default).
    window: int | None = None

    def __post_init__(self):
        if isinstance(self.dim, tuple) and len(self.dim) != len(self.tables):
            raise ValueError(f"{self.name}: {len(self.dim)} dims for {len(self.tables)} tables")

    @property
    def dims(self) -> tuple[int, ...]:
        """The dim of each table."""
        return self.dim if isinstance(self.dim, tuple) else (self.dim,) * len(self.tables)

    @property
    def total_dim(self) -> int:
        """Columns of the pooled output ``[B, total_dim]``."""
        return sum(self.dims)

    @property
    def lookahead_window(self) -> int:
        """Batches after the one prefetched whose rows a lookahead cache is told (``window``, else the
        pipeline's default); 0 for the other policies."""
        if not (self.cached and policy_named(self.policy).reads_window):
            return 0
        return self.window if self.window is not None else DEFAULT_LOOKAHEAD

    @property
    def cached(self) -> bool:
        return self.placement.endswith("_cached")

    @property
    def shape(self) -> tuple:
        """What a serial configuration shares with its pipelined twin and its other policies: the
        tables, dims, batches and optimizer (the baselines a cached step is compared with)."""
        return (self.tables, self.dims, self.batch_size, self.bag_size, self.bag_lengths, self.weighted,
                self.min_batch_size, self.alpha, self.optimizer, self.dtype, self.cache_fraction)

    def describe(self) -> str:
        """One line: ``26 tables (33,762,577 rows) x 128 fp32, B=65536, L=1, zipf 1.05, ...``."""
        dims = sorted(set(self.dims))
        dim = str(dims[0]) if len(dims) == 1 else f"dims {dims[0]}-{dims[-1]}"
        batch = f"B={self.batch_size}" if self.min_batch_size is None else f"B={self.min_batch_size}-{self.batch_size}"
        bags = {"fixed": f"L={self.bag_size}", "per_bag": f"L=0-{self.bag_size} per bag",
                "per_batch": f"L=1-{self.bag_size} per batch"}[self.bag_lengths]
        return (f"{len(self.tables)} tables ({sum(self.tables):,} rows) x {dim} {self.dtype}, {batch}, {bags}"
                + (", weighted" if self.weighted else "") + f", zipf {self.alpha:g}, {self.optimizer}, "
                f"{self.placement}" + (f" {self.policy} {self.cache_fraction:g}" if self.cached else "")
                + (", pipelined" if self.pipelined else ""))

    def as_record(self) -> dict:
        """The configuration as a record names it (``tiered_tbe.records``)."""
        return dict(name=self.name, tables=len(self.tables), rows=sum(self.tables), table_rows=list(self.tables),
                    dims=list(self.dims), batch_size=self.batch_size, min_batch_size=self.min_batch_size,
                    bag_size=self.bag_size, bag_lengths=self.bag_lengths, weighted=self.weighted, alpha=self.alpha,
                    optimizer=self.optimizer, dtype=self.dtype, placement=self.placement,
                    policy=self.policy if self.cached else None, pipelined=self.pipelined,
                    cache_fraction=self.cache_fraction if self.cached else None, state_layout=self.state_layout,
                    **({"lookahead_window": self.lookahead_window} if self.lookahead_window else {}))


CRITEO = tuple(CRITEO_KAGGLE_TABLE_ROWS)
BIG = (20_000_000,)
# 12 tables of dims 8 to 256, 64M rows in all (~18 GB of fp32 weights): more rows where rows are narrow.
MIXED = (9_000_000, 8_000_000, 7_000_000, 7_000_000, 6_000_000, 6_000_000, 5_000_000, 5_000_000, 4_000_000,
         3_000_000, 2_000_000, 2_000_000)
MIXED_DIMS = (8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# 8 tables of dims that are no power of two (FBGEMM takes multiples of 4), 40M rows.
ODD = (8_000_000, 7_000_000, 6_000_000, 5_000_000, 5_000_000, 4_000_000, 3_000_000, 2_000_000)
ODD_DIMS = (4, 12, 20, 36, 52, 76, 100, 132)
# The same tables at dims rounded up to powers of two: the column tiles our forward gives ODD_DIMS.
POW2_DIMS = (4, 16, 32, 64, 64, 128, 128, 256)
# The Criteo tables with dims growing with their rows (16 up to 128: small tables need few columns).
CRITEO_DIMS = tuple(16 if n < 1_000 else 32 if n < 100_000 else 64 if n < 1_000_000 else 128 for n in CRITEO)

_MIXED = dict(tables=MIXED, dim=MIXED_DIMS, batch_size=16384, bag_size=40, bag_lengths="per_bag", weighted=True,
              placement="managed_cached", cache_fraction=0.1)
_BAG20 = dict(_MIXED, bag_size=20, bag_lengths="fixed")
_Z06_PIPELINE = "FBGEMM_GPU 1.6.0's prefetch_pipeline hit an illegal memory access on this shape (H200)"
_ODD = dict(tables=ODD, dim=ODD_DIMS, batch_size=16384, min_batch_size=8192, bag_size=30, bag_lengths="per_batch",
            weighted=True, placement="managed_cached", cache_fraction=0.1)
_CRITEO_MIXED = dict(tables=CRITEO, dim=CRITEO_DIMS, bag_size=4, bag_lengths="per_bag", weighted=True,
                     placement="managed_cached")

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
    Config("cached-managed-lfu-admit", CRITEO, placement="managed_cached", policy="lfu-admit"),
    Config("cached-managed-lru-z1.2", CRITEO, placement="managed_cached", alpha=1.2),
    Config("cached-managed-lfu-z1.2", CRITEO, placement="managed_cached", policy="lfu", alpha=1.2),
    Config("cached-managed-lru-pipelined", CRITEO, placement="managed_cached", pipelined=True),
    # Admission by use counts moved 47K rows in and 2K out a batch here against LRU's 74K and 29K, and its
    # prefetch took 1.13 ms against 1.48 (H200, 0a567b6): pipelined, the prefetch stream is the longer one.
    # FBGEMM's side runs its LFU serially and pipelines its LRU (prefetch_pipeline takes LRU only).
    Config("cached-managed-lfu-admit-pipelined", CRITEO, placement="managed_cached", policy="lfu-admit",
           pipelined=True),
    Config("cached-managed-lfu-admit-z1.2", CRITEO, placement="managed_cached", policy="lfu-admit", alpha=1.2),
    Config("cached-managed-lfu-admit-pipelined-z1.2", CRITEO, placement="managed_cached", policy="lfu-admit",
           pipelined=True, alpha=1.2),
    # A lookahead cache is told the rows of the batches ahead (by the pipeline, or serially by
    # hint_upcoming before each prefetch): it moves fewer rows than LRU (docs/hit_rates.md), and
    # the cached prefetch is bound by the bytes it moves. FBGEMM has no lookahead: its side runs LRU.
    Config("cached-managed-lookahead", CRITEO, placement="managed_cached", policy="lookahead"),
    Config("cached-managed-lookahead-z1.2", CRITEO, placement="managed_cached", policy="lookahead", alpha=1.2),
    Config("cached-managed-lookahead-pipelined", CRITEO, placement="managed_cached", policy="lookahead",
           pipelined=True),
    Config("cached-managed-lookahead-pipelined-z1.2", CRITEO, placement="managed_cached", policy="lookahead",
           pipelined=True, alpha=1.2),
    Config("cached-managed-lru-pipelined-z1.2", CRITEO, placement="managed_cached", pipelined=True, alpha=1.2),
    # Belady's rule with bypass over the pipeline's 64-batch window: 0.75 of lfu-admit's rows crossing (simulator).
    Config("cached-managed-lookahead-admit-pipelined", CRITEO, placement="managed_cached", policy="lookahead-admit",
           pipelined=True),
    Config("cached-managed-lru-with-rows", CRITEO, placement="managed_cached", state_layout="with_rows"),
    Config("criteo-adagrad-with-rows", CRITEO, state_layout="with_rows"),
    Config("cached-lru-pipelined", CRITEO, placement="host_cached", pipelined=True),
    # Mixed dims, bags of varying length, per-sample weights: where the cache moves the most bytes.
    # In HBM, the kernels alone (the forward's column groups beside one launch: --forward-one-launch).
    Config("mixed-weighted", **dict(_MIXED, placement="device")),
    Config("cached-mixed-weighted", **_MIXED),
    Config("cached-mixed-weighted-lfu", **_MIXED, policy="lfu"),
    Config("cached-mixed-weighted-lfu-admit", **_MIXED, policy="lfu-admit"),
    Config("cached-mixed-weighted-pipelined", **_MIXED, pipelined=True),
    Config("cached-mixed-weighted-lfu-admit-pipelined", **_MIXED, policy="lfu-admit", pipelined=True),
    # Belady's rule with bypass over the window: the simulator on these batches crossed 0.84 of lfu-admit's rows
    # at a window of 16 batches and 0.76 at 64, moving 1.1-1.5x its few rows (docs/performance.md). FBGEMM's: LRU.
    Config("cached-mixed-weighted-lookahead-admit", **_MIXED, policy="lookahead-admit", window=16),
    Config("cached-mixed-weighted-lookahead-admit-pipelined", **_MIXED, policy="lookahead-admit", window=16,
           pipelined=True),
    Config("cached-mixed-weighted-lookahead-admit-w32-pipelined", **_MIXED, policy="lookahead-admit", window=32,
           pipelined=True),
    # The same in pinned host memory (FBGEMM's side: host-mapped, uvm_host_mapped), to choose its mover.
    Config("cached-pinned-mixed-weighted", **dict(_MIXED, placement="host_cached")),
    # The same rows drawn less skewed (Zipf 0.6): most of a batch's ~3.3M unique rows miss, ~2.35M rows (~0.9 GB)
    # move each way a batch, where Zipf 1.05 moves ~0.2M.
    Config("cached-mixed-weighted-z0.6", **_MIXED, alpha=0.6),
    Config("cached-mixed-weighted-z0.6-pipelined", **_MIXED, alpha=0.6, pipelined=True, fbgemm_fails=_Z06_PIPELINE),
    # Where most rows miss, the rows moved set the step (the copy kernel is ~80% of it), and the exact
    # simulator on these batches moves fewer rows with LFU (0.92 of LRU's) and lookahead (~0.77):
    # docs/hit_rates.md, "Where most rows miss".
    Config("cached-mixed-weighted-z0.6-lfu", **_MIXED, alpha=0.6, policy="lfu"),
    Config("cached-mixed-weighted-z0.6-lookahead", **_MIXED, alpha=0.6, policy="lookahead"),
    Config("cached-mixed-weighted-z0.6-lfu-admit", **_MIXED, alpha=0.6, policy="lfu-admit"),
    Config("cached-mixed-weighted-z0.6-lookahead-pipelined", **_MIXED, alpha=0.6, policy="lookahead", pipelined=True,
           fbgemm_fails=_Z06_PIPELINE),
    Config("cached-mixed-bag20", **_BAG20),
    Config("cached-mixed-bag20-pipelined", **_BAG20, pipelined=True),
    Config("cached-odd-dims-ragged", **_ODD),
    Config("cached-odd-dims-ragged-pipelined", **_ODD, pipelined=True),
    # The simulator on these batches: LFU moves 0.91 of LRU's rows, lookahead (8 batches) 0.86.
    Config("cached-odd-dims-ragged-lfu", **_ODD, policy="lfu"),
    # Admission by use counts (FBGEMM's side: its LFU, which admits the same way): the simulator on these
    # batches moves 0.20 of LRU's rows, and reads 9% of the lookups in place (docs/hit_rates.md).
    Config("cached-odd-dims-ragged-lfu-admit", **_ODD, policy="lfu-admit"),
    Config("cached-odd-dims-ragged-lfu-admit-pipelined", **_ODD, policy="lfu-admit", pipelined=True),
    # The simulator on these batches: 0.87 of lfu-admit's rows crossing at a window of 16 (docs/performance.md).
    Config("cached-odd-dims-ragged-lookahead-admit-pipelined", **_ODD, policy="lookahead-admit", window=16,
           pipelined=True),
    # The whole window (the simulator: 0.71 of lfu-admit's rows crossing at 64 batches against 0.87 at 16). A
    # batch's recording costs the same at any window length; it was what bound this pipeline, and since the hint's
    # kernels (kernels/hint_rows.py) and the bits' (cache/window_bits.py) it costs far less.
    Config("cached-odd-dims-ragged-lookahead-admit-w64-pipelined", **_ODD, policy="lookahead-admit", window=64,
           pipelined=True),
    Config("cached-odd-dims-ragged-lookahead", **_ODD, policy="lookahead"),
    Config("cached-odd-dims-ragged-lookahead-pipelined", **_ODD, policy="lookahead", pipelined=True),
    # The odd-dim shape in HBM, beside the same tables at POW2_DIMS: whether the column tiles of a power of two
    # (132 columns take a tile of 256) are what our forward loses on odd dims (0.257 ms against FBGEMM's 0.155
    # with every row in a slot, H200): if so, its time stays where FBGEMM's grows with the bytes.
    Config("odd-dims-ragged", **dict(_ODD, placement="device")),
    Config("pow2-dims-ragged", **dict(_ODD, placement="device", dim=POW2_DIMS)),
    # The odd-dim shape with no cache: every lookup read and updated in place in managed memory, ours
    # (MANAGED) beside FBGEMM's uncached UVM (EmbeddingLocation.MANAGED). What a cached step pays for the rows
    # an admitting policy leaves in place, kernel against kernel: on the cached shape with `lfu-admit` our
    # forward took 0.43 ms more than with every row in a slot, FBGEMM's LFU forward 0.22 (H200, 0a567b6).
    Config("managed-odd-dims-ragged", **dict(_ODD, placement="managed")),
    Config("managed-criteo", CRITEO, placement="managed"),
    Config("cached-criteo-mixed", **_CRITEO_MIXED),
    Config("cached-criteo-mixed-pipelined", **_CRITEO_MIXED, pipelined=True),
    # FBGEMM's LFU beside our admission on the same shape: its best serial step on the Criteo shape was its LFU.
    Config("cached-criteo-mixed-lfu-admit", **_CRITEO_MIXED, policy="lfu-admit"),
    Config("cached-criteo-mixed-lfu-admit-pipelined", **_CRITEO_MIXED, policy="lfu-admit", pipelined=True),
]
CONFIG_NAMES = [c.name for c in CONFIGS]
# Keys of a result row holding a tuning sweep's measurement (--backward-configs, --forward-tiles).
SWEEP_PREFIXES = ("ours backward ", "ours forward ")


def simulation_shape(config: Config) -> Config:
    """``config`` at a tiny size (CPU simulation, where its timing means nothing): three small
    tables, their dims at most 16, 8 bags, bags of at most 4 lookups; its kind of bags, weights
    and batch sizes kept."""
    return dataclasses.replace(
        config, tables=(50, 7, 300), dim=tuple(min(d, 16) for d in config.dims[:3]) if isinstance(config.dim, tuple)
        else 8, batch_size=8, bag_size=min(config.bag_size, 4),
        min_batch_size=None if config.min_batch_size is None else 4)
