"""The backward's sort alone: ``torch.sort`` against CUB's radix sort with a bit range.

The backward groups a batch's lookups by global row with a stable sort (``kernels/grouping.py``).
``torch.sort`` sorts all 32 bits of int32 keys and carries int64 positions. CUB's
``DeviceRadixSort`` (through NVIDIA's ``cuda-cccl`` package, ``cuda.compute``) can sort only the
bits the rows need (``end_bit`` = bit length of the last row) and carry int32 positions: fewer
passes and fewer bytes a pass. This times both on the keys of ``bench_fbgemm`` configurations,
checks they agree bitwise, and checks CUB's sort replays in a CUDA graph.

GPU only; prints why and exits 0 without a GPU or without ``cuda.compute``.

    python benchmarks/bench_sort.py --configs big-zipf-sgd criteo-adagrad
"""

from __future__ import annotations

import argparse
import sys

import torch

from tiered_tbe.base.mode import SIMULATION, default_device, describe_mode  # first: picks GPU / simulation mode
from tiered_tbe.benchmarks import common
from tiered_tbe.benchmarks.bench_phases import capture
from tiered_tbe.benchmarks.fbgemm_configs import CONFIGS

HBM_CONFIGS = [c.name for c in CONFIGS if not c.cached]


class _Stream:
    """``torch.cuda`` stream in the ``__cuda_stream__`` protocol that ``cuda.compute`` reads."""

    def __init__(self, stream: torch.cuda.Stream):
        self.stream = stream

    def __cuda_stream__(self):
        return (0, self.stream.cuda_stream)


def measure(config, reps: int, cc) -> None:
    """Times the sorts of one configuration's batch (prints; nothing returned)."""
    device = default_device()
    name = config.name
    rows = list(config.tables)
    batches = common.ZipfBatches(rows, config.alpha, config.batch_size, config.bag_size, device, seed=1)
    indices, offsets = batches.next()
    keys = common.global_rows(indices, offsets, rows).to(torch.int32)
    n = keys.numel()
    end_bit = max(1, (sum(rows) - 1).bit_length())

    def torch_sort():
        return torch.sort(keys, stable=True)

    positions = torch.arange(n, dtype=torch.int32, device=device)
    out_keys = torch.empty_like(keys)
    out_positions = torch.empty_like(positions)
    sorter = cc.make_radix_sort(d_in_keys=keys, d_out_keys=out_keys, d_in_values=positions,
                                d_out_values=out_positions, order=cc.SortOrder.ASCENDING)

    def cub_sort(bits=end_bit):
        stream = _Stream(torch.cuda.current_stream(device))
        need = sorter(temp_storage=None, d_in_keys=keys, d_out_keys=out_keys, d_in_values=positions,
                      d_out_values=out_positions, num_items=n, begin_bit=0, end_bit=bits, stream=stream)
        if cub_sort.temp is None or cub_sort.temp.numel() < need:
            cub_sort.temp = torch.empty(need, dtype=torch.uint8, device=device)
        sorter(temp_storage=cub_sort.temp, d_in_keys=keys, d_out_keys=out_keys, d_in_values=positions,
               d_out_values=out_positions, num_items=n, begin_bit=0, end_bit=bits, stream=stream)
        return out_keys, out_positions

    cub_sort.temp = None

    def cub_sort_32():
        return cub_sort(32)

    def iota_and_cub_sort():
        positions.copy_(torch.arange(n, dtype=torch.int32, device=device))
        return cub_sort()

    reference_keys, reference_order = torch_sort()
    got_keys, got_positions = cub_sort()
    torch.cuda.synchronize(device)
    same = torch.equal(reference_keys, got_keys) and torch.equal(reference_order.to(torch.int32), got_positions)
    print(f"{name}: {n} keys, {end_bit} bits, CUB equals torch.sort bitwise: {same}")
    results = {}
    for label, fn in (("torch.sort (32-bit keys, int64 positions)", torch_sort),
                      (f"CUB radix sort, {end_bit} bits, int32 positions", cub_sort),
                      ("CUB radix sort, 32 bits, int32 positions", cub_sort_32),
                      (f"iota + CUB radix sort, {end_bit} bits", iota_and_cub_sort)):
        eager = common.event_ms(fn, reps, warmup=5)
        try:
            graph, _ = capture(fn, device)
            replay = common.event_ms(graph.replay, reps, warmup=5)
        except Exception as error:  # noqa: BLE001 - report what broke the capture
            replay = float("nan")
            print(f"  {label}: graph capture failed: {type(error).__name__}: {error}")
        results[label] = (eager, replay)
        print(f"  {label}: eager {eager:.4f} ms, graph replay {replay:.4f} ms")
    got_keys, got_positions = cub_sort()
    torch.cuda.synchronize(device)
    same = torch.equal(reference_keys, got_keys) and torch.equal(reference_order.to(torch.int32), got_positions)
    print(f"  after the graphs, CUB still equals torch.sort: {same}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["big-zipf-sgd", "big-uniform-sgd", "criteo-adagrad"],
                        choices=HBM_CONFIGS)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args(argv)
    print(describe_mode())
    if SIMULATION:
        print("bench_sort times GPU sorts: nothing to do in CPU simulation")
        return 0
    try:
        import cuda.compute as cc
    except ImportError as error:
        print(f"cuda.compute (pip install cuda-cccl) does not import: {error}")
        return 0
    by_name = {c.name: c for c in CONFIGS}
    for name in args.configs:
        measure(by_name[name], args.reps, cc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
