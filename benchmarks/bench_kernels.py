"""Time the Triton TBE kernels against PyTorch's embedding bags on tables in device memory.

``--tables`` tables (default one) of ``--rows`` rows each, ``--dim`` columns of ``--dtype``; one
batch of ``--batch-size`` bags of ``--bag-size`` lookups per table. torch's side holds the same
rows in one ``EmbeddingBag`` (tables stacked, lookups shifted to global rows: how torch users
batch tables). Measured in one run, on the same rows and the same lookups:

- ``forward``: ``pooled_forward`` (sum) vs ``torch.nn.functional.embedding_bag``;
- ``fwd+bwd+sgd``: forward, then ``backward_update`` with SGD, vs ``nn.EmbeddingBag(sparse=True)``
  forward, ``backward()`` and ``torch.optim.SGD``;
- ``fwd+bwd+adagrad``: the same with row-wise Adagrad, vs ``torch.optim.Adagrad`` on the sparse
  gradient (element-wise Adagrad: torch has no row-wise one; it moves more state bytes);
- the device's copy bandwidth (a large ``dst.copy_(src)``, bytes read + written), as a ceiling.

Each time is the median of ``triton.testing.do_bench``. "GB/s" is the bytes of the looked-up rows
(lookups x dim x dtype size) over the time, for every line alike, so the columns compare directly.
Lookups are uniform (``--alpha 0``) or Zipf(alpha) over a random permutation of the rows
(``tiered_tbe.zipf``, the sampler of every trace and benchmark).

Without a GPU (CPU simulation) it runs at a tiny size to prove it works; its times mean nothing.

    tiered-tbe bench kernels                            # 20M x 128 rows, B=65536, L=32
    tiered-tbe bench kernels --alpha 1.05 --record r.jsonl   # one JSON line per measurement
    tiered-tbe bench kernels --tables 4 --rows 5000000 --dtype fp16
    python benchmarks/bench_kernels.py ...              # the same, from a checkout
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from tiered_tbe import records
from tiered_tbe.base.mode import SIMULATION, default_device, describe_mode  # first: picks GPU / simulation mode
from tiered_tbe.benchmarks import common, sampling
from tiered_tbe.kernels.backward import backward_update
from tiered_tbe.kernels.forward import pooled_forward
from tiered_tbe.kernels.rows import Lookups, RowStores, no_cache
from tiered_tbe.optimizers import SGD, RowwiseAdagrad

SCRIPT = "bench_kernels.py"
# Sizes used when none is given: the target workload on a GPU, a toy one in simulation.
GPU_DEFAULTS = dict(tables=1, rows=20_000_000, dim=128, batch_size=65536, bag_size=32, copy_gib=4.0)
SIMULATION_DEFAULTS = dict(tables=1, rows=1000, dim=16, batch_size=8, bag_size=4, copy_gib=0.001)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add this benchmark's flags to ``parser`` (a new one if None): ``tiered-tbe bench kernels`` and the script."""
    parser = parser or argparse.ArgumentParser(prog="python benchmarks/bench_kernels.py")
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    common.add_table_flags(parser, GPU_DEFAULTS, SIMULATION_DEFAULTS, criteo=False, alphas=(0.0, 1.05))
    run = parser.add_argument_group("run")
    run.add_argument("--copy-gib", type=float, help="GiB copied to measure device bandwidth (default 4)")
    run.add_argument("--rep-ms", type=float, default=300.0, help="do_bench repetition time per line, ms")
    run.add_argument("--seed", type=int, default=0, help="torch seed of the weights and lookups")
    common.add_output_flags(parser)
    return parser


