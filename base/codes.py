"""Codes and sentinels shared by the cache, the kernels and the public API."""

from __future__ import annotations

import enum

import torch

INT64_MAX = torch.iinfo(torch.int64).max
INT32_MAX = torch.iinfo(torch.int32).max


class Placement(enum.Enum):
    """Where the rows of a table live.

    ``DEVICE``: GPU memory (HBM). ``HOST``: pinned host memory, read in place by the GPU over
    the bus. ``MANAGED``: CUDA unified memory advised to stay on the host and be accessed in
    place by the GPU. ``HOST_CACHED`` / ``MANAGED_CACHED``: the same backing stores, with hot
    rows also held in the GPU slot cache. In CPU simulation mode every store is a CPU tensor.
    """

    DEVICE = "device"
    HOST = "host"
    MANAGED = "managed"
    HOST_CACHED = "host_cached"
    MANAGED_CACHED = "managed_cached"

    @property
    def is_cached(self) -> bool:
        return self in (Placement.HOST_CACHED, Placement.MANAGED_CACHED)

    @property
    def backing(self) -> Placement:
        """The store that holds every row: the placement itself, less the cache."""
        return {Placement.HOST_CACHED: Placement.HOST, Placement.MANAGED_CACHED: Placement.MANAGED}.get(
            self, self
        )
