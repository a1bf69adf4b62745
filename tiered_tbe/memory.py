"""What a module's tables and cache will take, checked against what the device and the host have,
before anything is allocated.

A cache or a table too large for the machine otherwise fails late and badly: a raw allocator
error, or, for host memory, the kernel's out-of-memory killer ending the process. The check
counts every buffer a module allocates (each tier's backing stores, the cache's slots and its
per-row state), by where it lives: on the device (``DEVICE`` tables, the slot cache) or on the
host (``HOST`` and ``MANAGED`` tables; in CPU simulation everything, the "device" being host
memory). It reads what is free when the module is built (``torch.cuda.mem_get_info``; the host's
``MemAvailable``): enough to refuse what cannot fit, not a promise that what passes will train
(activations, the dense model and other processes take memory too).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tiered_tbe.base.codes import Placement
from tiered_tbe.base.host_memory import meminfo_bytes
from tiered_tbe.base.mode import SIMULATION
from tiered_tbe.cache.slot_cache import SlotCache
from tiered_tbe.specs import SLOTS_PER_COPY_ROW, CacheConfig, TableSpec
from tiered_tbe.storage import tier_bytes

# Of the room left for a cache, the share a suggested size takes (the rest: the training's own
# tensors, which no one can count here).
_SUGGESTED_SHARE = 0.8


@dataclass(frozen=True)
class CachePlan:
    """The slot cache a module will build over its ``*_CACHED`` tables."""

    config: CacheConfig
    num_slots: int
    row_width: int  # columns of a slot row: the largest cached dim
    state_width: int  # fp32 optimizer-state values per slot: the largest cached table's
    cached_rows: int  # rows of the cached tables
    rows_end: int  # one past the last global row of the cached tables (per-row cache state)
    slot_bytes: int
    copy_rows: int  # rows of the module's copies of rows read in place (CacheConfig.in_place_copies)
    copy_row_bytes: int  # bytes of one: row_width values of the weights' dtype

    @property
    def device_bytes(self) -> int:
        return (self.num_slots * self.slot_bytes + self.rows_end * SlotCache.row_bytes(self.config.policy)
                + self.copy_rows * self.copy_row_bytes)


def plan_cache(tables: list[TableSpec], state_width: list[int], weights_dtype: torch.dtype,
               config: CacheConfig) -> CachePlan:
    """The cache ``config`` asks for over the ``*_CACHED`` tables (at least one), its slots capped
    at the cached rows (``CacheConfig.num_slots``)."""
    cached = [t for t, s in enumerate(tables) if s.placement.is_cached]
    row_width = max(tables[t].embedding_dim for t in cached)
    slot_state_width = max(state_width[t] for t in cached)
    slot_bytes = SlotCache.slot_bytes(row_width, slot_state_width, weights_dtype)
    cached_rows = sum(tables[t].num_embeddings for t in cached)
    rows_end = sum(s.num_embeddings for s in tables[: cached[-1] + 1])
    num_slots = config.num_slots(cached_rows, slot_bytes)
    return CachePlan(config, num_slots, row_width, slot_state_width, cached_rows, rows_end, slot_bytes,
                     config.copy_rows(num_slots), row_width * weights_dtype.itemsize)


def host_available_bytes() -> int:
    """Bytes of host memory available to a new allocation without swapping: ``MemAvailable`` of
    /proc/meminfo (Linux), else the free physical pages."""
    available = meminfo_bytes("MemAvailable")
    return available if available is not None else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_free_bytes(device: torch.device) -> int:
    """Free bytes of the GPU ``device``: the driver's count (other processes included), plus what
    torch's caching allocator holds unused (it hands that out first)."""
    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def size(nbytes: float) -> str:
    """``1.5 GiB``, ``12.0 MiB``, ``512 B``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{int(nbytes)} B"


def check_memory(tables: list[TableSpec], state_width: list[int], weights_dtype: torch.dtype, state_layout: str,
                 device: torch.device, cache: CachePlan | None) -> None:
    """Refuse, before any allocation, a module whose buffers cannot fit where they would live.

    Raises:
        ValueError: saying what is asked and what is free where it does not fit, and, for the
            cache, a ``memory=`` and ``fraction=`` that fit.
    """
    if device.type not in ("cuda", "cpu"):  # (a meta device allocates nothing)
        return
    on_device = device.type == "cuda" and not SIMULATION
    device_name = str(device) if on_device else "the host (CPU simulation: the device's memory is the host's)"
    # (where, what, bytes): where is "device" or "host".
    needs = [("device" if placement is Placement.DEVICE and on_device else "host", what, nbytes)
             for placement, (what, nbytes) in tier_bytes(tables, state_width, weights_dtype, state_layout).items()]
    if cache is not None:
        cache_where = "device" if on_device else "host"
        needs.append((cache_where, f"the slot cache ({cache.num_slots:,} slots of {cache.slot_bytes} B, "
                                   f"{SlotCache.row_bytes(cache.config.policy)} B per row of its tables and "
                                   f"{cache.copy_rows:,} copy rows of {cache.copy_row_bytes} B)",
                      cache.device_bytes))
    available = {"host": host_available_bytes()}
    if on_device:
        available["device"] = device_free_bytes(device)
    where_named = {"device": f"free on {device_name}", "host": "available on the host" if on_device
                   else f"available on {device_name}"}

    for where in ("device", "host"):
        asked = [(what, nbytes) for place, what, nbytes in needs if place == where]
        total = sum(nbytes for _, nbytes in asked)
        if where not in available or total <= available[where]:
            continue
        parts = "; ".join(f"{what}: {size(nbytes)}" for what, nbytes in asked if nbytes)
        message = f"the module needs {size(total)} ({parts}); {size(available[where])} {where_named[where]}"
        if cache is None or cache_where != where:
            raise ValueError(f"{message}: the tables do not fit (fewer or smaller tables, or a placement in "
                             "the other memory)")
        room = available[where] - (total - cache.device_bytes) - cache.rows_end * SlotCache.row_bytes(
            cache.config.policy)
        raise ValueError(f"{message}: {_cache_asked(cache)} does not fit. {_what_fits(cache, room)}")


def _cache_asked(cache: CachePlan) -> str:
    config = cache.config
    asked = (f"memory={config.memory!r}" if config.memory is not None else f"slots={config.slots!r}"
             if config.slots is not None else f"fraction={config.fraction if config.fraction is not None else 0.05}")
    return f"CacheConfig({asked})"


def _what_fits(cache: CachePlan, room: int) -> str:
    """A cache size that fits ``room`` bytes of slots and copy rows, in the CacheConfig's words."""
    per_slot = cache.slot_bytes
    if cache.config.in_place_copies is None:  # the default: a copy row per SLOTS_PER_COPY_ROW slots
        per_slot += cache.copy_row_bytes / SLOTS_PER_COPY_ROW
    else:
        room -= cache.copy_rows * cache.copy_row_bytes
    slots = int(room * _SUGGESTED_SHARE / per_slot) // cache.config.associativity * cache.config.associativity
    if slots < cache.config.associativity:
        return ("No cache fits beside the tables: use fewer or smaller tables, or place them where there is "
                "room (HOST_CACHED keeps their rows in host memory)")
    # Rounded down: each of these becomes at most `slots` slots (CacheConfig rounds up to whole sets).
    nbytes = slots * cache.slot_bytes
    memory = f"{nbytes // 2**20}MiB" if nbytes >= 100 * 2**20 else f"{nbytes // 2**10}KiB" \
        if nbytes >= 100 * 2**10 else str(nbytes)
    fraction = f"{slots / cache.cached_rows:.2e}" if slots < cache.cached_rows / 1000 else \
        f"{(slots * 1000 // cache.cached_rows) / 1000:g}"
    return (f"Use at most memory='{memory}' ({slots:,} slots), fraction={fraction} of the {cache.cached_rows:,} "
            f"cached rows, or slots={slots}")

