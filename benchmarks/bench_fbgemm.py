"""Time tiered-tbe against FBGEMM_GPU's TBE side by side, in one process, on the same batches.

FBGEMM_GPU's ``SplitTableBatchedEmbeddingBagsCodegen`` is what our users run today, so it is the
baseline that counts. Each configuration builds FBGEMM's module and ours on the same table shapes,
optimizer and weights dtype, trains both on the same batches (``common.ZipfBatches``), and times
the forward (``module(indices, offsets)``), the backward (``out.backward(grad)``: the fused
update) and the whole step with CUDA events, medians of ``--steps`` steps after ``--warmup``. With
the tables in HBM the two sides take turns, four steps each (``time_interleaved``), so that the
lent machine's host, whose speed wanders within a call, weighs on both alike. Cached
configurations add the prefetch (FBGEMM ``MANAGED_CACHING`` with ``cache_load_factor`` equal to
our cache fraction, ``prefetch`` before each step, or with ``prefetch_pipeline=True`` and the next
batch prefetched on a side stream as TorchRec does; ours ``HOST_CACHED`` / ``MANAGED_CACHED``,
``prefetch`` before each step, or a depth-2 :class:`~tiered_tbe.PrefetchPipeline`).

Settings: both sides run without bounds checks (FBGEMM ``BoundsCheckMode.NONE``, ours
``bounds_check="off"``), fp32 outputs, the same learning rate and epsilon; fp16 weights use
stochastic rounding on both sides (FBGEMM's default). Ours is called as a user calls it (the
module), and for the forward the bare kernel (``pooled_forward``) is timed too, so the module's
own cost shows.

FBGEMM is an optional dependency (``pip install fbgemm-gpu`` beside torch); without it the
command says so and exits 0 (``--ours-only`` times our side alone). Without a GPU it runs our
side at a tiny size to prove it works; its times mean nothing.

    tiered-tbe bench fbgemm                       # every configuration
    tiered-tbe bench fbgemm --configs criteo-adagrad big-uniform-sgd --record
    tiered-tbe bench fbgemm --list                # the configurations
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import os
import sys
import threading
import time

import torch

from tiered_tbe.base.mode import SIMULATION, default_device, describe_mode  # first: picks GPU / simulation mode
from tiered_tbe.base.sorting import stable_sort
from tiered_tbe.benchmarks import common, kernel_profile
from tiered_tbe.benchmarks.bench_cache import free
from tiered_tbe.benchmarks.fbgemm_configs import (
    CONFIG_NAMES,
    CONFIGS,
    HYPER,
    PROFILED_STEPS,
    SIMULATION_SHAPE,
    Config,
)
from tiered_tbe.benchmarks.fbgemm_tables import table_of
from tiered_tbe.kernels import forward
from tiered_tbe.kernels.backward import backward_update, sort_lookups
from tiered_tbe.kernels.linearize import linearize
from tiered_tbe.kernels.rows import Lookups
from tiered_tbe.module import TieredEmbeddingBags
from tiered_tbe.optimizers import optimizer_named
from tiered_tbe.pipeline import PrefetchPipeline
from tiered_tbe.specs import CacheConfig, Placement, TableSpec

SCRIPT = "bench_fbgemm.py"


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add this benchmark's flags to ``parser`` (a new one if None): ``tiered-tbe bench fbgemm`` and the script."""
    parser = parser or argparse.ArgumentParser(prog="python benchmarks/bench_fbgemm.py")
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--configs", nargs="+", default=None, metavar="NAME",
                        help="configurations to run (default: all; --list shows them)")
    parser.add_argument("--list", action="store_true", help="list the configurations and exit")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side (default 20; 2 in simulation)")
    parser.add_argument("--warmup", type=int, default=10, help="steps before timing (default 10; 1 in simulation)")
    parser.add_argument("--distinct-batches", type=int, default=6,
                        help="distinct batches the all-HBM configurations cycle through (default 6: more than the L2 "
                             "holds); a cached configuration gets a new batch every step")
    parser.add_argument("--ours-only", action="store_true", help="time our side only (no FBGEMM)")
    parser.add_argument("--mover", default=None, help="our cache's row mover (CacheConfig.mover), when it has one")
    parser.add_argument("--state-layout", default=None, choices=("separate", "with_rows"),
                        help="where our backing stores keep each row's optimizer state (TieredEmbeddingBags "
                             "state_layout), for every configuration (default: each configuration's, separate "
                             "but for the *-with-rows ones)")
    parser.add_argument("--backward-configs", nargs="+", default=None, metavar="R,L,W,CHUNK[,...]",
                        help="also time our HBM steps with these backward tile shapes (rows, lanes, warps, chunk, "
                             "then optionally tiles, hot_windows, sum_windows, sum_warps: kernels.backward."
                             "BackwardConfig): a tuning sweep, each shape a module of its own taking turns with "
                             "the others")
    parser.add_argument("--forward-tiles", nargs="+", default=None, metavar="B,L,W[,G,S]",
                        help="also time our HBM steps with each of these forward tiles (bags, lanes, warps, "
                             "groups, stages: kernels.forward.ForwardTile) in place of the autotuner's: a tuning "
                             "sweep, each tile a module of its own taking turns with the others")
    parser.add_argument("--profile", action="store_true",
                        help="also profile a few steps of each side: device ms per step of each kernel, and each "
                             "phase's fraction of the copy bandwidth measured in the same run")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help=f"cProfile {PROFILED_STEPS} of our steps after the timed ones and print the N functions "
                             "taking the most host time (own, then cumulative)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the lookups")
    common.add_output_flags(parser)
    return parser


