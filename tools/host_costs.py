"""Host time of the small calls on a training step's path, warm, one call after another.

A DMP step on one H200 is host time (the GPU waits for the host, ``docs/TORCHREC.md``), so what a call
costs the host decides which of two equivalent forms a step uses: a graph's input copies, its
outputs' copies, events and streams, a replay. Each figure is the mean over ``--calls`` calls after
50 untimed ones. Inside a DMP step the same calls cost 3-5x more (cold caches behind TorchRec's
Python; ``tools/dmp_host_time.py`` measures them there): compare forms here, size them there.

    python tools/host_costs.py [--calls 2000] [--record results/measurements.jsonl]

Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from tiered_tbe import records
from tiered_tbe.base import graphs, streams

OUTPUTS = 5  # a prefetch graph's outputs: the remap, locked slots, bypassed rows, sorted rows, order
OUTPUT_ELEMENTS = 26 * 65536  # a Criteo batch's lookups (bench torchrec's shape)


def microseconds(call, calls: int) -> float:
    """Mean host microseconds of ``call()`` over ``calls`` calls, after 50 untimed ones."""
    for _ in range(50):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def calls_to_time(device: torch.device) -> dict:
    """Label -> a call without arguments."""
    stream = torch.cuda.current_stream(device)
    target = torch.empty(5, dtype=torch.int64, device=device)
    source = torch.arange(5, dtype=torch.int64)
    pinned = torch.empty(5, dtype=torch.int64, pin_memory=True)
    ring = graphs.staging(device)
    event = torch.cuda.Event()
    outputs = [torch.empty(OUTPUT_ELEMENTS, dtype=dtype, device=device)
               for dtype in (torch.int32, torch.int32, torch.int64, torch.int32, torch.int32)]
    six = [torch.empty(1000, dtype=torch.int32, device=device) for _ in range(6)]
    six_sources = [torch.empty(1000, dtype=torch.int32, device=device) for _ in range(6)]
    graph, counter = torch.cuda.CUDAGraph(), torch.zeros(1, device=device)
    with torch.cuda.graph(graph):
        counter.add_(1)

    def copies_in_one_op():
        copies = [torch.empty_like(output) for output in outputs]
        torch._foreach_copy_(copies, outputs)

    return {
        "PinnedRing.copy of 5 int64 (the forward's addresses)": lambda: ring.copy(target, source),
        "Tensor.copy_ pinned -> device, non_blocking (40 B)": lambda: target.copy_(pinned, non_blocking=True),
        "Tensor.copy_ host -> pinned (40 B)": lambda: pinned.copy_(source),
        "Tensor.numpy().tobytes() (40 B)": lambda: source.numpy().tobytes(),
        "Event.record() (finds the current stream itself)": lambda: event.record(),
        "Event.record(stream)": lambda: event.record(stream),
        "streams.record(event, device)": lambda: streams.record(event, device),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(device),
        "streams.current_stream(device)": lambda: streams.current_stream(device),
        "Event.query()": lambda: event.query(),
        f"{OUTPUTS} clones of a prefetch's outputs": lambda: [output.clone() for output in outputs],
        f"{OUTPUTS} empty_like + one _foreach_copy_ of them": copies_in_one_op,
        "_foreach_copy_ of 6 int32 tensors": lambda: torch._foreach_copy_(six, six_sources),
        "6 Tensor.copy_ of int32 tensors": lambda: [a.copy_(b) for a, b in zip(six, six_sources)],
        "torch.empty of a batch's int32 [N]": lambda: torch.empty(OUTPUT_ELEMENTS, dtype=torch.int32, device=device),
        "torch.tensor([step]) on the host": lambda: torch.tensor([5], dtype=torch.int64),
        "CUDAGraph.replay() of one kernel": graph.replay,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000, help="timed calls of each (default 2000)")
    parser.add_argument("--record", metavar="PATH", help="append one JSON line of the figures to PATH")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_costs.py needs a CUDA device (it times calls that enqueue GPU work)", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    figures = {label: microseconds(call, args.calls) for label, call in calls_to_time(device).items()}
    width = max(map(len, figures))
    for label, value in figures.items():
        print(f"{label:{width}s} {value:8.2f} us")
    if args.record:
        records.append(args.record, [records.measurement(
            "host-costs", "python tools/host_costs.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            dict(calls=args.calls), {"host_us": figures})])
    return 0


if __name__ == "__main__":
    sys.exit(main())
