"""What a slot cache keeps on the device beside its rows, and so what a slot and a row of its tables cost.

:class:`~tiered_tbe.cache.slot_cache.SlotCache` allocates its metadata from :data:`SLOT_METADATA`, and the
memory planner (``tiered_tbe/memory.py``) sizes a cache with :func:`slot_bytes` and :func:`row_bytes`:
one table of the state, so the size of a slot cannot drift from what is allocated.
"""

from __future__ import annotations

import torch

from tiered_tbe.cache.policy import EMPTY, NEXT_USE_UNKNOWN, policy_named

# The per-slot metadata and its dtypes.
SLOT_METADATA = {"tags": torch.int64, "last_use": torch.int64, "use_count": torch.int32, "dirty": torch.uint8,
                 "locks": torch.int32, "next_use": torch.int64}
SLOT_METADATA_FILL = {"tags": EMPTY, "next_use": NEXT_USE_UNKNOWN}  # the others start at 0
SLOT_SCRATCH_BYTES = torch.int8.itemsize  # the policy kernels' way_of_rank, per slot
# Device bytes per row of the cached tables: bypass_count (uint8); window_bits (int64) once a lookahead cache
# is told of upcoming batches; row_uses (int16) for a policy that counts rows.
BYPASS_ROW_BYTES = torch.uint8.itemsize
HINT_ROW_BYTES = torch.int64.itemsize
ROW_USES_DTYPE = torch.int16


def slot_bytes(row_width: int, state_width: int, weights_dtype: torch.dtype) -> int:
    """Device bytes of one slot: its row (``row_width`` values of ``weights_dtype``), its fp32
    optimizer state (``state_width`` values) and its metadata (tag, policy state, dirty bit,
    lock: 33 bytes; a byte of the policy kernels' scratch)."""
    metadata = sum(dtype.itemsize for dtype in SLOT_METADATA.values()) + SLOT_SCRATCH_BYTES
    return row_width * weights_dtype.itemsize + 4 * state_width + metadata


def row_bytes(policy: str) -> int:
    """Device bytes the cache keeps per row of its tables (global rows ``0 .. R-1``), beyond its
    slots: the bypass counts, the lookahead window's bits for a policy that reads them, and the use
    counts of a policy that counts rows."""
    entry = policy_named(policy)
    return (BYPASS_ROW_BYTES + (HINT_ROW_BYTES if entry.reads_window else 0)
            + (ROW_USES_DTYPE.itemsize if entry.counts_rows else 0))
