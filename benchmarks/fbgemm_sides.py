"""Both sides of a ``bench fbgemm`` configuration: our module, FBGEMM_GPU's, and their batches.

- :func:`batches_of`: a configuration's batches ``(indices, offsets, per_sample_weights or None)``
  (:class:`~tiered_tbe.benchmarks.sampling.ZipfBatches`) and a gradient of the largest output;
- :func:`ours_module`: our :class:`~tiered_tbe.TieredEmbeddingBags` of a configuration;
- :func:`fbgemm_module`: FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` on the same tables
  (a dim per table), optimizer, weights dtype and cache; :func:`fbgemm_available` says whether it
  can run here; :func:`fbgemm_moves_counted`: the rows and bytes its cache moves a batch;
- :func:`shape_of`: a configuration at a tiny size in CPU simulation.

Shared by ``bench fbgemm`` and the developer tools that trace or profile its steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import torch

from tiered_tbe.base.mode import SIMULATION, default_device  # first: picks GPU / simulation mode
from tiered_tbe.benchmarks import common, sampling
from tiered_tbe.benchmarks.fbgemm_configs import HYPER, PROFILED_STEPS, Config, simulation_shape
from tiered_tbe.module import TieredEmbeddingBags
from tiered_tbe.optimizers import optimizer_named
from tiered_tbe.specs import CacheConfig, Placement, TableSpec

# What ours_module reads of the command line, at bench fbgemm's defaults (for tools that build our
# module of a configuration without parsing bench fbgemm's flags).
DEFAULT_MODULE_ARGS = argparse.Namespace(seed=0, mover=None, state_layout=None, in_place_copies=None)
# Our policies that FBGEMM's side runs as its LFU (the others as its LRU): lfu-admit admits misses by
# use counts, as FBGEMM's LFU does.
FBGEMM_LFU_POLICIES = ("lfu", "lfu-admit")
# Serial steps after the timed ones over which FBGEMM's cache moves are counted (fbgemm_moves_counted).
COUNTED_STEPS = 8


def fbgemm_available() -> str | None:
    """None when fbgemm_gpu imports and a GPU is present, else why not."""
    if SIMULATION:
        return "no CUDA device (simulation mode)"
    try:
        import fbgemm_gpu  # noqa: F401
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: F401
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except Exception as error:  # noqa: BLE001 - any import failure means: not available
        return f"fbgemm_gpu does not import ({type(error).__name__}: {error})"
    return None


def shape_of(config: Config) -> Config:
    """The configuration at a tiny size in simulation (its timing means nothing there)."""
    return simulation_shape(config) if SIMULATION else config


def batches_of(config: Config, seed: int, count: int, device=None) -> tuple[list, torch.Tensor]:
    """``count`` batches of a configuration, each ``(indices, offsets, per_sample_weights)`` (the
    weights None for an unweighted one), and a gradient of the largest pooled output (fp32
    ``[batch_size, total dim]``; a batch of ``B`` bags takes its first ``B`` rows), all drawn from
    ``seed`` on ``device`` (default: the default device)."""
    device = device or default_device()
    sampler = sampling.ZipfBatches(config.tables, config.alpha, config.batch_size, config.bag_size, device, seed=seed,
                                 bag_lengths=config.bag_lengths, weighted=config.weighted,
                                 min_batch_size=config.min_batch_size)
    grad = torch.randn(config.batch_size, config.total_dim, device=device,
                       generator=torch.Generator(device).manual_seed(seed))
    batches = [(*batch, None) if len(batch) == 2 else batch for batch in sampler.batches(count)]
    return batches, grad


# A configuration whose batch size changes every step (min_batch_size) serves its batches from a few
# graph shapes (base/graphs.padded_size: ~24 over its range of sizes), each captured on its second use
# and replayed after: its first ~50 steps run eagerly or capture. Its steady state is timed after this
# many warm-up steps (what those first steps cost is start-up: tools/startup.py).
VARIABLE_SIZE_WARMUP = 60
# A cached configuration's first steps fill its cache, and its forwards keep copies of the rows they read in
# place until the cache's counters have shown none for CopyRows.QUIET_READINGS readings in a row (a graph
# of its own, captured when the choice changes): timed after this many steps.
CACHED_WARMUP = 40


def warmup_steps(config: Config, args) -> int:
    """Untimed steps before a configuration's timed ones: ``--warmup``, at least
    :data:`VARIABLE_SIZE_WARMUP` for batches whose size changes every step and :data:`CACHED_WARMUP` for
    other cached ones (not in simulation)."""
    if SIMULATION:
        return args.warmup
    if config.min_batch_size is not None:
        return max(args.warmup, VARIABLE_SIZE_WARMUP)
    return max(args.warmup, CACHED_WARMUP) if config.cached else args.warmup


def batches_needed(config: Config, args) -> int:
    """How many distinct batches a configuration is measured on. A cached one gets a new batch
    every step (warm-up, timed and profiled): a cache that saw its batches before misses almost
    nothing (a 5% cache holds the rows of ~8 Criteo batches at Zipf 1.05), where training on
    batches that do not repeat moves tens of thousands of rows a batch."""
    if not config.cached:
        return args.distinct_batches
    # A lookahead cache is told the batches after the last one stepped too, as in a longer run; FBGEMM's
    # cache moves are counted over fresh batches after the timed (and profiled) ones.
    counted = COUNTED_STEPS if not config.pipelined else 0
    return (warmup_steps(config, args) + args.steps + (PROFILED_STEPS if args.profile else 0)
            + max(config.lookahead_window, counted))


def ours_module(config: Config, args, device=None) -> TieredEmbeddingBags:
    """Our module of a configuration: a table of its dim each, its placement, optimizer and cache;
    no bounds checks; ``args``: ``seed``, ``mover`` (the cache's, when it has one), ``state_layout``,
    ``in_place_copies`` (CacheConfig's, when given)."""
    placement = Placement(config.placement)
    tables = [TableSpec(n, dim, name=f"t{t}", placement=placement)
              for t, (n, dim) in enumerate(zip(config.tables, config.dims))]
    cache = None
    if config.cached:
        extra = {"mover": args.mover} if args.mover and "mover" in {f.name for f in dataclasses.fields(CacheConfig)} \
            else {}
        if getattr(args, "in_place_copies", None) is not None:
            extra["in_place_copies"] = args.in_place_copies
        cache = CacheConfig(fraction=config.cache_fraction, policy=config.policy, **extra)
    return TieredEmbeddingBags(tables, optimizer=optimizer_named(config.optimizer, **HYPER[config.optimizer]),
                               weights_dtype=common.DTYPES[config.dtype], device=device or default_device(),
                               cache=cache, bounds_check="off", stochastic_rounding=config.dtype != "fp32",
                               seed=args.seed, state_layout=args.state_layout or config.state_layout)


def fbgemm_module(config: Config, device=None):
    """FBGEMM's TBE of a configuration: ``MANAGED`` (uncached UVM) for ``managed``, ``MANAGED_CACHING`` with
    ``cache_load_factor`` equal to our cache fraction (LRU, or LFU for ``lfu`` and ``lfu-admit`` but
    pipelined; a lookahead configuration runs LRU) or ``DEVICE``; a
    dim per table; ``prefetch_pipeline`` for a pipelined one. It gathers no cache counters (they add
    atomics to its prefetch; :func:`fbgemm_moves_counted` counts its moves instead). On a CPU
    ``device`` (a test of the construction) the tables are ``HOST`` and computed on the CPU."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        BoundsCheckMode,
        CacheAlgorithm,
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    device = torch.device(device or "cuda")
    on_cpu = device.type == "cpu"
    location = (EmbeddingLocation.HOST if on_cpu else EmbeddingLocation.MANAGED_CACHING if config.cached
                else EmbeddingLocation.MANAGED if config.placement == "managed" else EmbeddingLocation.DEVICE)
    compute = ComputeDevice.CPU if on_cpu else ComputeDevice.CUDA
    optimizer = {"sgd": EmbOptimType.EXACT_SGD, "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                 "adam": EmbOptimType.ADAM}[config.optimizer]
    hyper = HYPER[config.optimizer]
    cached = config.cached and not on_cpu
    # Our HOST_CACHED tables live in pinned host memory: FBGEMM's counterpart keeps its UVM tables in
    # host-mapped pinned memory (`uvm_host_mapped`) instead of managed memory.
    extra = {}
    if cached and config.placement == "host_cached" and \
            "uvm_host_mapped" in inspect.signature(SplitTableBatchedEmbeddingBagsCodegen.__init__).parameters:
        extra["uvm_host_mapped"] = True
    emb = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(n, dim, location, compute) for n, dim in zip(config.tables, config.dims)],
        optimizer=optimizer, learning_rate=hyper["lr"], eps=hyper.get("eps", 1e-8),
        weights_precision=SparseType.FP16 if config.dtype == "fp16" else SparseType.FP32,
        output_dtype=SparseType.FP32, pooling_mode=PoolingMode.SUM, bounds_check_mode=BoundsCheckMode.NONE,
        cache_load_factor=config.cache_fraction,
        # FBGEMM's prefetch_pipeline takes LRU only (it asserts so): a pipelined LFU configuration runs its LRU.
        cache_algorithm=CacheAlgorithm.LFU if config.policy in FBGEMM_LFU_POLICIES and not config.pipelined
        else CacheAlgorithm.LRU,
        prefetch_pipeline=config.pipelined and cached, stochastic_rounding=config.dtype != "fp32",
        device=device, **extra)
    bound = 1.0 / max(config.tables) ** 0.5
    emb.init_embedding_weights_uniform(-bound, bound)
    return emb


def cache_moves(before: torch.Tensor, after: torch.Tensor, row_starts: torch.Tensor,
                row_bytes: torch.Tensor) -> torch.Tensor:
    """What one prefetch moved, read off a cache's tags around it: a way whose row changed took a
    row in and, if it held one, wrote that row back (FBGEMM keeps no dirty bits: every victim goes back).

    Args:
        before, after: int64 [sets, ways], the global row each way holds (FBGEMM's linear cache
            index, ``lxu_cache_state``), -1 for an empty way.
        row_starts: int64 [T], the first global row of each table, ascending.
        row_bytes: int64 [T], the bytes of a row of each table.

    Returns:
        int64 [4] on their device: rows in, rows out, bytes in, bytes out. No host sync.
    """
    changed = before != after
    went_out = changed & (before >= 0)
    table_in = torch.searchsorted(row_starts, after.clamp(min=0), right=True) - 1
    table_out = torch.searchsorted(row_starts, before.clamp(min=0), right=True) - 1
    return torch.stack([changed.sum(), went_out.sum(), (row_bytes[table_in] * changed).sum(),
                        (row_bytes[table_out] * went_out).sum()])


def fbgemm_moves_counted(emb, config: Config, batches, grad, first: int, steps: int = COUNTED_STEPS) -> dict:
    """FBGEMM's cache moves a batch over ``steps`` more serial training steps (prefetch, forward,
    backward) on the batches from ``first`` on, untimed: ``rows_in_per_batch``,
    ``rows_out_per_batch``, ``bytes_in_per_batch`` and ``bytes_out_per_batch``, read off its cache
    tags around each prefetch (:func:`cache_moves`), so for its LFU as for its LRU (whose own
    counters count misses, not rows moved). Bytes are its weights only: it keeps optimizer state out
    of its cache. Its serial configurations only (a pipelined one prefetches on its own stream)."""
    dims = torch.tensor(config.dims, dtype=torch.int64)
    row_bytes = (dims * common.DTYPES[config.dtype].itemsize).to(grad.device)
    row_starts = torch.tensor([0, *config.tables], dtype=torch.int64).cumsum(0)[:-1].to(grad.device)
    total = torch.zeros(4, dtype=torch.int64, device=grad.device)
    for i in range(steps):
        indices, offsets, weights = batches[(first + i) % len(batches)]
        before = emb.lxu_cache_state.clone()
        emb.prefetch(indices, offsets)
        total += cache_moves(before, emb.lxu_cache_state, row_starts, row_bytes)
        out = emb(indices, offsets, per_sample_weights=weights)
        out.backward(grad[: out.shape[0]])
    rows_in, rows_out, bytes_in, bytes_out = (total.double() / steps).tolist()
    return {"rows_in_per_batch": rows_in, "rows_out_per_batch": rows_out, "bytes_in_per_batch": bytes_in,
            "bytes_out_per_batch": bytes_out}
