"""Where a module's updates are and how they are read and saved: flush, full tables, cache statistics
and the ``state_dict`` (every update included: a checkpoint flushes first).

A mixin of :class:`~tiered_tbe.module.TieredEmbeddingBags` (it reads the module's ``storage``, ``cache``,
``tables``, ``table_names``, ``optimizer`` and its queue of prefetched batches).
"""

from __future__ import annotations

import torch

from tiered_tbe.cache.stats import CacheStats


class TableState:
    """Flush, tables, statistics, state_dict and load_state_dict of a module's tables."""

    def flush(self) -> None:
        """Write every dirty cached row (and its optimizer state) back to its backing store. With
        the staged mover it returns once they are there (every row move in flight lands first)."""
        if self.cache is not None:
            self.cache.flush()

    def table(self, t: int) -> torch.Tensor:
        """The full weights of table t, ``[num_embeddings, embedding_dim]``: a view of its
        backing store after a flush (every update included)."""
        self.flush()
        return self.storage.table_weights[t]

    def cache_stats(self) -> CacheStats:
        return self.cache.stats() if self.cache is not None else CacheStats()

    def reset_cache_stats(self) -> None:
        if self.cache is not None:
            self.cache.reset_stats()

    def _state_views(self, t: int) -> dict[str, torch.Tensor]:
        """The state_dict entries of table t, as views of the backing store: its weights, and
        its optimizer state under the optimizer's names (a width-1 entry is 1-D)."""
        name = self.table_names[t]
        views = {f"{name}.weight": self.storage.table_weights[t]}
        state = self.storage.table_state[t]
        if self.optimizer is not None and state is not None:
            column = 0
            for state_name, width in self.optimizer.state_columns(self.tables[t].embedding_dim):
                views[f"{name}.{state_name}"] = state[:, column] if width == 1 else state[:, column : column + width]
                column += width
        return views

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self.flush()  # a checkpoint holds every update (TorchRec issue #1674)
        for t in range(len(self.tables)):
            for key, view in self._state_views(t).items():
                destination[prefix + key] = view if keep_vars else view.detach()
        if self.optimizer is not None:
            destination[prefix + "optimizer_step"] = torch.tensor(self.optimizer_step)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        expected = {}
        for t in range(len(self.tables)):
            expected.update({prefix + k: v for k, v in self._state_views(t).items()})
        if self.optimizer is not None:
            expected[prefix + "optimizer_step"] = None
        problems = []
        for key, view in expected.items():
            if key not in state_dict:
                missing_keys.append(key)
            elif view is not None and tuple(state_dict[key].shape) != tuple(view.shape):
                problems.append(f"{key}: shape {tuple(state_dict[key].shape)}, expected {tuple(view.shape)}")
        # This module has no children: every other key under its prefix is unexpected.
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in expected)
        if problems:
            error_msgs.extend(problems)
            return  # touch nothing when any entry is wrong
        if self.cache is not None:
            self.run_deferred_unlocks()
            locked = self.cache.num_locked()
            if self._prefetched or locked:
                raise RuntimeError(
                    f"load_state_dict while batches are in flight: {len(self._prefetched)} batches prefetched and not "
                    f"forwarded, {locked} cache slots locked (by those, and by batches forwarded whose backward has "
                    "not run). Finish them (forward, then backward), or call cancel_prefetched() to drop the "
                    "prefetched ones; a forwarded batch's slots are released by its backward, or when its output "
                    "is dropped")
            self.cache.invalidate()  # the cached copies are about to be stale
        with torch.no_grad():
            for key, view in expected.items():
                if key in state_dict and view is not None:
                    view.copy_(state_dict[key])
        if prefix + "optimizer_step" in state_dict:
            self.optimizer_step = int(state_dict[prefix + "optimizer_step"])
        if self._copy_rows is not None:
            self._copy_rows.forget()  # a forward's copies of rows read in place are stale now
