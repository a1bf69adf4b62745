"""Plain descriptions of tables, where their rows live and how they are cached."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tiered_tbe.base.codes import MOVERS, Placement  # noqa: F401  (Placement re-exported: public API)


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: ``num_embeddings`` rows of ``embedding_dim`` columns."""

    num_embeddings: int
    embedding_dim: int
    name: str | None = None
    placement: Placement = Placement.DEVICE

    def __post_init__(self):
        if self.num_embeddings < 1:
            raise ValueError(f"table {self.name!r}: num_embeddings must be >= 1, got {self.num_embeddings}")
        if self.embedding_dim < 1:
            raise ValueError(f"table {self.name!r}: embedding_dim must be >= 1, got {self.embedding_dim}")
        if not isinstance(self.placement, Placement):
            object.__setattr__(self, "placement", Placement(self.placement))


_SIZE = re.compile(r"^\s*([0-9.]+)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {None: 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(size: int | str) -> int:
    """``"8GiB"`` -> 8589934592; an int passes through."""
    if isinstance(size, int):
        return size
    match = _SIZE.match(size)
    if not match:
        raise ValueError(f"cannot read {size!r} as a size in bytes (e.g. '8GiB', '500MB', 1024)")
    unit = match.group(2).lower() if match.group(2) else None
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class CacheConfig:
    """The GPU slot cache shared by every ``*_CACHED`` table of a module.

    Give exactly one size: ``slots`` (rows), ``memory`` (bytes of cached rows and their
    optimizer state, e.g. ``"8GiB"``) or ``fraction`` (of all cached rows). ``policy`` is
    ``"lru"``, ``"lfu"`` or ``"lookahead"``; ``associativity`` ways per set. A lookahead cache
    told of upcoming batches (a :class:`~tiered_tbe.PrefetchPipeline`) also holds 8 bytes of
    device memory per row of the cached tables for the hints, beyond ``memory``.
    ``lfu_decay_interval``: every this many prefetches, LFU halves every use count, so a
    once-hot row does not stay forever.

    ``mover``: how rows cross the bus (``tiered_tbe.cache.mover``): ``"zero_copy"`` (copy
    kernels read the backing store in place) or ``"staged"`` (host threads gather into pinned
    buffers, the copy engines carry them); None takes ``tiered_tbe.cache.DEFAULT_MOVER`` for the
    tables' placement. ``mover_threads``: torch intra-op threads of each of the staged mover's
    host threads (None: torch's default); ``staging_rows``: rows per staging buffer (None: the
    mover's default).
    """

    slots: int | None = None
    memory: int | str | None = None
    fraction: float | None = None
    policy: str = "lru"
    associativity: int = 32
    lfu_decay_interval: int = 64
    mover: str | None = None
    mover_threads: int | None = None
    staging_rows: int | None = None

    def __post_init__(self):
        given = [k for k in ("slots", "memory", "fraction") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"CacheConfig: give one of slots, memory, fraction; got {given}")
        if self.policy not in ("lru", "lfu", "lookahead"):
            raise ValueError(f"CacheConfig: policy must be 'lru', 'lfu' or 'lookahead', got {self.policy!r}")
        if self.associativity < 1:
            raise ValueError(f"CacheConfig: associativity must be >= 1, got {self.associativity}")
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise ValueError(f"CacheConfig: fraction must be in (0, 1], got {self.fraction}")
        if self.lfu_decay_interval < 1:
            raise ValueError(f"CacheConfig: lfu_decay_interval must be >= 1, got {self.lfu_decay_interval}")
        if self.mover is not None and self.mover not in MOVERS:
            raise ValueError(f"CacheConfig: mover must be one of {list(MOVERS)} or None, got {self.mover!r}")
        for name in ("mover_threads", "staging_rows"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"CacheConfig: {name} must be an int >= 1 or None, got {value!r}")

    def num_slots(self, cached_rows: int, bytes_per_slot: int) -> int:
        """Slots to allocate, rounded up to whole sets, at least one set."""
        if self.slots is not None:
            slots = self.slots
        elif self.memory is not None:
            slots = parse_bytes(self.memory) // bytes_per_slot
        else:
            slots = int(round((self.fraction if self.fraction is not None else 0.05) * cached_rows))
        sets = max(1, -(-slots // self.associativity))
        return sets * self.associativity
