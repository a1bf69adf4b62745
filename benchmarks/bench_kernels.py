"""Time the Triton TBE kernels against PyTorch's embedding bags on one table in device memory.

Measured in one run, on the same rows and the same lookups:

- ``forward``: ``pooled_forward`` (sum) vs ``torch.nn.functional.embedding_bag``;
- ``fwd+bwd+sgd``: forward, then ``backward_update`` with SGD, vs ``nn.EmbeddingBag(sparse=True)``
  forward, ``backward()`` and ``torch.optim.SGD``;
- ``fwd+bwd+adagrad``: the same with row-wise Adagrad, vs ``torch.optim.Adagrad`` on the sparse
  gradient (element-wise Adagrad: torch has no row-wise one; it moves more state bytes);
- the device's copy bandwidth (a large ``dst.copy_(src)``, bytes read + written), as a ceiling.

Each time is the median of ``triton.testing.do_bench``. "GB/s" is the bytes of the looked-up rows
(lookups x dim x 4) over the time, for every line alike, so the columns compare directly.
Lookups are uniform (``--alpha 0``) or Zipf(alpha) over a random permutation of the rows.

Without a GPU (CPU simulation) it runs at a tiny size to prove it works; its times mean nothing.

    python benchmarks/bench_kernels.py                       # 20M x 128 rows, B=65536, L=32
    python benchmarks/bench_kernels.py --alpha 1.05 --record  # append the results to RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tiered_tbe._mode import SIMULATION, default_device, describe_mode
from tiered_tbe.kernels.backward import backward_update  # importing tiered_tbe.* picks GPU / simulation mode
from tiered_tbe.kernels.forward import pooled_forward
from tiered_tbe.kernels.rows import TIER_DEVICE, Lookups, RowStores
from tiered_tbe.optimizers import OptimizerKind

RESULTS = Path(__file__).with_name("RESULTS.md")
# Sizes used when none is given: the target workload on a GPU, a toy one in simulation.
GPU_DEFAULTS = dict(rows=20_000_000, dim=128, batch_size=65536, bag_size=32, copy_gib=4.0)
SIMULATION_DEFAULTS = dict(rows=1000, dim=16, batch_size=8, bag_size=4, copy_gib=0.001)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, help="rows of the table (default 20M on a GPU, 1000 in simulation)")
    parser.add_argument("--dim", type=int, help="embedding dim (default 128; 16 in simulation)")
    parser.add_argument("--batch-size", type=int, help="bags per batch (default 65536; 8 in simulation)")
    parser.add_argument("--bag-size", type=int, help="lookups per bag (default 32; 4 in simulation)")
    parser.add_argument("--alpha", type=float, nargs="+", default=[0.0, 1.05],
                        help="lookup distributions: 0 = uniform, else Zipf exponent (default: 0 1.05)")
    parser.add_argument("--copy-gib", type=float, help="GiB copied to measure device bandwidth (default 4)")
    parser.add_argument("--rep-ms", type=float, default=300.0, help="do_bench repetition time per line, ms")
    parser.add_argument("--record", action="store_true", help=f"append the results to {RESULTS}")
    parser.add_argument("--results-file", type=Path, default=RESULTS, help="where --record appends")
    parser.add_argument("--seed", type=int, default=0, help="torch seed of the weights and lookups")
    args = parser.parse_args(argv)
    defaults = SIMULATION_DEFAULTS if SIMULATION else GPU_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def time_ms(fn, rep_ms: float) -> float:
    """Median milliseconds of ``fn()``: ``do_bench`` on a GPU, a wall clock in simulation."""
    if SIMULATION:
        fn()  # warm up (the interpreter caches nothing, but the first call imports)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    import triton.testing

    return triton.testing.do_bench(fn, warmup=max(25.0, rep_ms / 4), rep=rep_ms, quantiles=[0.5, 0.2, 0.8])[0]


def sample_rows(num_rows: int, num_lookups: int, alpha: float, device: torch.device) -> torch.Tensor:
    """int64 [num_lookups]: uniform rows (alpha 0), or Zipf(alpha) ranks mapped through a random
    permutation, so hot rows are scattered over the table. Inverse CDF by ``searchsorted``."""
    if alpha == 0:
        return torch.randint(0, num_rows, (num_lookups,), device=device)
    ranks = torch.arange(1, num_rows + 1, device=device, dtype=torch.float64)
    cdf = torch.cumsum(ranks.pow_(-alpha), 0)
    cdf /= cdf[-1].clone()
    drawn = torch.searchsorted(cdf, torch.rand(num_lookups, device=device, dtype=torch.float64))
    del cdf, ranks
    return torch.randperm(num_rows, device=device)[drawn.clamp_(max=num_rows - 1)]


def one_table_stores(weights: torch.Tensor, state: torch.Tensor) -> RowStores:
    """RowStores of one DEVICE table: ``weights`` fp32 [rows, dim] (flat view), ``state`` its Adagrad sums."""
    device = weights.device
    rows, dim = weights.shape
    empty = torch.empty(0, device=device)
    return RowStores(
        weights.view(-1), empty, empty, state, empty, empty,
        table_tier=torch.tensor([TIER_DEVICE], dtype=torch.int32, device=device),
        table_weight_offset=torch.zeros(1, dtype=torch.int64, device=device),
        table_state_offset=torch.zeros(1, dtype=torch.int64, device=device),
        table_dim=torch.tensor([dim], dtype=torch.int32, device=device),
        table_output_offset=torch.zeros(1, dtype=torch.int32, device=device),
        cache_weights=torch.empty(0, 1, device=device), cache_state=torch.empty(0, 1, device=device),
        max_dim=dim, total_dim=dim)


def git_commit() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                                cwd=Path(__file__).parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).parent).stdout.strip()
        return commit + ("+uncommitted" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def measure_copy_bandwidth(gib: float, rep_ms: float, device: torch.device) -> tuple[float, float]:
    """``(ms, GB/s)`` of one ``dst.copy_(src)`` of ``gib`` GiB (bytes read + bytes written)."""
    numel = int(gib * 2**30) // 4
    source = torch.rand(numel, device=device)
    destination = torch.empty_like(source)
    ms = time_ms(lambda: destination.copy_(source), rep_ms)
    return ms, 2 * numel * 4 / ms / 1e6


def run(args: argparse.Namespace) -> list[dict]:
    device = default_device()
    torch.manual_seed(args.seed)
    num_lookups = args.batch_size * args.bag_size
    row_bytes = num_lookups * args.dim * 4
    lr = 0.01

    copy_ms, copy_gbs = measure_copy_bandwidth(args.copy_gib, args.rep_ms, device)
    results = [dict(op="device copy", alpha="-", ours_ms=copy_ms, ours_gbs=copy_gbs)]

    # One table, shared by our kernels and torch's modules (same rows in the same memory).
    weights = torch.empty(args.rows, args.dim, device=device).uniform_(-0.01, 0.01)
    adagrad_state = torch.zeros(args.rows, device=device)
    stores = one_table_stores(weights, adagrad_state)
    embedding = torch.nn.EmbeddingBag(args.rows, args.dim, mode="sum", sparse=True, device="meta")
    embedding.weight = torch.nn.Parameter(weights)
    torch_sgd = torch.optim.SGD(embedding.parameters(), lr=lr)

    offsets = torch.arange(0, num_lookups + 1, args.bag_size, device=device)
    bag_of_index = torch.arange(args.batch_size, device=device).repeat_interleave(args.bag_size)
    slot_of_index = torch.full((num_lookups,), -1, dtype=torch.int32, device=device)
    grad_output = torch.randn(args.batch_size, args.dim, device=device)

    for alpha in args.alpha:
        indices = sample_rows(args.rows, num_lookups, alpha, device)
        lookups = Lookups(indices, offsets, bag_of_index, indices, None, args.batch_size)
        unique_rows = torch.unique(indices).numel()
        label = "uniform" if alpha == 0 else f"zipf {alpha:g}"

        def ours_forward(lookups=lookups):
            return pooled_forward(stores, lookups, slot_of_index, "sum")

        def torch_forward(indices=indices):
            return F.embedding_bag(indices, weights, offsets[:-1], mode="sum")

        def ours_step(kind, lookups=lookups):
            pooled_forward(stores, lookups, slot_of_index, "sum")
            backward_update(grad_output, stores, lookups, slot_of_index, "sum", kind, lr=lr, eps=1e-8)

        def torch_step(optimizer, indices=indices):
            embedding(indices, offsets[:-1]).backward(grad_output)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        # The two forwards agree (a check, not a timing).
        torch.testing.assert_close(ours_forward(), torch_forward(), rtol=1e-4, atol=1e-5)

        lines = [
            ("forward", ours_forward, torch_forward),
            ("fwd+bwd+sgd", lambda: ours_step(OptimizerKind.SGD), lambda: torch_step(torch_sgd)),
        ]
        for op, ours, theirs in lines:
            ours_ms, torch_ms = time_ms(ours, args.rep_ms), time_ms(theirs, args.rep_ms)
            results.append(dict(op=op, alpha=label, ours_ms=ours_ms, torch_ms=torch_ms, unique=unique_rows))
        # torch's Adagrad keeps a dense fp32 sum per element (as large as the table): make it last.
        torch_adagrad = torch.optim.Adagrad(embedding.parameters(), lr=lr, eps=1e-8)
        ours_ms = time_ms(lambda: ours_step(OptimizerKind.ROWWISE_ADAGRAD), args.rep_ms)
        torch_ms = time_ms(lambda optimizer=torch_adagrad: torch_step(optimizer), args.rep_ms)
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


def main(argv=None) -> None:
    args = parse_args(argv)
    print(describe_mode())
    if SIMULATION:
        print("SIMULATION: Triton runs in its CPU interpreter; the timings below are meaningless.")
    device_name = "CPU simulation" if SIMULATION else torch.cuda.get_device_name()
    print(f"table {args.rows} x {args.dim} fp32, batch {args.batch_size} x bag {args.bag_size} "
          f"({args.batch_size * args.bag_size} lookups), on {device_name}")
    table = format_table(run(args))
    print("\n".join(table))
    if args.record:
        header = "" if args.results_file.exists() else "# Benchmark results\n"
        command = "python " + " ".join(["benchmarks/bench_kernels.py", *sys.argv[1:]])
        with args.results_file.open("a") as results_file:
            results_file.write(
                f"{header}\n## bench_kernels, {datetime.date.today().isoformat()}, {device_name}, "
                f"commit {git_commit()}\n\n`{command}`"
                f"{' (simulation: times meaningless)' if SIMULATION else ''}\n\n" + "\n".join(table) + "\n")
        print(f"appended to {args.results_file}")


if __name__ == "__main__":
    main()
