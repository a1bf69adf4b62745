"""The autograd wiring: forward runs the pooled kernel, backward the fused optimizer update.

The weights are not autograd leaves: the backward pass updates them in place (the optimizer
is fused), so the only gradient that leaves it is that of ``per_sample_weights``.
"""

from __future__ import annotations

import weakref

import torch

from tiered_tbe import validation


class TieredEmbeddingBagsFunction(torch.autograd.Function):
    """``apply(module, batch, grad_anchor, per_sample_weights) -> output``.

    ``batch`` (a :class:`tiered_tbe.batch.PreparedBatch`) carries the lookups and the slot
    remap of its prefetch; ``grad_anchor`` is an empty tensor that requires grad, so that
    backward runs even when nothing else does.
    """

    @staticmethod
    def forward(ctx, module, batch, grad_anchor, per_sample_weights):
        ctx.module = module
        ctx.batch = batch
        # The batch's cache locks must not outlive the graph: if autograd drops it without
        # running backward, ctx is collected and the locks go with it.
        weakref.finalize(ctx, batch.release)
        copies = module._copy_rows.for_forward(batch) if module._copy_rows is not None else None
        return module.backend.forward(module.row_stores, batch.lookups, batch.slot_of_index, module.pooling,
                                      graphs=module._forward_graphs, copies=copies)

    @staticmethod
    def backward(ctx, grad_output):
        module, batch = ctx.module, ctx.batch
        if module.nan_check == "raise" and module.optimizer is not None:
            # Before anything is written: a refused update leaves every row and every lock as it was
            # before the batch (its own locks go with it).
            lookups = batch.lookups
            try:
                validation.check_finite_update(module.tables, module.pooling, grad_output, lookups.offsets,
                                               lookups.batch_size, lookups.per_sample_weights,
                                               module._features_if_shared)
            except ValueError:
                batch.release()
                raise
        grad_psw = None
        # The batch's rows are where its prefetch put them: its slots stay locked, and the rows
        # it left in their backing stores stay out of the cache until it is released.
        if ctx.needs_input_grad[3]:
            grad_psw = module.backend.per_sample_weights_grad(
                grad_output, module.row_stores, batch.lookups, batch.slot_of_index, module.pooling
            )
        module._apply_update(grad_output.contiguous(), batch)
        return None, None, None, grad_psw
