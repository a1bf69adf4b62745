"""The memory hierarchy: backing stores in every tier and the GPU slot cache of hot rows.

- :mod:`~tiered_tbe.cache.tiers`: ``allocate`` a flat backing store (device, pinned host, managed).
- :mod:`~tiered_tbe.cache.policy`: the set-associative replacement policies and their registry
  ``POLICIES``, one definition compiled for the GPU kernels and the CPU simulator.
- :mod:`~tiered_tbe.cache.slot_cache`: ``SlotCache``, the slots in HBM and their Numba kernels;
  ``MAX_LOOKAHEAD``, the most batches a lookahead hint can name after the next prefetch.
- :mod:`~tiered_tbe.cache.simulator`: ``simulate``, an exact CPU replay of the same policy.
- :mod:`~tiered_tbe.cache.stats`: ``CacheStats``, the counters both report.
"""

from tiered_tbe.cache.policy import EMPTY, NEXT_USE_UNKNOWN, NO_SLOT, POLICIES, POLICY_CODES
from tiered_tbe.cache.simulator import CacheSimulator, simulate, simulate_batches
from tiered_tbe.cache.slot_cache import MAX_LOOKAHEAD, CachedTable, SlotCache
from tiered_tbe.cache.stats import CacheStats
from tiered_tbe.cache.tiers import TierBuffer, allocate

__all__ = [
    "CacheSimulator", "CacheStats", "CachedTable", "EMPTY", "MAX_LOOKAHEAD", "NEXT_USE_UNKNOWN", "NO_SLOT",
    "POLICIES", "POLICY_CODES",
    "SlotCache", "TierBuffer", "allocate", "simulate", "simulate_batches",
]
