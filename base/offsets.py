"""The one check of an offsets array: 1-D, starts at 0, never decreases, ends at the item count.

FBGEMM's TBE ``offsets`` (``T * B + 1`` entries, bag ``j`` is ``indices[offsets[j]:offsets[j + 1]]``)
and a trace's batch and bag offsets obey the same rule; the module's validation, the trace
readers and the simulator all call this file, so the rule and its messages are written once.

- :func:`offsets_problem`: on the host (numpy array or CPU tensor), the first thing wrong, named.
- :func:`check_offsets`: the same, raising ``ValueError``.
- :func:`offsets_are_bad`: a bool tensor on the offsets' device, computed without a host sync,
  for a batch whose verdict is read later (a prefetch; see ``tiered_tbe.validation``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class OffsetsProblem:
    """What is wrong with an offsets array: ``message`` names the entries and their values;
    ``decreasing_at`` is the ``j`` of the first ``offsets[j + 1] < offsets[j]`` (the bag or batch
    ``j`` that ends before it starts), None for any other problem."""

    message: str
    decreasing_at: int | None = None


def offsets_problem(offsets, end: int, name: str = "offsets", end_name: str = "len(indices)") -> OffsetsProblem | None:
    """The first problem of ``offsets`` (1-D integers: a numpy array or a tensor, read on the host), or None.

    Args:
        offsets: the array, ``[count + 1]``.
        end: what its last entry must be (the number of indices, lookups or rows it splits).
        name, end_name: how the messages call the array and ``end``.
    """
    if isinstance(offsets, torch.Tensor):
        offsets = offsets.detach().cpu().numpy()
    offsets = np.asarray(offsets)
    if offsets.ndim != 1 or offsets.shape[0] < 1:
        return OffsetsProblem(f"{name} must be 1-D with at least one entry, got shape {offsets.shape}")
    if offsets[0] != 0:
        return OffsetsProblem(f"{name}[0] must be 0, got {int(offsets[0])}")
    if offsets[-1] != end:
        return OffsetsProblem(f"{name}[-1] must equal {end_name} = {end}, got {int(offsets[-1])}")
    decreasing = np.flatnonzero(offsets[1:] < offsets[:-1])
    if decreasing.size:
        j = int(decreasing[0])
        return OffsetsProblem(f"{name} must be non-decreasing: {name}[{j + 1}] = {int(offsets[j + 1])} < "
                              f"{name}[{j}] = {int(offsets[j])}", decreasing_at=j)
    return None


def check_offsets(offsets, end: int, name: str = "offsets", end_name: str = "len(indices)") -> None:
    """Raises:
        ValueError: the message of :func:`offsets_problem`, when there is a problem.
    """
    problem = offsets_problem(offsets, end, name, end_name)
    if problem is not None:
        raise ValueError(problem.message)


def offsets_are_bad(offsets: torch.Tensor, end: int) -> torch.Tensor:
    """bool scalar tensor on ``offsets``' device: whether :func:`offsets_problem` would find a
    problem in ``offsets`` (1-D, at least one entry). Queues a few reductions, no host sync."""
    return (offsets[1:] < offsets[:-1]).any() | (offsets[0] != 0) | (offsets[-1] != end)
