"""Write the lookups of a ``bench fbgemm`` configuration as a trace for ``tiered-tbe bench hit-rate``.

The exact simulator then says how many rows each policy would move on the configuration's own
batches (its tables, Zipf exponent, bag lengths and batch sizes), before any GPU time is spent:

    python tools/bench_trace.py cached-mixed-weighted-z0.6 70 /tmp/z06.pt
    tiered-tbe bench hit-rate --trace file --file /tmp/z06.pt --table-rows <printed> \\
        --cache-sizes 10% --policies lru,lfu,lookahead --lookahead-window 8 --full-window --warmup 36

The batches come from the benchmark's own sampler (``benchmarks/sampling.ZipfBatches``) on the CPU:
the same distribution as a GPU run, not the same rows (the GPU draws with its own generator).
The file is a list of ``(indices, offsets)`` pairs, one TBE batch each (table-local int64 rows,
table-major; offsets of ``T * B + 1`` entries), which ``--trace file`` reads with ``--table-rows``.
The script prints the lookups a batch and the ``--table-rows`` value.
"""

from __future__ import annotations

import argparse
import sys

import torch


def write_trace(name: str, count: int, path: str, seed: int = 0) -> list[int]:
    """Draw ``count`` batches of configuration ``name`` on the CPU and save them to ``path``;
    returns the rows of each table."""
    from tiered_tbe.benchmarks.fbgemm_configs import CONFIG_NAMES, CONFIGS
    from tiered_tbe.benchmarks.sampling import ZipfBatches

    if name not in CONFIG_NAMES:
        raise SystemExit(f"unknown configuration {name!r}; choose from {CONFIG_NAMES}")
    config = next(c for c in CONFIGS if c.name == name)
    sampler = ZipfBatches(config.tables, config.alpha, config.batch_size, config.bag_size, "cpu", seed=seed,
                          bag_lengths=config.bag_lengths, min_batch_size=config.min_batch_size)
    # clone: a batch of fixed shape shares one offsets tensor with the sampler.
    batches = [tuple(t.clone() for t in sampler.next()) for _ in range(count)]
    torch.save(batches, path)
    lookups = sum(indices.numel() for indices, _ in batches) / max(count, 1)
    print(f"{name}: {count} batches, {lookups:,.0f} lookups a batch, written to {path}")
    return list(config.tables)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="a configuration of tiered-tbe bench fbgemm --list")
    parser.add_argument("batches", type=int, help="batches to draw")
    parser.add_argument("path", help="the .pt file to write")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampler (default 0)")
    args = parser.parse_args(argv)
    if args.batches < 1:
        parser.error("batches must be at least 1")
    table_rows = write_trace(args.config, args.batches, args.path, args.seed)
    print(f"--table-rows {','.join(map(str, table_rows))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
