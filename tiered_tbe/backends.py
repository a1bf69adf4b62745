"""Which implementation of the TBE math a module runs: the Triton kernels or their plain-torch reference.

``"triton"`` (default) runs ``kernels/forward.py`` and ``kernels/backward.py``. ``"torch"`` runs
``kernels/reference.py``: the same results computed in fp64 with gathers and ``index_add_``
(round to nearest only). It is far slower on a GPU, but far faster than the Triton interpreter
on a CPU, which makes it the backend for long CPU-simulation tests of the cache and the
pipeline, whose logic does not depend on which backend computes the rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tiered_tbe.base.graphs import to_device
from tiered_tbe.kernels import backward, forward, hint_rows, per_sample_weights, reference


@dataclass(frozen=True)
class KernelBackend:
    name: str
    forward: Callable  # (stores, lookups, slot_of_index, pooling, graphs=None, copies=None) -> fp32 output
    backward_update: Callable  # (grad_output, stores, lookups, slot_of_index, pooling, optimizer, step, ...) -> None
    #                            (graphs=, presorted=: used by the triton kernels, ignored by the reference;
    #                            then=: launches enqueued after the update, in its graph where it has one;
    #                            copies=: the rows the forward read in place, kernels/in_place_copies.py)
    per_sample_weights_grad: Callable  # (grad_output, stores, lookups, slot_of_index, pooling) -> fp32 [N]
    rounds_stochastically: bool  # whether backward_update can round fp16 / bf16 weights stochastically
    hint_rows: Callable  # (indices, feature_starts, num_rows_of_feature, row_offset, num_rows) -> (rows, count)


def _reference_forward(stores, lookups, slot_of_index, pooling, graphs=None, copies=None):
    return reference.reference_forward(stores, lookups, slot_of_index, pooling, copies=copies).float()


def _reference_backward_update(grad_output, stores, lookups, slot_of_index, pooling, optimizer, step=1,
                               stochastic_rounding: bool = False, seed: int = 0, graphs=None, presorted=None,
                               then=None, copies=None):
    if stochastic_rounding:
        raise ValueError("backend='torch' rounds to nearest only: use backend='triton' for stochastic rounding")
    reference.reference_backward_update(grad_output, stores, lookups, slot_of_index, pooling, optimizer, step,
                                        copies=copies)
    if then is not None:
        then.enqueue(to_device(then.inputs, grad_output.device))


def _reference_per_sample_weights_grad(*args) -> torch.Tensor:
    return reference.reference_per_sample_weights_grad(*args).float()


BACKENDS = {
    "triton": KernelBackend("triton", forward.pooled_forward, backward.backward_update,
                            per_sample_weights.per_sample_weights_grad, rounds_stochastically=True,
                            hint_rows=hint_rows.hint_rows),
    "torch": KernelBackend("torch", _reference_forward, _reference_backward_update,
                           _reference_per_sample_weights_grad, rounds_stochastically=False,
                           hint_rows=hint_rows.hint_rows_reference),
}


def backend_named(name: str) -> KernelBackend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {name!r}") from None
