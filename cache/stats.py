"""Counters of the slot cache, shared by the GPU cache and the CPU simulator."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class CacheStats:
    """Counters since the last reset.

    A *unique* row is counted once per batch (prefetch), however many lookups name it.
    ``unique_misses`` counts rows not in the cache when their batch was prefetched;
    ``misses_no_slot`` those of them read and updated in the backing store instead (slot -1):
    kept out by an admission policy, barred while a batch in flight reads the row there, or
    ``misses_set_full``: their set had no unlocked way left for them (its ways locked by the
    batches in flight, or taken by the batch's misses before them). Rows copied in =
    ``unique_misses - misses_no_slot``.
    """

    batches: int = 0
    lookups: int = 0
    lookup_hits: int = 0  # lookups whose row was already cached when their batch was prefetched
    unique_rows: int = 0
    unique_hits: int = 0
    unique_misses: int = 0
    misses_no_slot: int = 0
    misses_set_full: int = 0  # of misses_no_slot: no unlocked way of their set left
    evictions: int = 0  # valid rows replaced by a missed row
    write_backs: int = 0  # evicted (or flushed) rows that were dirty and written back
    bytes_in: int = 0  # backing store -> cache (rows and their optimizer state)
    bytes_out: int = 0  # cache -> backing store

    @property
    def rows_copied_in(self) -> int:
        return self.unique_misses - self.misses_no_slot

    @property
    def hit_rate_by_lookup(self) -> float:
        return self.lookup_hits / self.lookups if self.lookups else 0.0

    @property
    def hit_rate_by_unique(self) -> float:
        return self.unique_hits / self.unique_rows if self.unique_rows else 0.0

    def __add__(self, other: CacheStats) -> CacheStats:
        return CacheStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(rows_copied_in=self.rows_copied_in, hit_rate_by_lookup=self.hit_rate_by_lookup,
                   hit_rate_by_unique=self.hit_rate_by_unique)
        return out
