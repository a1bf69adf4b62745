"""A binary search in Triton, shared by the cache's kernels and the TBE kernels: where each value falls among
ascending starts (of the cached tables, of the features' lookups)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def starts_at_or_below(
    starts_ptr,  # int32/int64 [count]: ascending starts; only the first count are read
    values,  # int64 tensor: the values to place among them
    valid,  # bool, values' shape: which to search for (the others get 0)
    count,  # starts searched
    SEARCH_STEPS: tl.constexpr,  # steps of the search: at least count.bit_length()
):
    """int32 of values' shape: how many of ``starts_ptr[0:count]`` are at or below each value
    (``torch.searchsorted(starts[:count], values, right=True)``); less one, the last start at or below it."""
    low = tl.zeros(values.shape, dtype=tl.int32)
    high = tl.zeros(values.shape, dtype=tl.int32) + count
    for _ in range(SEARCH_STEPS):
        searching = valid & (low < high)
        middle = (low + high) // 2
        at_or_below = tl.load(starts_ptr + middle, mask=searching, other=0) <= values
        low = tl.where(searching & at_or_below, middle + 1, low)
        high = tl.where(searching & ~at_or_below, middle, high)
    return low
