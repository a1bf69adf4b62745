"""Time training steps with the prefetch pipeline against serial prefetch, all-HBM and managed memory.

The model of ``bench_cache.py`` (the 26 Criteo Kaggle tables, dim 128 fp32, row-wise Adagrad,
B=65536, one lookup per table per sample, Zipf(alpha) lookups drawn on the GPU; the same flags
``--tables --rows --row-cap --dim --dtype --batch-size --bag-size --alpha``) under a small
DLRM top: a bottom MLP over 13 dense features, pairwise dot interactions of the 27 feature
vectors, a top MLP to one logit, BCE loss, SGD on the dense weights. A step is forward, backward
(the tables update inside it, fused) and the dense optimizer step. Measured in one run, on the
same batches, for each Zipf exponent:

- ``all HBM``: every table ``DEVICE``, no cache: the ceiling;
- ``managed, no cache``: every table ``MANAGED`` (unified memory kept on the host), read and
  updated in place over the bus: what a user without this library would do;
- ``serial``: ``HOST_CACHED`` behind a slot cache of ``--cache-fraction`` of the rows, each
  forward prefetching its own batch;
- ``pipelined``: the same with ``PrefetchPipeline(depth=--depth)``, which prefetches the next
  batches on a side stream while this one trains; once per cache policy (every policy of
  ``tiered_tbe.cache.policy.POLICIES`` by default: lru, lfu, lookahead).

The cached runs repeat for each row mover of ``--mover`` (``zero_copy``: copy kernels read the
pinned tables in place; ``staged``: host threads gather into pinned buffers and the copy
engines carry them; see ``tiered_tbe.cache.mover``).

Reported: step time (wall clock over ``--batches`` steps after ``--warmup``, synchronized at both
ends), throughput against all-HBM measured in the same run, and the rows moved into the cache
per batch (``cache_stats().rows_copied_in / batches``) of each policy against LRU's.
Lookahead ranks rows by next-use hints that the pipeline writes; if none are seen during the
warm-up, the run is reported as such (it then behaves as LRU).

Without a GPU (CPU simulation) it runs at a tiny size to prove it works; its times mean nothing.

    tiered-tbe bench pipeline                                  # 26 tables, Zipf 1.05 and 1.2
    tiered-tbe bench pipeline --row-cap 1000000 --batches 10 --record r.jsonl
    tiered-tbe bench pipeline --policy lru lookahead --depth 4 --cache-fraction 0.1
    tiered-tbe bench pipeline --mover staged --policies lru --modes hbm pipelined
    python benchmarks/bench_pipeline.py ...                    # the same, from a checkout
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

from tiered_tbe import records
from tiered_tbe.base.mode import SIMULATION, default_device, describe_mode  # first: picks GPU / simulation mode
from tiered_tbe.benchmarks import common
from tiered_tbe.benchmarks.models import SmallDLRM, add_dlrm_flags, build_module, check_dlrm_args, make_batches
from tiered_tbe.cache.mover import MOVERS
from tiered_tbe.cache.policy import POLICIES
from tiered_tbe.pipeline import DEFAULT_LOOKAHEAD, PrefetchPipeline
from tiered_tbe.specs import CacheConfig, Placement

SCRIPT = "bench_pipeline.py"
GPU_DEFAULTS = dict(tables=26, row_cap=0, dim=128, batch_size=65536, bag_size=1, warmup=20, batches=20)
SIMULATION_DEFAULTS = dict(tables=3, row_cap=1000, dim=16, batch_size=8, bag_size=1, warmup=2, batches=2)
MODES = ("hbm", "managed", "serial", "pipelined")
BASELINE_POLICY = "lru"  # the serial run's policy, and what every policy's rows moved are divided by
CACHED_PLACEMENTS = tuple(p.value for p in Placement if p.is_cached)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add this benchmark's flags to ``parser`` (a new one if None): ``tiered-tbe bench pipeline`` and the script."""
    parser = parser or argparse.ArgumentParser(prog="python benchmarks/bench_pipeline.py")
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    common.add_table_flags(parser, GPU_DEFAULTS, SIMULATION_DEFAULTS)
    common.add_cache_flags(parser, list(POLICIES), several=True)
    run = parser.add_argument_group("run")
    run.add_argument("--depth", type=int, default=2, help="batches the pipeline prefetches ahead, 1..8 (default 2)")
    run.add_argument("--mover", nargs="+", default=["zero_copy"], choices=MOVERS,
                     help="row movers of the cached runs, each a model of its own (default zero_copy; "
                          "--mover zero_copy staged measures both)")
    run.add_argument("--placement", nargs="+", default=["host_cached"], choices=CACHED_PLACEMENTS,
                     help="backing stores of the cached runs, each a model of its own (default host_cached: "
                          "pinned memory; managed_cached: CUDA managed memory kept on the host, as FBGEMM's "
                          "MANAGED_CACHING)")
    run.add_argument("--mover-threads", type=int,
                     help="staged mover: torch intra-op threads per host copy (default: torch's)")
    run.add_argument("--staging-rows", type=int, help="staged mover: rows per staging buffer (default: the mover's)")
    run.add_argument("--lookahead", type=int, default=DEFAULT_LOOKAHEAD,
                     help=f"batches a lookahead cache learns from (default {DEFAULT_LOOKAHEAD})")
    run.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                     help=f"what to run (default: all): hbm, managed, serial ({BASELINE_POLICY}, prefetch in forward), "
                          "pipelined (every --policy)")
    run.add_argument("--warmup", type=int, help="steps before timing, per run (default 20; 2 in simulation)")
    run.add_argument("--batches", type=int, help="timed steps per run (default 20; 2 in simulation)")
    run.add_argument("--bounds-check", default="off", choices=["off", "raise"],
                     help="the module's bounds_check ('raise' adds a host sync per batch); default off")
    run.add_argument("--training-priority", default="high", choices=["default", "high"],
                     help="pipelined runs: PrefetchPipeline(high_priority=...): 'high' (the default) runs "
                          "each step on a high-priority stream, 'default' on the current stream")
    run.add_argument("--seed", type=int, default=0, help="seed of the weights, the lookups and the dense data")
    add_dlrm_flags(parser)
    common.add_output_flags(parser)
    return parser


