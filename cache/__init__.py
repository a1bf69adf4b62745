"""The memory hierarchy: backing stores in every tier and the GPU slot cache of hot rows.

- :mod:`~tiered_tbe.cache.tiers`: ``allocate`` a flat backing store (device, pinned host, managed).
- :mod:`~tiered_tbe.cache.policy`: the set-associative replacement policies and their registry
  ``POLICIES``, one definition compiled for the GPU kernels and the CPU simulator.
- :mod:`~tiered_tbe.cache.slot_cache`: ``SlotCache``, the slots in HBM and the decisions about
  them (hits, victims, locks, the remap; Numba kernels in ``_kernels``, launched by ``launch``);
  ``CacheBatch``, what a prefetch returns; ``releases``: the unlock and dirty marks of a batch (and
  their launches, for the backward's or the next prefetch's graph); ``hints``: the lookahead window
  (``MAX_LOOKAHEAD``, the most batches a hint can name after the next prefetch;
  ``DEFAULT_LOOKAHEAD``, how many a pipeline names unless told).
- :mod:`~tiered_tbe.cache.mover`: how rows cross the bus, ``zero_copy`` (copy kernels reading
  host memory in place) or ``staged`` (host threads, pinned staging, the copy engines).
- :mod:`~tiered_tbe.cache.simulator`: ``simulate``, an exact CPU replay of the same policy.
- :mod:`~tiered_tbe.cache.stats`: ``CacheStats``, the counters both report.
"""

from tiered_tbe.cache.hints import DEFAULT_LOOKAHEAD
from tiered_tbe.cache.mover import DEFAULT_MOVER, MOVERS
from tiered_tbe.cache.policy import EMPTY, NEXT_USE_UNKNOWN, NO_SLOT, POLICIES, POLICY_CODES
from tiered_tbe.cache.simulator import CacheSimulator, simulate, simulate_batches
from tiered_tbe.cache.slot_cache import MAX_LOOKAHEAD, CacheBatch, CachedTable, SlotCache
from tiered_tbe.cache.stats import CacheStats
from tiered_tbe.cache.tiers import TierBuffer, allocate

__all__ = [
    "CacheBatch", "CacheSimulator", "CacheStats", "CachedTable", "DEFAULT_LOOKAHEAD", "DEFAULT_MOVER", "EMPTY",
    "MAX_LOOKAHEAD", "MOVERS", "NEXT_USE_UNKNOWN", "NO_SLOT", "POLICIES", "POLICY_CODES",
    "SlotCache", "TierBuffer", "allocate", "simulate", "simulate_batches",
]
