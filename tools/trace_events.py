"""Reading a ``torch.profiler`` chrome trace: what the trace tools share.

- :func:`trace_events`: the events of a stopped profiler (written gzipped when asked);
- :func:`union_ms`, :func:`intersect`: busy time of interval sets;
- :func:`launch_times`: each CUDA launch's host time by correlation id;
- :func:`steady_steps`: a trace less its first step (the GPU waiting for the host after a sync).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def trace_events(prof, trace_path: Path | None) -> list[dict]:
    """The chrome-trace events of a stopped profiler; written gzipped to ``trace_path`` if given."""
    path = trace_path or Path(f"/tmp/trace_{id(prof)}.json")
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    if trace_path is not None:
        with gzip.open(f"{path}.gz", "wt") as gz:
            json.dump({"traceEvents": events}, gz)
    path.unlink()
    return events


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """Total length (ms) of the union of ``(start_us, end_us)`` intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total / 1e3


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intervals where both ``a`` and ``b`` (each made disjoint first) are busy."""
    def merged(xs):
        out = []
        for start, stop in sorted(xs):
            if out and start <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], stop))
            else:
                out.append((start, stop))
        return out
    a, b = merged(a), merged(b)
    i = j = 0
    both = []
    while i < len(a) and j < len(b):
        start, stop = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < stop:
            both.append((start, stop))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return both


def launch_times(events: list[dict]) -> dict[int, float]:
    """Host timestamp (us) of each CUDA launch or copy call, by its correlation id (which its GPU
    event carries too)."""
    return {e["args"]["correlation"]: e["ts"] for e in events
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}


def steady_steps(events: list[dict]) -> list[dict]:
    """``events`` less the first traced step's: its host annotations and the GPU work launched
    before the second ``step`` annotation began (matched to its launch by correlation id).

    The trace starts after a synchronize, so in its first step the GPU waits for the host to
    queue work again; that start-up gap (9 ms on the H200) is no idle time of training.
    Traces without two steps or without correlation ids come back whole."""
    starts = sorted(e["ts"] for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                    and e["name"] == "step")
    if len(starts) < 2:
        return events
    cutoff = starts[1]
    launched = launch_times(events)
    if not launched:
        return events
    kept = []
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") in GPU_CATEGORIES:
            if launched.get(e["args"].get("correlation"), cutoff) < cutoff:
                continue
        elif e.get("ts", cutoff) < cutoff:
            continue
        kept.append(e)
    return kept