def check_args(args: argparse.Namespace) -> argparse.Namespace:
    unknown = sorted(set(args.configs or []) - set(CONFIG_NAMES))
    if unknown:
        raise ValueError(f"unknown configurations {unknown}; choose from {CONFIG_NAMES}")
    if args.steps < 1 or args.warmup < 0 or args.distinct_batches < 1:
        raise ValueError("--steps and --distinct-batches must be >= 1, --warmup >= 0")
    if SIMULATION:
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    if args.results_file is None:
        args.results_file = common.RESULTS
    return args


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
    return dataclasses.replace(config, **SIMULATION_SHAPE) if SIMULATION else config


# ------------------------------------------------------------------------------------ timing

ROUND_STEPS = 4  # timed steps a side takes in a row when the sides take turns (time_interleaved)


def time_steps(step, batches, grad, warmup: int, before=None, after_warmup=None,
               count: int | None = None) -> dict[str, float]:
    """Median ms of forward, backward and the whole step over the batches after the first ``warmup``
    (CUDA events on the current stream); the arguments are :func:`step_times`'."""
    return medians(step_times(step, batches, grad, warmup, before, after_warmup, count))


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {phase: common.median(values) for phase, values in times.items()}


def step_times(step, batches, grad, warmup: int, before=None, after_warmup=None,
               count: int | None = None) -> dict[str, list[float]]:
    """Ms of each phase (forward, backward, the whole step; ``prefetch`` with one) of each step after
    the first ``warmup`` (CUDA events on the current stream), and the host's ms to enqueue each
    (``host_*``).

    ``batches`` yields ``(indices, offsets)`` (taking the next one is part of the step: a
    PrefetchPipeline prefetches the batches ahead then); ``step(i, indices, offsets) -> output``;
    ``before(i, indices, offsets)`` runs first each step, outside the forward (a prefetch), and
    is timed as ``prefetch``; ``after_warmup()`` runs once, before the first timed step; ``count``
    steps at most (default: every batch)."""
    timer = common.StepTimer()
    host: dict[str, list[float]] = {}
    prefetching = before is not None or not isinstance(batches, list)  # a prefetch, or a pipeline's
    batches = iter(batches)
    for i in itertools.count() if count is None else range(count):
        timed = i >= warmup
        if i == warmup and after_warmup is not None:
            after_warmup()
        if timed:
            timer.start()
        begin = time.perf_counter()
        # Inside the step: a PrefetchPipeline prefetches the batches ahead when it hands one over.
        batch = next(batches, None)
        if batch is None:
            if timed:
                timer.discard()
            break
        indices, offsets = batch
        if before is not None:
            before(i, indices, offsets)
        if timed and prefetching:
            timer.mark("prefetch")
        enqueued = time.perf_counter()
        out = step(i, indices, offsets)
        if timed:
            timer.mark("forward")
        forwarded = time.perf_counter()
        out.backward(grad)
        if timed:
            timer.mark("backward")
            done = time.perf_counter()
            for phase, ms in (("prefetch", enqueued - begin), ("forward", forwarded - enqueued),
                              ("backward", done - forwarded)):
                host.setdefault(f"host_{phase}", []).append(ms * 1e3)
        del out
    result = timer.phases()
    # Host ms to enqueue each phase: where it nears the device ms, the phase is launch-bound.
    result.update({phase: times for phase, times in host.items() if prefetching or phase != "host_prefetch"})
    return result


