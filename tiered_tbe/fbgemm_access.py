"""What FBGEMM's TBE lets its owner read and change, on :class:`~tiered_tbe.TieredEmbeddingBags`.

TorchRec's kernels and optimizers (and code written against FBGEMM's
``SplitTableBatchedEmbeddingBagsCodegen``) reach the tables through these methods: the weights and
the optimizer state of each table as views, the learning rate and the other hyper-parameters
(changed between steps by an LR schedule), the optimizer step, ``flush()`` and
``reset_cache_states()``. Names and shapes are FBGEMM's (:mod:`tiered_tbe.fbgemm_names`).

A new learning rate costs no recompile and no CUDA-graph capture: the kernels read the
hyper-parameters from the step's arguments, a device tensor refreshed when its values change
(``kernels/update_rows.py``, ``base/graphs.py``).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from tiered_tbe.fbgemm_names import fbgemm_entry, with_hyper_parameters


class FbgemmAccess:
    """Mixin of :class:`~tiered_tbe.module.TieredEmbeddingBags`: FBGEMM-shaped access to its tables."""

    def _fused_optimizer(self, what: str):
        if self.optimizer is None:
            raise RuntimeError(f"{what}: the module has no optimizer (its tables are frozen)")
        return self.optimizer

    def split_embedding_weights(self) -> list[torch.Tensor]:
        """Each table's weights, ``[num_embeddings, embedding_dim]`` in the weights dtype: views of the
        backing stores, after a flush (every update included). Writing into them writes the tables;
        call :meth:`reset_cache_states` after writing a cached table (its cached copies are stale)."""
        self.flush()
        return list(self.storage.table_weights)

    def get_optimizer_state(self) -> list[dict[str, torch.Tensor]]:
        """Each table's optimizer state under FBGEMM's names, as views of the backing stores, after a flush.

        ``RowwiseAdagrad``: ``{"sum": [rows]}``; ``Adagrad``: ``{"sum": [rows, dim]}``; ``Adam`` and
        ``LAMB``: ``{"exp_avg": [rows, dim], "exp_avg_sq": [rows, dim]}``; ``PartialRowwiseAdam``:
        ``exp_avg_sq`` is ``[rows]``. All fp32. ``SGD`` keeps no state: ``[]``, as FBGEMM returns.

        Raises:
            RuntimeError: the module has no optimizer.
        """
        optimizer = self._fused_optimizer("get_optimizer_state")
        names = fbgemm_entry(optimizer).state_names
        if not names:
            return []
        self.flush()
        states = []
        for t, spec in enumerate(self.tables):
            state, column, views = self.storage.table_state[t], 0, {}
            for name, (_, width) in zip(names, optimizer.state_columns(spec.embedding_dim)):
                views[name] = state[:, column] if width == 1 else state[:, column : column + width]
                column += width
            states.append(views)
        return states

    def get_learning_rate(self) -> float:
        """The optimizer's learning rate. RuntimeError without an optimizer."""
        return float(self._fused_optimizer("get_learning_rate").lr)

    def set_learning_rate(self, lr: float) -> None:
        """Train the next steps at ``lr`` (a finite number >= 0), as FBGEMM's ``set_learning_rate``.

        Takes effect at the next backward; batches already through their backward keep theirs.

        Raises:
            ValueError: ``lr`` not a finite number >= 0. RuntimeError: no optimizer.
        """
        optimizer = self._fused_optimizer("set_learning_rate")
        lr = float(lr)
        if not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"set_learning_rate: lr must be a finite number >= 0, got {lr}")
        self.optimizer = dataclasses.replace(optimizer, lr=lr)

    def update_hyper_parameters(self, params_dict: dict[str, float]) -> None:
        """Change hyper-parameters by FBGEMM's names: ``lr``, ``eps``, ``beta1``, ``beta2``, ``weight_decay``.

        All or nothing: ValueError naming a key this optimizer has no field for (or FBGEMM no name
        for), or a value out of range, before any change.
        """
        self.optimizer = with_hyper_parameters(self._fused_optimizer("update_hyper_parameters"), dict(params_dict))

    def get_optimizer_step(self) -> int:
        """Optimizer steps taken: the updates so far (Adam's bias corrections use the next one, + 1)."""
        return int(self.optimizer_step)

    def set_optimizer_step(self, step: int) -> None:
        """Set the optimizer step (e.g. when resuming): the next update is step ``step + 1``, as FBGEMM's.

        Raises:
            ValueError: ``step`` not a whole number >= 0.
        """
        if isinstance(step, bool) or int(step) != step or step < 0:
            raise ValueError(f"set_optimizer_step: step must be a whole number >= 0, got {step!r}")
        self.optimizer_step = int(step)

    def reset_cache_states(self, write_back: bool = True) -> None:
        """Empty the slot cache, so the next batches read their rows from the backing stores. Every
        dirty row is written back first (FBGEMM's method drops the cache without writing it back; here
        no update is lost), unless ``write_back=False``: after the backing stores were written (a
        checkpoint loaded into the views of :meth:`split_embedding_weights`), the cached copies are
        stale and are dropped. Nothing to do without a cache.

        Raises:
            RuntimeError: while a batch is in flight (prefetched, or forwarded and awaiting its backward).
        """
        if self.cache is None:
            return
        self.run_deferred_unlocks()
        if self._prefetched or self.cache.num_locked():
            raise RuntimeError("reset_cache_states while batches are in flight (prefetched, or awaiting backward)")
        if write_back:
            self.cache.flush()
        self.cache.invalidate()