def check_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the sizes left unset (GPU or simulation defaults); ``ValueError`` for flags that do not fit."""
    common.check_table_args(args, GPU_DEFAULTS, SIMULATION_DEFAULTS)
    if not 1 <= args.depth <= 8:
        raise ValueError("--depth must be between 1 and 8")
    if args.warmup < 0 or args.batches < 1 or args.lookahead < 0:
        raise ValueError("--warmup and --lookahead must be >= 0, --batches >= 1")
    for name in ("mover_threads", "staging_rows"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    check_dlrm_args(args)
    return args


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return check_args(args)
    except ValueError as error:
        parser.error(str(error))


def lookahead_hints(emb) -> bool:
    """Whether the cache has recorded next-use hints (the pipeline's window)."""
    return emb.cache is not None and emb.cache.window_bits is not None


def train(model: SmallDLRM, batches, args, pipelined: bool) -> dict:
    """Run ``warmup`` steps, then time ``batches`` steps (wall clock, synchronized at both ends)."""
    emb = model.embeddings
    lookahead = args.lookahead if emb.uses_lookahead else 0
    source = PrefetchPipeline(model, batches, depth=args.depth, lookahead=lookahead,
                              high_priority=args.training_priority == "high") if pipelined else None
    try:
        start, hints = train_steps(model, source if pipelined else batches, args)
    finally:
        if source is not None:
            source.close()
    common.synchronize()
    elapsed = time.perf_counter() - start
    stats = emb.cache_stats()
    batches_seen = max(stats.batches, 1)
    return dict(step_ms=elapsed / args.batches * 1e3, samples_per_s=args.batches * args.batch_size / elapsed,
                rows_in_per_batch=stats.rows_copied_in / batches_seen if emb.cache is not None else None,
                write_backs_per_batch=stats.write_backs / batches_seen if emb.cache is not None else None,
                hit_rate=stats.hit_rate_by_lookup if emb.cache is not None else None,
                lookahead_hints=hints if emb.uses_lookahead else None,
                stats=stats.as_dict())


def train_steps(model: SmallDLRM, source, args) -> tuple[float, bool]:
    """The loop of :func:`train` over ``source`` (batches, or a pipeline of them): returns the
    ``perf_counter`` time the timed steps started at and whether lookahead hints were seen."""
    emb = model.embeddings
    dense_optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    loss_fn = nn.BCEWithLogitsLoss()
    steps = args.warmup + args.batches
    hints = False
    start = None
    for i, (indices, offsets, dense, labels) in enumerate(source):
        if i == args.warmup:
            common.synchronize()
            emb.reset_cache_stats()
            start = time.perf_counter()
        loss = loss_fn(model(indices, offsets, dense), labels)
        dense_optimizer.zero_grad(set_to_none=True)
        loss.backward()  # the embedding tables update here, fused
        dense_optimizer.step()
        if i < args.warmup and emb.uses_lookahead and not hints:
            hints = lookahead_hints(emb)  # outside the timed steps: it reads the device
        if i + 1 == steps:
            break
    return start, hints


def run(args: argparse.Namespace) -> list[dict]:
    device = default_device()
    table_rows = common.table_rows_of(args)
    batches = {alpha: make_batches(table_rows, alpha, args, device) for alpha in args.alpha}

    # (label, placement, policy, mover, runs): the runs of one module, in order, each over every alpha.
    models = []
    if "hbm" in args.modes:
        models.append(("all HBM", Placement.DEVICE, None, None, ["serial"]))
    if "managed" in args.modes:
        models.append(("managed, no cache", Placement.MANAGED, None, None, ["serial"]))
    for placement in map(Placement, args.placement):
        for mover in args.mover:
            for policy in args.policies:
                # Pipelined first: every policy's pipelined runs then start from the same (empty) cache.
                runs = (["pipelined"] if "pipelined" in args.modes else []) + \
                       (["serial"] if policy == BASELINE_POLICY and "serial" in args.modes else [])
                if runs:
                    models.append((f"{placement.value} {policy}", placement, policy, mover, runs))

    results = []
    for label, placement, policy, mover, runs in models:
        start = time.perf_counter()
        cache = CacheConfig(fraction=args.cache_fraction, policy=policy,
                            associativity=args.associativity) if policy else None
        emb = build_module(table_rows, args.dim, placement, cache, args, mover=mover)
        model = SmallDLRM(emb, len(table_rows), args.dim, args.bottom_mlp, args.top_mlp).to(device)
        print(f"{label}" + (f" ({mover} mover)" if mover else "") + f": built in {time.perf_counter() - start:.1f} s",
              flush=True)
        for run_mode in runs:
            for alpha in args.alpha:
                measured = train(model, batches[alpha], args, pipelined=run_mode == "pipelined")
                results.append(dict(model=label, placement=placement.value, policy=policy, mover=mover, run=run_mode,
                                    alpha=alpha, **measured))
                print(f"  {run_mode} zipf {alpha:g}: step {measured['step_ms']:.3f} ms", flush=True)
        if emb.cache is not None:
            emb.cache.close()
        del model, emb
        common.free()

    for r in results:
        hbm = find(results, "all HBM", "serial", r["alpha"])
        lru = find(results, f"{r['placement']} {BASELINE_POLICY}", r["run"], r["alpha"], r["mover"])
        r["throughput_vs_hbm"] = r["samples_per_s"] / hbm["samples_per_s"] if hbm else None
        r["rows_vs_lru"] = (r["rows_in_per_batch"] / lru["rows_in_per_batch"]
                            if lru and r["rows_in_per_batch"] is not None and lru["rows_in_per_batch"] else None)
    return results


def find(results, model, run_mode, alpha, mover=None) -> dict | None:
    for r in results:
        if r["model"] == model and r["run"] == run_mode and r["alpha"] == alpha and r.get("mover") == mover:
            return r
    return None


def describe(r: dict, depth: int) -> str:
    mover = f", {r['mover']} mover" if r.get("mover") else ""
    if r["run"] == "pipelined":
        return f"{r['model']}{mover}, pipelined depth {depth}"
    return r["model"] if r["policy"] is None else f"{r['model']}{mover}, serial (prefetch in forward)"


def format_table(results: list[dict], args) -> list[str]:
    header = ["model", "lookups", "step ms", "samples/s", "throughput / all-HBM", "rows moved / batch",
              "rows moved / LRU's", "write-backs / batch", "hit rate (lookups)"]
    rows = []
    for r in results:
        name = describe(r, args.depth)
        note = " (no lookahead hints seen: ran as LRU)" if r["lookahead_hints"] is False else ""
        rows.append([
            name + note, f"zipf {r['alpha']:g}", common.fmt(r["step_ms"]), common.fmt(r["samples_per_s"], ",.0f"),
            common.fmt(r["throughput_vs_hbm"], ".2f"), common.fmt(r["rows_in_per_batch"], ",.0f"),
            common.fmt(r["rows_vs_lru"], ".2f"), common.fmt(r["write_backs_per_batch"], ",.0f"),
            common.fmt(r["hit_rate"], ".4f"),
        ])
    lines = records.markdown_table(header, rows, "ll" + "r" * (len(header) - 2))
    lines.append("")
    lines.append(f"Step = forward + backward (fused table update) + dense SGD step; dense matmuls "
                 f"{args.dense_precision if not SIMULATION else 'fp32 (CPU)'}. Rows moved = "
                 f"cache_stats().rows_copied_in / batches.")
    for alpha in args.alpha:
        for placement, mover in ((p, m) for p in args.placement for m in args.mover):
            lookahead = find(results, f"{placement} lookahead", "pipelined", alpha, mover)
            if lookahead and lookahead["rows_vs_lru"] is not None:
                note = (" (no next-use hints were written: it ran as LRU)" if lookahead["lookahead_hints"] is False
                        else "")
                lines.append(f"- zipf {alpha:g}, {placement}, {mover} mover: lookahead rows moved / LRU "
                             f"{lookahead['rows_vs_lru']:.2f}{note}")
    return lines


def measurements_of(results: list[dict], args) -> list[tuple[dict, dict]]:
    """``(configuration, figures)`` of each run and Zipf exponent, for ``--record``."""
    table_rows = common.table_rows_of(args)
    shared = dict(tables=len(table_rows), rows=sum(table_rows), dim=args.dim, dtype=args.dtype,
                  batch_size=args.batch_size, bag_size=args.bag_size, optimizer="rowwise_adagrad",
                  cache_fraction=args.cache_fraction, associativity=args.associativity, depth=args.depth,
                  lookahead=args.lookahead, training_priority=args.training_priority, bottom_mlp=args.bottom_mlp,
                  top_mlp=args.top_mlp, dense_precision=args.dense_precision, warmup=args.warmup,
                  batches=args.batches)
    return [({**shared, **{key: r[key] for key in ("model", "placement", "policy", "mover", "run", "alpha")}},
             {key: value for key, value in r.items()
              if key not in ("model", "placement", "policy", "mover", "run", "alpha")}) for r in results]


def run_command(args: argparse.Namespace, argv=None) -> int:
    """Run the benchmark for ``args``, print its table, write ``--json`` and ``--record``.

    ``tiered-tbe bench pipeline`` calls it with the CLI's arguments; :func:`main` with the script's.
    """
    check_args(args)
    print(describe_mode())
    if SIMULATION:
        print(common.SIMULATION_NOTE)
    print(f"{common.describe_tables(args)}, row-wise Adagrad; batch {args.batch_size} x bag {args.bag_size}; "
          f"cache {args.cache_fraction:g} of rows, {args.associativity} ways; pipeline depth {args.depth}, "
          f"lookahead window {args.lookahead}; pipelined steps on a {args.training_priority}-priority stream; "
          f"{args.warmup} warm-up + {args.batches} timed steps per run; on {records.device_name()}", flush=True)
    tf32 = None
    if not SIMULATION:
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = args.dense_precision == "tf32"
    try:
        results = run(args)
    finally:
        if tf32 is not None:
            torch.backends.cuda.matmul.allow_tf32 = tf32
    table = format_table(results, args)
    common.report(args, SCRIPT, argv, results, table, measurements_of(results, args))
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_command(parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
