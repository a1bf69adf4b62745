"""Where a step's GPU time goes, kernel by kernel, and how close each phase runs to copy bandwidth.

``kernel_ms_per_step`` runs steps under ``torch.profiler`` and sums each kernel's device time
(every stream) per step and per phase (prefetch, forward, backward: the steps mark them with
:func:`phase`): the profile that says which phase, and which kernel in it, a side-by-side gap
lives in. ``copy_bandwidth_gbs`` measures the device-to-device copy rate of this GPU in the same run, and
``step_bytes`` counts the bytes a TBE training step cannot avoid moving (each lookup's row read
once by the forward, the pooled output written, the output gradient read once, each unique row
and its optimizer state read and written once by the fused update): bytes / time / copy rate is
the fraction of copy bandwidth a phase reaches.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import re

import torch

from tiered_tbe.base.mode import SIMULATION
from tiered_tbe.benchmarks import common

# A profiled step's phases are marked with ``record_function(PHASE_MARK + phase)`` (:func:`phase`).
PHASE_MARK = "tiered_tbe.phase:"
# What a kernel outside every marked phase is counted as.
OTHER_PHASE = "other"

# True while kernel_ms_per_step profiles: only then does `phase` mark and wait (a timed step must not).
_marking_phases = False


def short_kernel_name(name: str, width: int | None = None) -> str:
    """A kernel's name as a profile lists it: the function's own name, without its namespaces, C++
    template arguments, argument list or Numba's ABI tags (``void fbgemm_gpu::(anonymous
    namespace)::lru_cache_insert_kernel<float, ...>(...)`` -> ``lru_cache_insert_kernel``,
    ``tiered_tbe::cache::_kernels::move_rows_kernel[abi:v23](Array<...>)`` -> ``move_rows_kernel``);
    cut to ``width`` characters when given."""
    name = name.replace("(anonymous namespace)::", "")
    kept, open_brackets = [], []
    for character in name:  # keep what lies outside every <...> and (...), however nested
        if character in "<(":
            open_brackets.append(character)
        elif open_brackets and character == {"<": ">", "(": ")"}[open_brackets[-1]]:
            open_brackets.pop()
        elif not open_brackets:
            kept.append(character)
    name = re.sub(r"\[abi:[^\]]*\]", "", "".join(kept)).strip()  # Numba's ABI tags
    name = name.removeprefix("void ").strip().rsplit("::", 1)[-1] or name
    return name if width is None or len(name) <= width else name[: width - 1] + "…"


@contextlib.contextmanager
def phase(name: str):
    """One phase of a step (``prefetch``, ``forward``, ``backward``). While :func:`kernel_ms_per_step`
    profiles, the phase is marked for the profiler and ends by waiting for the device, so that every
    kernel it launched (on any stream, from any thread: the autograd thread's backward too) runs
    inside its mark; otherwise nothing (a timed step must not wait)."""
    if not _marking_phases:
        yield
        return
    with torch.profiler.record_function(PHASE_MARK + name):
        yield
        common.synchronize()


def kernel_ms_per_step(run_steps, steps: int) -> list[tuple[str, str, float]]:
    """``run_steps()`` runs ``steps`` steps, their phases marked by :func:`phase`; returns ``(phase,
    kernel, device ms per step)`` of every kernel (and memcpy / memset), longest first. A kernel's
    phase is the mark it runs inside (``OTHER_PHASE`` outside every mark): found by time, not by
    which call launched it, since a CUDA graph's kernels are not linked to a launching op. Empty
    in simulation (nothing runs on a device)."""
    if SIMULATION:
        run_steps()
        return []
    torch.cuda.synchronize()
    return profile_phases(run_steps, steps, [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                          lambda event: event.device_type == torch.autograd.DeviceType.CUDA)


def profile_phases(run_steps, steps: int, activities, is_kernel) -> list[tuple[str, str, float]]:
    """:func:`kernel_ms_per_step` with the profiler's ``activities`` and the events that count as
    kernels (``is_kernel(event)``) given: a test runs it on the CPU, with CPU ops as the kernels."""
    global _marking_phases
    _marking_phases = True
    try:
        with torch.profiler.profile(activities=activities) as profile:
            run_steps()
            common.synchronize()
    finally:
        _marking_phases = False
    events = profile.events()
    # The host's marks (the profiler may also list each mark's span on the GPU, under the same name).
    marks = sorted((event.time_range.end, event.time_range.start, event.name.removeprefix(PHASE_MARK))
                   for event in events
                   if event.name.startswith(PHASE_MARK) and event.device_type == torch.autograd.DeviceType.CPU)
    mark_ends = [end for end, _, _ in marks]
    totals: dict[tuple[str, str], float] = collections.defaultdict(float)
    for event in events:
        if is_kernel(event) and not event.name.startswith(PHASE_MARK):
            # A phase's kernels start after its mark began (launched inside it) and end before the
            # mark does (it waits for them): the first mark to end after a kernel's start is its
            # phase if that mark had begun by then.
            start = event.time_range.start
            at = bisect.bisect_left(mark_ends, start)
            name = marks[at][2] if at < len(marks) and marks[at][1] <= start else OTHER_PHASE
            totals[(name, short_kernel_name(event.name))] += event.time_range.elapsed_us() / 1e3 / steps
    return sorted(((name, kernel, ms) for (name, kernel), ms in totals.items()), key=lambda item: -item[2])


def phase_totals(profile: list[tuple[str, str, float]]) -> dict[str, float]:
    """Device ms per step of each phase's kernels, summed from a :func:`kernel_ms_per_step` profile."""
    totals: dict[str, float] = collections.defaultdict(float)
    for name, _, ms in profile:
        totals[name] += ms
    return dict(totals)


def copy_bandwidth_gbs(megabytes: int = 1024) -> float:
    """GB/s (bytes read plus bytes written) of a device-to-device tensor copy; NaN in simulation."""
    if SIMULATION:
        return float("nan")
    source = torch.empty(megabytes << 18, dtype=torch.float32, device="cuda")
    target = torch.empty_like(source)
    return 2 * source.numel() * 4 / common.time_ms(lambda: target.copy_(source), rep_ms=100) / 1e6


def step_bytes(num_lookups: int, unique_rows: int, batch_size: int, total_dim: int, row_bytes: int,
               state_bytes: int) -> dict[str, int]:
    """Bytes a training step must move: ``forward`` (every lookup's row read, the fp32 output
    written) and ``backward`` (the fp32 output gradient read, each unique row and its state read
    and written once)."""
    output = batch_size * total_dim * 4
    return {"forward": num_lookups * row_bytes + output,
            "backward": output + 2 * unique_rows * (row_bytes + state_bytes)}