def time_interleaved(steps: dict, batches: list, grad, warmup: int, count: int, round_steps: int = ROUND_STEPS,
                     environments: dict[str, dict[str, str]] | None = None) -> dict[str, dict[str, float]]:
    """Median ms per phase of each side's steps (``steps``: name -> ``step(i, indices, offsets)``, as
    in :func:`time_steps`), the sides taking turns: ``warmup`` untimed steps each, then rounds of
    ``round_steps`` timed steps each, in turn (the order reversed every other round), until each has
    ``count``. A host that slows down for a while (the lent machine's did, by up to 50%) then slows
    every side alike, where timing one side after the other skewed their ratio. ``environments``:
    variables set during a side's steps only (a tuning variant's tile)."""
    environments = environments or {}
    times: dict[str, dict[str, list[float]]] = {name: {} for name in steps}

    def take_turn(name: str, turn: list, warm: int) -> None:
        with environment(environments.get(name, {})):
            for phase, values in step_times(steps[name], turn, grad, warmup=warm).items():
                times[name].setdefault(phase, []).extend(values)

    for name in steps:
        take_turn(name, cycle(batches, warmup), warmup)
    order = list(steps)
    for round_number in range(-(-count // round_steps)):
        first = warmup + round_number * round_steps
        for name in order if round_number % 2 == 0 else order[::-1]:
            take_turn(name, cycle(batches, min(round_steps, count - round_number * round_steps), first), 0)
    return {name: medians(phase_times) for name, phase_times in times.items()}


@contextlib.contextmanager
def environment(variables: dict[str, str]):
    """``variables`` set in os.environ inside, restored after."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def host_profile(run, top: int) -> str:
    """cProfile of ``run()`` (our steps): the ``top`` functions by their own host time, then by
    cumulative time (where a launch-bound step's host time goes)."""
    import cProfile
    import io
    import pstats

    from tiered_tbe.function import TieredEmbeddingBagsFunction

    # On a GPU autograd runs backward on its own device thread, which a profiler enabled on this
    # thread does not see before Python 3.12 (from 3.12 cProfile, built on sys.monitoring, sees
    # every thread): there the backward gets a profiler of its own, enabled in its thread.
    profiler, backward_profiler = cProfile.Profile(), cProfile.Profile()
    backward = TieredEmbeddingBagsFunction.backward
    profiled_thread = threading.get_ident()

    def profiled_backward(ctx, grad_output):
        if threading.get_ident() == profiled_thread:  # a CPU run: this thread's profiler sees it
            return backward(ctx, grad_output)
        backward_profiler.enable()
        try:
            return backward(ctx, grad_output)
        finally:
            backward_profiler.disable()

    patch = sys.version_info < (3, 12)
    if patch:
        TieredEmbeddingBagsFunction.backward = staticmethod(profiled_backward)
    try:
        profiler.enable()
        run()
        common.synchronize()
        profiler.disable()
    finally:
        if patch:
            TieredEmbeddingBagsFunction.backward = staticmethod(backward)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    if backward_profiler.getstats():
        stats.add(backward_profiler)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def stepper(emb):
    """``step(i, indices, offsets)`` of a module without a cache: its forward."""
    return lambda i, indices, offsets: emb(indices, offsets)


def cycle(batches, count: int, first: int = 0) -> list:
    """``count`` batches, cycling through ``batches`` from the one at ``first``."""
    return [batches[(first + i) % len(batches)] for i in range(count)]


def batches_of(config: Config, seed: int, count: int) -> tuple[list, torch.Tensor]:
    """``count`` batches of a configuration (``common.ZipfBatches``) and a gradient of its pooled
    output (fp32 [B, total dim]), both drawn from ``seed`` on the default device."""
    device = default_device()
    sampler = common.ZipfBatches(config.tables, config.alpha, config.batch_size, config.bag_size, device, seed=seed)
    grad = torch.randn(config.batch_size, config.dim * len(config.tables), device=device,
                       generator=torch.Generator(device).manual_seed(seed))
    return sampler.batches(count), grad


def batches_needed(config: Config, args) -> int:
    """How many distinct batches a configuration is measured on. A cached one gets a new batch
    every step (warm-up, timed and profiled): a 5% cache holds the rows of ~8 Criteo batches at
    Zipf 1.05, so cycling 6 batches measured a cache that missed almost nothing (the exact
    simulator: 2.85 rows moved per batch, against the ~78K that the host-tables issue measured
    on batches that do not repeat)."""
    if not config.cached:
        return args.distinct_batches
    # A lookahead cache is told the batches after the last one stepped too, as in a longer run.
    return args.warmup + args.steps + (PROFILED_STEPS if args.profile else 0) + config.lookahead_window


# What ours_module reads of the command line, at bench_fbgemm's defaults (for the scripts that
# build our module of a configuration without parsing bench_fbgemm's flags).
DEFAULT_MODULE_ARGS = argparse.Namespace(seed=0, mover=None, state_layout=None)


def ours_module(config: Config, args) -> TieredEmbeddingBags:
    placement = {"device": Placement.DEVICE, "host_cached": Placement.HOST_CACHED,
                 "managed_cached": Placement.MANAGED_CACHED}[config.placement]
    tables = [TableSpec(n, config.dim, name=f"t{t}", placement=placement) for t, n in enumerate(config.tables)]
    cache = None
    if config.cached:
        extra = {"mover": args.mover} if args.mover and "mover" in {f.name for f in dataclasses.fields(CacheConfig)} \
            else {}
        cache = CacheConfig(fraction=config.cache_fraction, policy=config.policy, **extra)
    return TieredEmbeddingBags(tables, optimizer=optimizer_named(config.optimizer, **HYPER[config.optimizer]),
                               weights_dtype=common.DTYPES[config.dtype], device=default_device(), cache=cache,
                               bounds_check="off", stochastic_rounding=config.dtype != "fp32", seed=args.seed,
                               state_layout=args.state_layout or config.state_layout)


def fresh_ours_module(config: Config, args) -> TieredEmbeddingBags:
    # Each configuration tunes the forward on its own batches, as a user's training would: the
    # autotuner keeps one choice per bag-length class, and the uniform big-table batches chose a
    # tile ~8% slower on the Zipf ones that followed (RESULTS.md, 2026-12-02).
    forward._pooled_forward_kernel.cache.clear()
    return ours_module(config, args)


def measure_ours(config: Config, batches, grad, args, emb: TieredEmbeddingBags | None = None,
                 timed: dict | None = None) -> dict:
    """Our side of a configuration: its timed steps (``timed``, when they were taken already with
    ``emb``, interleaved with FBGEMM's), then what is measured of our side alone."""
    if emb is None:
        emb = fresh_ours_module(config, args)
    count = args.warmup + args.steps

    def forward_of(i, indices, offsets):
        return emb(indices, offsets)

    def run_steps(count: int, warmup: int, first: int = 0) -> dict[str, float]:
        window = config.lookahead_window
        batches_run = cycle(batches, count + window, first)  # the last steps see a whole window too
        reset = emb.reset_cache_stats if config.cached else None  # the counters of the timed steps
        if config.pipelined:
            pipeline = PrefetchPipeline(emb, batches_run, depth=2, lookahead=window if window else None)
            result = time_steps(forward_of, pipeline, grad, warmup, after_warmup=reset, count=count)
            pipeline.close()
            return result
        if config.cached:
            before = lookahead_prefetch(emb, batches_run, window) if window \
                else lambda i, indices, offsets: emb.prefetch(indices, offsets)
            return time_steps(forward_of, batches_run, grad, warmup, after_warmup=reset, before=before, count=count)
        return time_steps(forward_of, batches_run, grad, warmup)

    result = dict(timed) if timed is not None else run_steps(count, args.warmup)
    if config.cached:
        stats = emb.cache_stats()
        result["hit_rate"] = stats.hit_rate_by_lookup if stats.lookups else float("nan")
        result["rows_in_per_batch"] = stats.rows_copied_in / max(stats.batches, 1)
    if args.profile and not config.pipelined:  # on the batches after the timed ones
        result["profile"] = kernel_profile.kernel_ms_per_step(lambda: run_steps(PROFILED_STEPS, 0, first=count),
                                                              PROFILED_STEPS)
    if args.host_profile:
        result["host_profile"] = host_profile(lambda: run_steps(PROFILED_STEPS, 0, first=count), args.host_profile)
    if not config.cached:
        lookups = Lookups(*batches[0], config.batch_size)
        if args.profile:
            keys = linearize(emb.row_stores, lookups, torch.int64).global_rows
            state_bytes = 4 * emb.optimizer.state_width(config.dim)
            result["bytes"] = kernel_profile.step_bytes(
                lookups.num_lookups, int(torch.unique(keys).numel()), config.batch_size,
                config.dim * len(config.tables), config.dim * common.DTYPES[config.dtype].itemsize, state_bytes)
        result["kernel_forward"] = common.time_ms(
            lambda: forward.pooled_forward(emb.row_stores, lookups, None, "sum"), rep_ms=100)
        # Where the backward's time goes: grouping the lookups by row, then the three update kernels.
        result["kernel_sort"] = common.time_ms(lambda: sort_lookups(emb.row_stores, lookups, need_order=False),
                                               rep_ms=100)
        grouped = sort_lookups(emb.row_stores, lookups, need_order=False)
        keys = linearize(emb.row_stores, lookups, torch.int32).global_rows
        result["kernel_sort_alone"] = common.time_ms(lambda: stable_sort(keys, emb.row_stores.num_rows - 1),
                                                     rep_ms=100)
        result["kernel_update"] = common.time_ms(
            lambda: backward_update(grad, emb.row_stores, lookups, None, "sum", emb.optimizer, 1,
                                    sorted_lookups=grouped), rep_ms=100)
        override = os.environ.get("TIERED_TBE_FORWARD_TILE")
        best = None if override else getattr(forward._pooled_forward_kernel, "best_config", None)
        result["forward_tile"] = (f"B{best.kwargs['BLOCK_B']} L{best.kwargs['BLOCK_L']} w{best.num_warps} "
                                  f"G{best.kwargs['GROUPS']} S{best.kwargs['STAGES']}" if best is not None
                                  else f"tile {override}" if override else "-")
    return result  # the module goes with this frame: the caller frees its memory


def lookahead_prefetch(emb: TieredEmbeddingBags, batches: list, window: int):
    """``before(i, indices, offsets)`` for a serial step of a lookahead cache: tell it the rows of
    batches ``i + 1 .. i + window`` (each batch's distinct rows found once, when it enters the
    window: part of the timed prefetch, as a pipeline would do on its side stream), then prefetch."""
    hints: dict[int, torch.Tensor] = {}

    def before(i, indices, offsets):
        upcoming = range(i + 1, min(i + 1 + window, len(batches)))
        for j in upcoming:
            if j not in hints:
                hints[j] = emb.rows_for_hint(*batches[j])[0]
        hints.pop(i, None)
        emb.hint_upcoming([hints[j] for j in upcoming])
        emb.prefetch(indices, offsets)

    return before


def fbgemm_module(config: Config):
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

    location = EmbeddingLocation.MANAGED_CACHING if config.cached else EmbeddingLocation.DEVICE
    optimizer = {"sgd": EmbOptimType.EXACT_SGD, "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                 "adam": EmbOptimType.ADAM}[config.optimizer]
    hyper = HYPER[config.optimizer]
    emb = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(n, config.dim, location, ComputeDevice.CUDA) for n in config.tables],
        optimizer=optimizer, learning_rate=hyper["lr"], eps=hyper.get("eps", 1e-8),
        weights_precision=SparseType.FP16 if config.dtype == "fp16" else SparseType.FP32,
        output_dtype=SparseType.FP32, pooling_mode=PoolingMode.SUM, bounds_check_mode=BoundsCheckMode.NONE,
        cache_load_factor=config.cache_fraction,
        cache_algorithm=CacheAlgorithm.LFU if config.policy == "lfu" else CacheAlgorithm.LRU,
        prefetch_pipeline=config.pipelined, stochastic_rounding=config.dtype != "fp32", device=torch.device("cuda"))
    bound = 1.0 / max(config.tables) ** 0.5
    emb.init_embedding_weights_uniform(-bound, bound)
    return emb


def measure_fbgemm(config: Config, batches, grad, args, emb=None, timed: dict | None = None) -> dict:
    """FBGEMM's side of a configuration (``timed``: as in :func:`measure_ours`)."""
    if emb is None:
        emb = fbgemm_module(config)
    count = args.warmup + args.steps

    def forward_of(i, indices, offsets):
        return emb(indices, offsets)

    if config.pipelined:
        # As TorchRec's prefetch pipeline: batch i+1 prefetched on a side stream while batch i trains.
        main, side = torch.cuda.current_stream(), torch.cuda.Stream()
        with torch.cuda.stream(side):
            emb.prefetch(*batches[0], forward_stream=main)
        ready = [torch.cuda.Event() for _ in range(count + 1)]
        ready[0].record(side)

        def step(i, indices, offsets):
            main.wait_event(ready[i])
            out = emb(indices, offsets)
            with torch.cuda.stream(side):
                side.wait_stream(main)  # after the forward that used the cache state
                emb.prefetch(*batches[(i + 1) % len(batches)], forward_stream=main)
                ready[i + 1].record(side)
            return out

        def run_steps(count: int, warmup: int, first: int = 0) -> dict[str, float]:
            return time_steps(step, cycle(batches, count, first), grad, warmup)
    elif config.cached:
        def run_steps(count: int, warmup: int, first: int = 0) -> dict[str, float]:
            return time_steps(forward_of, cycle(batches, count, first), grad, warmup,
                              before=lambda i, indices, offsets: emb.prefetch(indices, offsets))
    else:
        def run_steps(count: int, warmup: int, first: int = 0) -> dict[str, float]:
            return time_steps(forward_of, cycle(batches, count, first), grad, warmup)
    result = dict(timed) if timed is not None else run_steps(count, args.warmup)
    if args.profile and not config.pipelined:  # (the pipelined steps' events and batches run on from the timing)
        result["profile"] = kernel_profile.kernel_ms_per_step(lambda: run_steps(PROFILED_STEPS, 0, first=count),
                                                              PROFILED_STEPS)
    return result


# ------------------------------------------------------------------------------------ main


def run(args: argparse.Namespace) -> list[dict]:
    missing = "not asked for (--ours-only)" if args.ours_only else fbgemm_available()
    print(f"bench_fbgemm: {describe_mode()}")
    if missing and not SIMULATION and not args.ours_only:
        print(f"FBGEMM_GPU is not available: {missing}. Install fbgemm-gpu beside torch to compare, "
              "or pass --ours-only. Nothing measured.")
        return []
    if missing:
        print(f"FBGEMM_GPU: {missing}; timing our side only" + (", at a tiny size (times mean nothing)"
                                                                 if SIMULATION else ""))
    print("settings: no bounds checks on either side (FBGEMM BoundsCheckMode.NONE, ours bounds_check='off'); "
          "fp32 output; stochastic rounding for fp16 weights on both sides; cached: FBGEMM MANAGED_CACHING, "
          f"ours HOST_CACHED/MANAGED_CACHED{'' if not args.mover else f' mover={args.mover}'}, same cache fraction; "
          f"ours state_layout={args.state_layout or 'separate (with_rows in *-with-rows)'}; our forward tuned on "
          "each configuration's own batches; HBM: the sides take turns, "
          f"{ROUND_STEPS} steps each")
    configs = [c for c in CONFIGS if args.configs is None or c.name in args.configs]
    copy_gbs = kernel_profile.copy_bandwidth_gbs() if args.profile else None
    if copy_gbs is not None:
        print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)")
    # The HBM configurations: both sides, and each tuning variant of ours (a module of its own, its
    # setting in the environment during its turns), built at once, their steps taking turns
    # (time_interleaved), so that a host that slows down for a while slows them all. The cached
    # ones: every configuration of ours first, then every one of FBGEMM's (the same batches,
    # rebuilt from the seed): each side's cache state runs on from step to step.
    variants = {f"ours backward {spec}": {"TIERED_TBE_BACKWARD": spec} for spec in args.backward_configs or []}
    variants.update({f"ours forward {spec}": {"TIERED_TBE_FORWARD_TILE": spec} for spec in args.forward_tiles or []})
    results = []
    for base in configs:
        config = shape_of(base)
        batches, grad = batches_of(config, args.seed, batches_needed(config, args))
        row = {"config": base.name, "copy_gbs": copy_gbs}
        if config.cached:
            row["ours"] = measure_ours(config, batches, grad, args)
        else:
            modules = {"ours": fresh_ours_module(config, args)}
            if not missing:
                modules["fbgemm"] = fbgemm_module(config)
            modules.update({name: ours_module(config, args) for name in variants})
            timed = time_interleaved({name: stepper(emb) for name, emb in modules.items()}, batches, grad,
                                     args.warmup, args.steps, environments=variants)
            row["ours"] = measure_ours(config, batches, grad, args, modules["ours"], timed["ours"])
            if not missing:
                row["fbgemm"] = measure_fbgemm(config, batches, grad, args, modules["fbgemm"], timed["fbgemm"])
            row.update({name: timed[name] for name in variants})
            del modules
        free()
        results.append(row)
        print(f"  {base.name}: ours " + ", ".join(f"{k} {common.fmt(v)}" for k, v in row["ours"].items()
                                                  if not isinstance(v, (list, dict, str))), flush=True)
        if "host_profile" in row["ours"]:
            print(f"host profile of {base.name}, {PROFILED_STEPS} steps:\n{row['ours'].pop('host_profile')}")
        del batches, grad
        free()
    for base, row in zip(configs, results):
        if "fbgemm" in row:
            print(f"  {base.name}: FBGEMM (interleaved) " + ", ".join(
                f"{k} {common.fmt(v)}" for k, v in row["fbgemm"].items() if not isinstance(v, (list, dict))))
            continue
        row["fbgemm"] = {}
        if not missing:
            config = shape_of(base)
            batches, grad = batches_of(config, args.seed, batches_needed(config, args))
            row["fbgemm"] = measure_fbgemm(config, batches, grad, args)
            print(f"  {base.name}: FBGEMM " + ", ".join(f"{k} {common.fmt(v)}" for k, v in row["fbgemm"].items()
                                                        if not isinstance(v, list)), flush=True)
            del batches, grad
            free()
    common.report(args, SCRIPT, sys.argv[1:], results, table_of(results))
    return results


def run_command(args: argparse.Namespace) -> list[dict]:
    if args.list:
        for config in CONFIGS:
            print(f"{config.name:<26} {len(config.tables)} tables ({sum(config.tables):,} rows) x {config.dim} "
                  f"{config.dtype}, B={config.batch_size}, L={config.bag_size}, zipf {config.alpha:g}, "
                  f"{config.optimizer}, {config.placement}" + (f" {config.policy}" if config.cached else "")
                  + (", pipelined" if config.pipelined else ""))
        return []
    return run(check_args(args))


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        run_command(args)
    except ValueError as error:
        parser.error(str(error))
    return 0


if __name__ == "__main__":
    sys.exit(main())
