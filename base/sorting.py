"""Sorting row ids on the fewest bits that hold them.

torch sorts CUDA integers with a radix sort whose passes grow with the key's width: an int64
key costs about twice an int32 one. Row ids of a module rarely reach 2^31, so the sorts of
prefetch, write-back and backward run on int32 keys when they fit.
"""

from __future__ import annotations

import torch

from .codes import INT32_MAX, INT64_MAX


def sort_ids(ids: torch.Tensor, upper_bound: int, stable: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.sort(ids, stable=stable)`` of int64 ids, on int32 keys when they fit.

    Args:
        ids: int64 [N], each in ``[0, upper_bound)`` or equal to ``INT64_MAX`` (a "none" marker,
            which sorts last and comes back unchanged).
        upper_bound: exclusive bound of the ids other than the marker.
        stable: keep equal ids in their input order.

    Returns:
        (sorted ids int64 [N], order int64 [N]) as ``torch.sort`` returns them.
    """
    if upper_bound > INT32_MAX or ids.numel() == 0:
        return torch.sort(ids, stable=stable)
    keys = torch.where(ids == INT64_MAX, INT32_MAX, ids).to(torch.int32)
    sorted_keys, order = torch.sort(keys, stable=stable)
    return torch.where(sorted_keys == INT32_MAX, INT64_MAX, sorted_keys.long()), order
