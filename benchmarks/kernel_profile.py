"""Where a step's GPU time goes, kernel by kernel, and how close each phase runs to copy bandwidth.

``kernel_ms_per_step`` runs steps under ``torch.profiler`` and sums each kernel's device time
(every stream) per step: the profile that says which kernel a side-by-side gap lives in.
``copy_bandwidth_gbs`` measures the device-to-device copy rate of this GPU in the same run, and
``step_bytes`` counts the bytes a TBE training step cannot avoid moving (each lookup's row read
once by the forward, the pooled output written, the output gradient read once, each unique row
and its optimizer state read and written once by the fused update): bytes / time / copy rate is
the fraction of copy bandwidth a phase reaches.
"""

from __future__ import annotations

import collections
import re

import torch

from tiered_tbe.base.mode import SIMULATION
from tiered_tbe.benchmarks import common


def short_kernel_name(name: str, width: int = 60) -> str:
    """A kernel's name without template arguments and argument lists, at most ``width`` characters."""
    name = re.sub(r"<.*>", "", name)  # C++ template arguments (FBGEMM's kernels)
    name = re.sub(r"\(.*\)", "", name).strip()
    name = name.removeprefix("void ")
    return name if len(name) <= width else name[: width - 1] + "…"


def kernel_ms_per_step(run_steps, steps: int) -> list[tuple[str, float]]:
    """``run_steps()`` runs ``steps`` steps; returns ``(kernel, device ms per step)``, longest first.
    Empty in simulation (nothing runs on a device)."""
    if SIMULATION:
        run_steps()
        return []
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as profile:
        run_steps()
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    for event in profile.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            us = getattr(event, "device_time", None)
            if us is None:
                us = event.cuda_time
            totals[short_kernel_name(event.name)] += us / 1e3 / steps
    return sorted(totals.items(), key=lambda item: -item[1])


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