def check_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the sizes left unset (GPU or simulation defaults); ``ValueError`` for flags that do not fit."""
    common.check_table_args(args, GPU_DEFAULTS, SIMULATION_DEFAULTS, criteo=False)
    return args


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return check_args(args)
    except ValueError as error:
        parser.error(str(error))


def device_stores(weights: torch.Tensor, state: torch.Tensor, num_tables: int) -> RowStores:
    """RowStores of ``num_tables`` tables stacked in ``weights`` [tables * rows, dim] (each ``rows``
    rows), ``state`` [tables * rows] their row-wise Adagrad sums (views, no copies)."""
    rows = weights.shape[0] // num_tables
    tables = tuple(weights[t * rows : (t + 1) * rows] for t in range(num_tables))
    states = tuple(state[t * rows : (t + 1) * rows, None] for t in range(num_tables))
    return RowStores(tables, states, *no_cache(weights.dtype, weights.device))


def measure_copy_bandwidth(gib: float, rep_ms: float, device: torch.device) -> tuple[float, float]:
    """``(ms, GB/s)`` of one ``dst.copy_(src)`` of ``gib`` GiB (bytes read + bytes written)."""
    numel = int(gib * 2**30) // 4
    source = torch.rand(numel, device=device)
    destination = torch.empty_like(source)
    ms = common.time_ms(lambda: destination.copy_(source), rep_ms)
    return ms, 2 * numel * 4 / ms / 1e6


def run(args: argparse.Namespace) -> list[dict]:
    device = default_device()
    torch.manual_seed(args.seed)
    dtype = common.DTYPES[args.dtype]
    num_tables, batch_size, bag_size = args.tables, args.batch_size, args.bag_size
    lookups_per_table = batch_size * bag_size
    num_lookups = num_tables * lookups_per_table
    row_bytes = num_lookups * args.dim * dtype.itemsize  # bytes of the looked-up rows
    lr = 0.01

    copy_ms, copy_gbs = measure_copy_bandwidth(args.copy_gib, args.rep_ms, device)
    results = [dict(op="device copy", alpha="-", ours_ms=copy_ms, ours_gbs=copy_gbs)]

    # The tables stacked in one tensor, shared by our kernels and torch's module (same rows, same memory).
    weights = torch.empty(num_tables * args.rows, args.dim, dtype=dtype, device=device).uniform_(-0.01, 0.01)
    adagrad_state = torch.zeros(num_tables * args.rows, device=device)
    stores = device_stores(weights, adagrad_state, num_tables)
    embedding = torch.nn.EmbeddingBag(num_tables * args.rows, args.dim, mode="sum", sparse=True, device="meta")
    embedding.weight = torch.nn.Parameter(weights)
    torch_sgd = torch.optim.SGD(embedding.parameters(), lr=lr)

    # TBE layout: bag t*B + b holds lookups offsets[t*B+b]..; torch gets the same T*B bags, in order.
    offsets = torch.arange(0, num_lookups + 1, bag_size, device=device)
    table_start = (torch.arange(num_tables, device=device) * args.rows).repeat_interleave(lookups_per_table)
    grad_output = torch.randn(batch_size, num_tables * args.dim, device=device)  # ours: [B, T * dim] fp32

    def as_torch_layout(pooled: torch.Tensor) -> torch.Tensor:
        """[B, T * dim] (ours) -> [T * B, dim] (torch's bags t*B + b)."""
        return pooled.view(batch_size, num_tables, args.dim).transpose(0, 1).reshape(-1, args.dim)

    torch_grad = as_torch_layout(grad_output).to(dtype)

    for alpha in args.alpha:
        indices = sampling.ZipfBatches([args.rows] * num_tables, alpha, batch_size, bag_size, device,
                                     seed=args.seed).next()[0]
        global_rows = indices + table_start
        lookups = Lookups(indices, offsets, batch_size)
        unique_rows = torch.unique(global_rows).numel()
        label = "uniform" if alpha == 0 else f"zipf {alpha:g}"

        def ours_forward(lookups=lookups):
            return pooled_forward(stores, lookups, None, "sum")

        def torch_forward(global_rows=global_rows):
            return F.embedding_bag(global_rows, weights, offsets[:-1], mode="sum")

        def ours_step(optimizer, lookups=lookups):
            pooled_forward(stores, lookups, None, "sum")
            backward_update(grad_output, stores, lookups, None, "sum", optimizer)

        def torch_step(optimizer, global_rows=global_rows):
            embedding(global_rows, offsets[:-1]).backward(torch_grad)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        # The two forwards agree (a check, not a timing); ours accumulates in fp32, torch in the dtype.
        tolerance = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
        torch.testing.assert_close(as_torch_layout(ours_forward()), torch_forward().float(), **tolerance)

        lines = [
            ("forward", ours_forward, torch_forward),
            ("fwd+bwd+sgd", lambda: ours_step(SGD(lr=lr)), lambda: torch_step(torch_sgd)),
        ]
        for op, ours, theirs in lines:
            ours_ms, torch_ms = common.time_ms(ours, args.rep_ms), common.time_ms(theirs, args.rep_ms)
            results.append(dict(op=op, alpha=label, ours_ms=ours_ms, torch_ms=torch_ms, unique=unique_rows))
        # torch's Adagrad keeps a dense sum per element (as large as the tables): make it last.
        torch_adagrad = torch.optim.Adagrad(embedding.parameters(), lr=lr, eps=1e-8)
        ours_ms = common.time_ms(lambda: ours_step(RowwiseAdagrad(lr=lr, eps=1e-8)), args.rep_ms)
        torch_ms = common.time_ms(lambda optimizer=torch_adagrad: torch_step(optimizer), args.rep_ms)
        results.append(dict(op="fwd+bwd+adagrad", alpha=label, ours_ms=ours_ms, torch_ms=torch_ms,
                            unique=unique_rows))
        del torch_adagrad

    for result in results:
        if "torch_ms" in result:
            result["ours_gbs"] = row_bytes / result["ours_ms"] / 1e6
            result["torch_gbs"] = row_bytes / result["torch_ms"] / 1e6
            result["speedup"] = result["torch_ms"] / result["ours_ms"]
    return results


def format_table(results: list[dict]) -> list[str]:
    lines = ["| op | lookups | unique rows | ours ms | torch ms | ours GB/s | torch GB/s | torch / ours |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        if "torch_ms" in r:
            lines.append(f"| {r['op']} | {r['alpha']} | {r['unique']} | {r['ours_ms']:.3f} | {r['torch_ms']:.3f} | "
                         f"{r['ours_gbs']:.4g} | {r['torch_gbs']:.4g} | {r['speedup']:.2f}x |")
        else:
            lines.append(f"| {r['op']} | - | - | {r['ours_ms']:.3f} | - | {r['ours_gbs']:.4g} | - | - |")
    return lines


def measurements_of(results: list[dict], args) -> list[tuple[dict, dict]]:
    """``(configuration, figures)`` of each line of the table, for ``--record``."""
    shared = dict(tables=args.tables, rows=args.rows, dim=args.dim, dtype=args.dtype, batch_size=args.batch_size,
                  bag_size=args.bag_size)
    found = []
    for r in results:
        if "torch_ms" not in r:  # the device copy
            found.append(({"op": r["op"], "gib": args.copy_gib}, {"ms": r["ours_ms"], "gbs": r["ours_gbs"]}))
            continue
        found.append(({**shared, "op": r["op"], "lookups": r["alpha"], "unique_rows": r["unique"]},
                      {key: r[key] for key in ("ours_ms", "torch_ms", "ours_gbs", "torch_gbs")}
                      | {"torch_over_ours": r["speedup"]}))
    return found


def run_command(args: argparse.Namespace, argv=None) -> int:
    """Run the benchmark for ``args``, print its table, write ``--json`` and ``--record``.

    ``tiered-tbe bench kernels`` calls it with the CLI's arguments; :func:`main` with the script's.
    """
    check_args(args)
    print(describe_mode())
    if SIMULATION:
        print("SIMULATION: Triton runs in its CPU interpreter; the timings below are meaningless.")
    lookups = args.tables * args.batch_size * args.bag_size
    print(f"{common.describe_tables(args)}, batch {args.batch_size} x bag {args.bag_size} per table "
          f"({lookups} lookups), on {records.device_name()}; baseline: torch.nn.EmbeddingBag in the same run")
    results = run(args)
    table = format_table(results)
    common.report(args, SCRIPT, argv, results, table, measurements_of(results, args))
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_command(parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
