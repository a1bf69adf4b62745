"""Plain descriptions of tables, where their rows live and how they are cached."""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass

import torch

from tiered_tbe.base.codes import Placement  # noqa: F401  (re-exported: public API)
from tiered_tbe.cache.mover import MOVERS
from tiered_tbe.cache.policy import DEFAULT_POLICY, POLICIES, check_gpu_ways, round_to_sets

# Weights dtypes by the names the command line and the benchmarks use (``--dtype``).
WEIGHTS_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _is_whole_number(value) -> bool:
    """An int (or numpy integer), not a bool and not a float that happens to be whole."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: ``num_embeddings`` rows of ``embedding_dim`` columns."""

    num_embeddings: int
    embedding_dim: int
    name: str | None = None
    placement: Placement = Placement.DEVICE

    def __post_init__(self):
        # An unnamed table's index is not known here: the message then names the TableSpec.
        where = f"table {self.name!r}" if self.name is not None else "TableSpec"
        for field_name in ("num_embeddings", "embedding_dim"):
            value = getattr(self, field_name)
            if not _is_whole_number(value) or value < 1:
                raise ValueError(f"{where}: {field_name} must be a whole number >= 1, got {value!r}")
            object.__setattr__(self, field_name, int(value))  # a numpy integer becomes a plain int
        if not isinstance(self.placement, Placement):
            object.__setattr__(self, "placement", Placement(self.placement))


# The default in_place_copies: a copy row per this many slots (CacheConfig.copy_rows).
SLOTS_PER_COPY_ROW = 16
_SIZE = re.compile(r"^\s*([0-9.]+)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {None: 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(size: int | str) -> int:
    """``"8GiB"`` -> 8589934592; an int passes through."""
    if _is_whole_number(size):
        return int(size)
    match = _SIZE.match(size) if isinstance(size, str) else None
    if not match:
        raise ValueError(f"cannot read {size!r} as a size in bytes (e.g. '8GiB', '500MB', 1024)")
    unit = match.group(2).lower() if match.group(2) else None
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class CacheConfig:
    """The GPU slot cache shared by every ``*_CACHED`` table of a module.

    Give exactly one size: ``slots`` (rows, >= 1), ``memory`` (bytes of cached rows and their
    optimizer state, e.g. ``"8GiB"``; at least one slot's worth) or ``fraction`` (of all cached
    rows, in ``(0, 1]``; default 0.05). The size is rounded up to whole sets
    (:func:`tiered_tbe.cache.policy.round_to_sets`). ``policy``: a name of the registry
    :data:`tiered_tbe.cache.policy.POLICIES` (``"lru"``, ``"lfu"``, ``"lookahead"``, ``"lfu-admit"``);
    ``associativity`` ways per set. A lookahead cache told of upcoming batches (a
    :class:`~tiered_tbe.PrefetchPipeline`) also holds 8 bytes of device memory per row of the
    cached tables for the hints, and an ``lfu-admit`` cache 2 bytes per row for its use counts, beyond
    ``memory``. ``lfu_decay_interval``: every this many
    prefetches, LFU halves every use count, so a once-hot row does not stay forever.

    ``mover``: how rows cross the bus (``tiered_tbe.cache.mover``): ``"zero_copy"`` (copy
    kernels read the backing store in place) or ``"staged"`` (host threads gather into pinned
    buffers, the copy engines carry them); None takes ``tiered_tbe.cache.DEFAULT_MOVER`` for the
    tables' placement. ``mover_threads``: threads (torch's and numba's) of each of the staged mover's
    host threads (None: all cores); ``staging_rows``: rows per staging buffer (None: the
    mover's default).

    ``in_place_copies``: rows of device memory (of the largest cached dim, beyond ``memory``) where a
    training forward copies the rows it reads in place (those given no slot: refused by
    ``lfu-admit``, or their set all locked), so that its backward reads them there instead of across
    the bus again (``kernels/in_place_copies.py``); a batch with more such rows reads the others from
    their stores. None: a sixteenth of the slots; 0: none. ``tiered-tbe bench hit-rate`` reports the rows
    a batch of a workload reads in place, beside that default.
    """

    slots: int | None = None
    memory: int | str | None = None
    fraction: float | None = None
    policy: str = DEFAULT_POLICY
    associativity: int = 32
    lfu_decay_interval: int = 64
    mover: str | None = None
    mover_threads: int | None = None
    staging_rows: int | None = None
    in_place_copies: int | None = None

    def __post_init__(self):
        given = [k for k in ("slots", "memory", "fraction") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"CacheConfig: give one of slots, memory, fraction; got {given}")
        if self.policy not in POLICIES:
            raise ValueError(f"CacheConfig: policy must be one of {', '.join(map(repr, POLICIES))}, "
                             f"got {self.policy!r}")
        for name in ("associativity", "lfu_decay_interval"):
            value = getattr(self, name)
            if not _is_whole_number(value) or value < 1:
                raise ValueError(f"CacheConfig: {name} must be a whole number >= 1, got {value!r}")
        check_gpu_ways(self.associativity)
        if self.slots is not None and (not _is_whole_number(self.slots) or self.slots < 1):
            raise ValueError(f"CacheConfig: slots must be a whole number >= 1, got {self.slots!r}")
        if self.memory is not None:
            try:
                memory = parse_bytes(self.memory)
            except ValueError as error:
                raise ValueError(f"CacheConfig: memory: {error}") from None
            if memory < 1:
                raise ValueError(f"CacheConfig: memory must be at least one slot's worth of bytes, got {self.memory!r}")
        if self.fraction is not None and not (isinstance(self.fraction, numbers.Real) and 0 < self.fraction <= 1):
            raise ValueError(f"CacheConfig: fraction must be in (0, 1], got {self.fraction!r}")
        if self.mover is not None and self.mover not in MOVERS:
            raise ValueError(f"CacheConfig: mover must be one of {list(MOVERS)} or None, got {self.mover!r}")
        for name in ("mover_threads", "staging_rows"):
            value = getattr(self, name)
            if value is not None and (not _is_whole_number(value) or value < 1):
                raise ValueError(f"CacheConfig: {name} must be a whole number >= 1 or None, got {value!r}")
        if self.in_place_copies is not None and (not _is_whole_number(self.in_place_copies)
                                                 or self.in_place_copies < 0):
            raise ValueError(f"CacheConfig: in_place_copies must be a whole number >= 0 or None, "
                             f"got {self.in_place_copies!r}")

    def copy_rows(self, num_slots: int) -> int:
        """Rows of ``in_place_copies`` for a cache of ``num_slots`` slots."""
        return max(1, num_slots // SLOTS_PER_COPY_ROW) if self.in_place_copies is None else self.in_place_copies

    def num_slots(self, cached_rows: int, bytes_per_slot: int) -> int:
        """Slots to allocate for ``cached_rows`` rows, a slot taking ``bytes_per_slot`` bytes
        (``SlotCache.slot_bytes``): no more than the rows (a larger size asked caches every row),
        rounded up to whole sets, at least one set.

        Raises:
            ValueError: ``memory`` smaller than one slot.
        """
        if self.slots is not None:
            slots = self.slots
        elif self.memory is not None:
            slots = parse_bytes(self.memory) // bytes_per_slot
            if slots < 1:
                raise ValueError(f"CacheConfig: memory={self.memory!r} holds no slot: a slot takes "
                                 f"{bytes_per_slot} bytes (its row, its optimizer state and its cache state)")
        else:
            slots = max(1, int(round((self.fraction if self.fraction is not None else 0.05) * cached_rows)))
        return round_to_sets(min(slots, cached_rows), self.associativity)
