"""Time tiered-tbe against FBGEMM_GPU's TBE side by side, in one process, on the same batches.

FBGEMM_GPU's ``SplitTableBatchedEmbeddingBagsCodegen`` is what our users run today, so it is the
baseline that counts. Each configuration builds FBGEMM's module and ours on the same tables (a
dim per table), optimizer and weights dtype, trains both on the same batches
(``sampling.ZipfBatches``: bags of one length or of lengths drawn per bag or per batch, per-sample
weights, batch sizes that change every step, as the configuration says), and times the forward
(``module(indices, offsets, per_sample_weights)``), the backward (``out.backward(grad)``: the
fused update) and the whole step with CUDA events, medians of ``--steps`` steps after
``--warmup``. With the tables in HBM the two sides take turns, four steps each
(``time_interleaved``), so that a host whose speed wanders weighs on both alike. A configuration
whose batch size changes every step is timed after at least 60 warm-up steps (``warmup_steps``): its
steady state, once each of its few padded batch shapes has its CUDA graph. Cached
configurations add the prefetch (FBGEMM ``MANAGED_CACHING`` with ``cache_load_factor`` equal to
our cache fraction, its tables in host-mapped pinned memory (``uvm_host_mapped``) beside our
``HOST_CACHED`` ones, ``prefetch`` before each step, or with ``prefetch_pipeline=True`` and the next
batch prefetched on a side stream as TorchRec does; ours ``HOST_CACHED`` / ``MANAGED_CACHED``,
``prefetch`` before each step, or a depth-2 :class:`~tiered_tbe.PrefetchPipeline`).

For each cached configuration it also reports the rows and bytes its cache moved per batch in
and out (ours from ``cache_stats()``; FBGEMM's read off its cache tags around each prefetch over a
few untimed steps after the timed ones, serial configurations only) and the bus rate reached (bytes
moved / prefetch time), and beside each serial cached configuration the step of its pipelined twin
when both ran. Every ratio is against FBGEMM's figure measured in the
same run.

Settings: both sides run without bounds checks (FBGEMM ``BoundsCheckMode.NONE``, ours
``bounds_check="off"``), fp32 outputs, the same learning rate and epsilon; fp16 weights use
stochastic rounding on both sides (FBGEMM's default). Ours is called as a user calls it (the
module), and for the forward the bare kernel (``pooled_forward``) is timed too, so the module's
own cost shows.

FBGEMM is an optional dependency (``pip install fbgemm-gpu`` beside torch); without it the
command says so and exits 0 (``--ours-only`` times our side alone). Without a GPU it runs our
side at a tiny size to prove it works; its times mean nothing.

    tiered-tbe bench fbgemm                       # every configuration
    tiered-tbe bench fbgemm --configs criteo-adagrad big-uniform-sgd --record results.jsonl
    tiered-tbe bench fbgemm --list                # the configurations
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from tiered_tbe import records
from tiered_tbe.base.mode import SIMULATION, describe_mode  # first: picks GPU / simulation mode
from tiered_tbe.base.sorting import stable_sort
from tiered_tbe.benchmarks import common, kernel_profile, sampling
from tiered_tbe.benchmarks.fbgemm_configs import CONFIG_NAMES, CONFIGS, PROFILED_STEPS, Config
from tiered_tbe.benchmarks.fbgemm_sides import (
    batches_needed,
    batches_of,
    fbgemm_available,
    fbgemm_module,
    fbgemm_moves_counted,
    ours_module,
    shape_of,
    warmup_steps,
)
from tiered_tbe.benchmarks.fbgemm_tables import measurements_of, table_of
from tiered_tbe.benchmarks.fbgemm_timing import ROUND_STEPS, host_profile, stepper, time_interleaved, time_steps
from tiered_tbe.kernels import forward
from tiered_tbe.kernels.backward import backward_update, sort_lookups
from tiered_tbe.kernels.linearize import linearize
from tiered_tbe.kernels.rows import Lookups
from tiered_tbe.module import TieredEmbeddingBags
from tiered_tbe.pipeline import PrefetchPipeline
from tiered_tbe.storage import STATE_LAYOUTS

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
    parser.add_argument("--in-place-copies", type=int, default=None, metavar="ROWS",
                        help="our cache's CacheConfig.in_place_copies (default: its default; 0: none)")
    parser.add_argument("--state-layout", default=None, choices=STATE_LAYOUTS,
                        help="where our backing stores keep each row's optimizer state (TieredEmbeddingBags "
                             "state_layout), for every configuration (default: each configuration's, auto "
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
    parser.add_argument("--forward-one-launch", action="store_true",
                        help="also time our HBM steps with the forward launched once over every feature "
                             "(TIERED_TBE_FORWARD_ONE_LAUNCH=1) instead of once per column group of dims")
    parser.add_argument("--backward-one-launch", action="store_true",
                        help="also time our HBM steps with the backward's row updates launched once over every row "
                             "(TIERED_TBE_BACKWARD_ONE_LAUNCH=1) instead of once per column group of dims")
    parser.add_argument("--fit-cache", action="store_true",
                        help="pipelined configurations: PrefetchPipeline(fit_cache=True), which holds fewer batches "
                             "ahead while its prefetches find the cache full (tiered_tbe/ahead.py); the batches it "
                             "held ahead at the end are reported")
    parser.add_argument("--profile", action="store_true",
                        help="also profile a few steps of each side: device ms per step of each kernel, and each "
                             "phase's fraction of the copy bandwidth measured in the same run")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="cProfile our timed steps run again (their batches, whose graphs are captured) and print "
                             "the N functions taking the most host time (own, then cumulative)")
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
    if args.record is not None:
        records.check_path(args.record)
    return args


def fresh_ours_module(config: Config, args) -> TieredEmbeddingBags:
    # Each configuration tunes the forward on its own batches, as a user's training would: the
    # autotuner keeps one choice per bag-length class, and the uniform big-table batches chose a
    # tile ~8% slower on the Zipf ones that followed.
    forward._pooled_forward_kernel.cache.clear()
    return ours_module(config, args)


def measure_ours(config: Config, batches, grad, args, emb: TieredEmbeddingBags | None = None,
                 timed: dict | None = None) -> dict:
    """Our side of a configuration: its timed steps (``timed``, when they were taken already with
    ``emb``, interleaved with FBGEMM's), then what is measured of our side alone."""
    if emb is None:
        emb = fresh_ours_module(config, args)
    warmup = warmup_steps(config, args)
    count = warmup + args.steps

    def forward_of(i, indices, offsets, weights):
        return emb(indices, offsets, per_sample_weights=weights)

    # Graph captures, eager runs and the allocators' CUDA calls over the timed steps (0 in a steady state).
    counters = common.step_counters(emb, emb.cache)

    def run_steps(count: int, warmup: int, first: int = 0) -> dict[str, float]:
        window = config.lookahead_window
        batches_run = sampling.cycle(batches, count + window, first)  # the last steps see a whole window too
        reset = emb.reset_cache_stats if config.cached else None  # the counters of the timed steps
        if config.pipelined:
            pipeline = PrefetchPipeline(emb, batches_run, depth=2, lookahead=window if window else None,
                                        fit_cache=args.fit_cache)
            result = time_steps(forward_of, pipeline, grad, warmup, after_warmup=reset, count=count, counters=counters)
            pipeline.close()
            if pipeline.ahead_control is not None:
                control = pipeline.ahead_control
                # Steps run (warm-up included) at each depth: steps_ahead_0, steps_ahead_1, ...
                result.update(ahead_at_end=control.ahead, ahead_lowered=control.lowered,
                              **{f"steps_ahead_{k}": control.steps_at.get(k, 0) for k in range(control.depth + 1)})
            return result
        if config.cached:
            before = lookahead_prefetch(emb, batches_run, window) if window \
                else lambda i, indices, offsets, weights: emb.prefetch(indices, offsets)
            return time_steps(forward_of, batches_run, grad, warmup, after_warmup=reset, before=before, count=count,
                              counters=counters)
        return time_steps(forward_of, batches_run, grad, warmup, counters=counters)

    result = dict(timed) if timed is not None else run_steps(count, warmup)
    if config.cached:
        result.update(rows_moved(emb))
    result.update(lookups_of_steps(batches, warmup, count, args.profile and not config.pipelined))
    if args.profile and not config.pipelined:  # on the batches after the timed ones
        result["profile"] = kernel_profile.kernel_ms_per_step(lambda: run_steps(PROFILED_STEPS, 0, first=count),
                                                              PROFILED_STEPS)
    if args.host_profile:
        # The timed steps' batches again: every graph shape among them is captured already, so the profile sees
        # the replays the timed steps ran (fresh batches of a changing size would be captures and eager runs).
        result["host_profile"] = host_profile(lambda: run_steps(args.steps, 0, first=warmup), args.host_profile)
    if not config.cached:
        indices, offsets, weights = batches[0]
        lookups = Lookups(indices, offsets, (offsets.numel() - 1) // len(config.tables), weights)
        if args.profile and len(set(config.dims)) == 1:
            dim = config.dims[0]
            keys = linearize(emb.row_stores, lookups, torch.int64).global_rows
            state_bytes = 4 * emb.optimizer.state_width(dim)
            result["bytes"] = kernel_profile.step_bytes(
                lookups.num_lookups, int(torch.unique(keys).numel()), lookups.batch_size, config.total_dim,
                dim * common.DTYPES[config.dtype].itemsize, state_bytes)
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
            lambda: backward_update(grad[: lookups.batch_size], emb.row_stores, lookups, None, "sum", emb.optimizer,
                                    1, sorted_lookups=grouped), rep_ms=100)
        override = os.environ.get("TIERED_TBE_FORWARD_TILE")
        best = None if override else getattr(forward._pooled_forward_kernel, "best_config", None)
        result["forward_tile"] = (f"B{best.kwargs['BLOCK_B']} L{best.kwargs['BLOCK_L']} w{best.num_warps} "
                                  f"G{best.kwargs['GROUPS']} S{best.kwargs['STAGES']}" if best is not None
                                  else f"tile {override}" if override else "-")
    return result  # the module goes with this frame: the caller frees its memory


def lookups_of_steps(batches: list, warmup: int, count: int, profiled: bool) -> dict:
    """Mean lookups a step of the timed batches (``lookups_per_step``: ``warmup`` to ``count``) and,
    when ``profiled``, of the profiled ones after them (``profiled_lookups_per_step``). Where the batch
    size or the bag lengths change every step the two differ: the kernel profile's ms are of its own
    batches (on the ragged shape its 5 batches held 25% fewer samples than the 8 timed ones, which
    read as ~1 ms a step that the GPU idled)."""
    def mean_lookups(first: int, steps: int) -> float:
        chosen = sampling.cycle(batches, steps, first)
        return sum(batch[0].numel() for batch in chosen) / max(len(chosen), 1)

    found = {"lookups_per_step": mean_lookups(warmup, count - warmup)}
    if profiled:
        found["profiled_lookups_per_step"] = mean_lookups(count, PROFILED_STEPS)
    return found


def rows_moved(emb: TieredEmbeddingBags) -> dict:
    """What our cache moved over the timed steps, from ``cache_stats()``: hit rate by lookup, rows
    and bytes in and out per batch, the distinct rows a batch read in place (given no slot: read by the
    forward and written by the backward over the bus), and the bytes of optimizer state a row carries
    (the same for every row when the optimizer's state does not grow with the dim)."""
    stats = emb.cache_stats()
    batches = max(stats.batches, 1)
    widths = {emb.optimizer.state_width(spec.embedding_dim) for spec in emb.tables} if emb.optimizer else {0}
    return dict(hit_rate=stats.hit_rate_by_lookup if stats.lookups else float("nan"),
                rows_in_per_batch=stats.rows_copied_in / batches, rows_out_per_batch=stats.write_backs / batches,
                bytes_in_per_batch=stats.bytes_in / batches, bytes_out_per_batch=stats.bytes_out / batches,
                rows_in_place_per_batch=stats.misses_no_slot / batches,
                state_bytes_per_row=4 * widths.pop() if len(widths) == 1 else None)


def lookahead_prefetch(emb: TieredEmbeddingBags, batches: list, window: int):
    """``before(i, indices, offsets, weights)`` for a serial step of a lookahead cache: tell it the rows of
    batches ``i + 1 .. i + window`` (each batch's distinct rows found once, when it enters the
    window: part of the timed prefetch, as a pipeline would do on its side stream), then prefetch."""
    hints: dict[int, torch.Tensor] = {}

    def before(i, indices, offsets, weights):
        upcoming = range(i + 1, min(i + 1 + window, len(batches)))
        for j in upcoming:
            if j not in hints:
                hints[j] = emb.rows_for_hint(*batches[j][:2])[0]
        hints.pop(i, None)
        emb.hint_upcoming([hints[j] for j in upcoming])
        emb.prefetch(indices, offsets)

    return before


def measure_fbgemm(config: Config, batches, grad, args, emb=None, timed: dict | None = None) -> dict:
    """FBGEMM's side of a configuration (``timed``: as in :func:`measure_ours`)."""
    if emb is None:
        emb = fbgemm_module(config)
    warmup = warmup_steps(config, args)
    count = warmup + args.steps
    counters = common.step_counters()  # the allocators' CUDA calls over the timed steps

    def forward_of(i, indices, offsets, weights):
        return emb(indices, offsets, per_sample_weights=weights)

    if config.pipelined:
        # As TorchRec's prefetch pipeline: batch i+1 prefetched on a side stream while batch i trains.
        main, side = torch.cuda.current_stream(), torch.cuda.Stream()
        with torch.cuda.stream(side):
            emb.prefetch(*batches[0][:2], forward_stream=main)
        ready = [torch.cuda.Event() for _ in range(count + 1)]
        ready[0].record(side)

        def step(i, indices, offsets, weights):
            main.wait_event(ready[i])
            out = emb(indices, offsets, per_sample_weights=weights)
            with torch.cuda.stream(side):
                side.wait_stream(main)  # after the forward that used the cache state
                emb.prefetch(*batches[(i + 1) % len(batches)][:2], forward_stream=main)
                ready[i + 1].record(side)
            return out

        def run_steps(count: int, warmup: int, first: int = 0) -> dict[str, float]:
            return time_steps(step, sampling.cycle(batches, count, first), grad, warmup, counters=counters)
    elif config.cached:
        def run_steps(count: int, warmup: int, first: int = 0) -> dict[str, float]:
            return time_steps(forward_of, sampling.cycle(batches, count, first), grad, warmup,
                              before=lambda i, indices, offsets, weights: emb.prefetch(indices, offsets),
                              counters=counters)
    else:
        def run_steps(count: int, warmup: int, first: int = 0) -> dict[str, float]:
            return time_steps(forward_of, sampling.cycle(batches, count, first), grad, warmup, counters=counters)
    result = dict(timed) if timed is not None else run_steps(count, warmup)
    result.update(lookups_of_steps(batches, warmup, count, args.profile and not config.pipelined))
    if args.profile and not config.pipelined:  # (the pipelined steps' events and batches run on from the timing)
        result["profile"] = kernel_profile.kernel_ms_per_step(lambda: run_steps(PROFILED_STEPS, 0, first=count),
                                                              PROFILED_STEPS)
    if config.cached and not config.pipelined:  # on fresh batches, after the timed and profiled ones
        result.update(fbgemm_moves_counted(emb, config, batches, grad,
                                           first=count + (PROFILED_STEPS if args.profile else 0)))
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
          "fp32 output; stochastic rounding for fp16 weights on both sides; cached: FBGEMM MANAGED_CACHING "
          "(uvm_host_mapped beside our HOST_CACHED), ours HOST_CACHED/MANAGED_CACHED"
          f"{'' if not args.mover else f' mover={args.mover}'}, same cache fraction; "
          f"ours state_layout={args.state_layout or 'auto (with_rows in *-with-rows)'}; our forward tuned on "
          "each configuration's own batches; HBM: the sides take turns, "
          f"{ROUND_STEPS} steps each; FBGEMM gathers no cache counters (its moves are counted off its cache "
          "tags after the timed steps)")
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
    if args.forward_one_launch:
        variants["ours forward one-launch"] = {"TIERED_TBE_FORWARD_ONE_LAUNCH": "1"}
    if args.backward_one_launch:
        variants["ours backward one-launch"] = {"TIERED_TBE_BACKWARD_ONE_LAUNCH": "1"}
    results = []
    for base in configs:
        config = shape_of(base)
        batches, grad = batches_of(config, args.seed, batches_needed(config, args))
        row = {"config": base.name, "configuration": config.as_record(), "copy_gbs": copy_gbs}
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
        common.free()
        results.append(row)
        print(f"  {base.name}: ours " + ", ".join(f"{k} {common.fmt(v)}" for k, v in row["ours"].items()
                                                  if not isinstance(v, (list, dict, str))), flush=True)
        if "host_profile" in row["ours"]:
            profile = row["ours"].pop("host_profile")
            print(f"host profile of {base.name}, the {args.steps} timed steps again:\n{profile}")
        del batches, grad
        common.free()
    for base, row in zip(configs, results):
        if "fbgemm" in row:
            print(f"  {base.name}: FBGEMM (interleaved) " + ", ".join(
                f"{k} {common.fmt(v)}" for k, v in row["fbgemm"].items() if not isinstance(v, (list, dict))))
        elif base.fbgemm_fails and not missing:
            row["fbgemm"] = {}
            print(f"  {base.name}: FBGEMM not run: {base.fbgemm_fails}")
        elif missing:
            row["fbgemm"] = {}
        else:
            config = shape_of(base)
            batches, grad = batches_of(config, args.seed, batches_needed(config, args))
            row["fbgemm"] = measure_fbgemm(config, batches, grad, args)
            print(f"  {base.name}: FBGEMM " + ", ".join(f"{k} {common.fmt(v)}" for k, v in row["fbgemm"].items()
                                                        if not isinstance(v, list)), flush=True)
            del batches, grad
            common.free()
        # Recorded as each configuration is done: an FBGEMM kernel that fails on the device (its
        # prefetch_pipeline at a low hit rate did, an illegal address) ends the process there.
        common.append_records(args, SCRIPT, sys.argv[1:], measurements_of([row], args))
    common.report(args, SCRIPT, sys.argv[1:], results, table_of(results))
    return results


def run_command(args: argparse.Namespace) -> list[dict]:
    if args.list:
        width = max(len(name) for name in CONFIG_NAMES)
        for config in CONFIGS:
            print(f"{config.name:<{width}}  {config.describe()}")
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
