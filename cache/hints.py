"""The lookahead window of a slot cache: which recorded upcoming batch names which row.

Lookahead hints are incremental: each batch of the window is recorded once, as a bit in a
per-row word (``window_bits``: bit ``s % 64`` for the batch of step ``s``), and forgotten when
its step is prefetched; a prefetch decodes each row's next use from its word, only for the
sets that choose a victim (``cache/policy_kernels.py``). Telling the cache of a batch costs one pass
over that batch's rows, whatever the window's length. The words cost 8 bytes of device memory
per row of the cached tables (allocated by the first hint only). The policy's side of it is
specified in ``cache/policy.py`` ("Lookahead window").

The bits are set and cleared by one Triton kernel over a batch's rows (``cache/window_bits.py``), loaded
at the first hint only: the policy simulator and the hit-rate planner import the cache without Triton.
"""

from __future__ import annotations

import torch

from tiered_tbe.cache._kernels import WINDOW_BITS
from tiered_tbe.cache.launch import KernelLauncher
from tiered_tbe.cache.policy import EMPTY, NEXT_USE_UNKNOWN

# Most batches after the next prefetch that lookahead hints can name: the batch ``d`` places after
# it is prefetched at step ``step + 1 + d``, and add_upcoming takes steps up to
# ``step + 1 + WINDOW_BITS``, so ``d <= WINDOW_BITS``.
MAX_LOOKAHEAD = WINDOW_BITS

# Batches after the one being prefetched that a lookahead cache learns from, by default (a
# PrefetchPipeline's, and the hit-rate tool's). On the Criteo-sized benchmark (Zipf 1.05, 5% cache,
# depth 2) the CPU simulator gives rows moved / LRU of 0.89 at 8, 0.81 at 16, 0.72 at 32, 0.64 at 64
# (docs/hit_rates.md); the H200 measured 0.72 at 32 and 0.64 at 64. 64 is the most the
# window's bits hold (MAX_LOOKAHEAD). The window's batches wait on the device: 64 of the benchmark's
# (B = 65536 x 26 lookups) take ~1.7 GB.
DEFAULT_LOOKAHEAD = MAX_LOOKAHEAD


class UpcomingBatches:
    """The recorded batches of the window and their per-row bits.

    ``window_bits``: int64 [rows_end] once a batch was recorded (``None`` before): bit ``s %
    WINDOW_BITS`` set while the recorded batch of step ``s`` names the row. ``kernel_bits``:
    what the prefetch kernel takes for it (a [1] dummy until then).
    """

    def __init__(self, rows_end: int, table_starts: torch.Tensor, table_ends: torch.Tensor, launcher: KernelLauncher):
        self.rows_end = rows_end
        self.table_starts, self.table_ends = table_starts, table_ends  # int64 [T]: the cached tables' global rows
        self.device = table_starts.device
        self.launcher = launcher
        self.window_bits: torch.Tensor | None = None
        self._no_bits = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.kernel_bits = launcher.array(self._no_bits)
        self._rows_of_step: dict[int, torch.Tensor] = {}  # the rows each recorded step was given (not copies)

    @property
    def steps(self) -> list[int]:
        """The recorded steps, ascending."""
        return sorted(self._rows_of_step)

    def add(self, rows: torch.Tensor, step: int, current_step: int) -> None:
        """Record ``rows`` (int64 [M], contiguous; rows of no cached table ignored) as the batch of
        ``step``, keeping the tensor itself until the step is forgotten; ``current_step`` is the cache's
        step. ``TypeError`` / ``ValueError`` and no change for a step outside ``current_step + 2 ..
        current_step + 1 + WINDOW_BITS`` or recorded."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {step!r}")
        if not current_step + 1 < step <= current_step + 1 + WINDOW_BITS:
            raise ValueError(f"step {step} outside the window of hints: steps {current_step + 2} .. "
                             f"{current_step + 1 + WINDOW_BITS} (the next prefetch is step {current_step + 1}; "
                             f"at most MAX_LOOKAHEAD = {MAX_LOOKAHEAD} batches after it)")
        if step in self._rows_of_step:
            raise ValueError(f"step {step} is already recorded (upcoming_steps: {self.steps})")
        if self.window_bits is None:
            self.window_bits = torch.zeros(self.rows_end, dtype=torch.int64, device=self.device)
            self.kernel_bits = self.launcher.array(self.window_bits)
        # The next prefetch's step shares its bit with step + 1 + WINDOW_BITS: forget it first.
        self.forget(through=current_step + 1)
        self._rows_of_step[step] = rows
        self._update_bits(rows, step, set_bit=True)

    def forget(self, through: int) -> None:
        """Clear the bits of every recorded step ``<= through`` and drop its rows."""
        for step in [s for s in self._rows_of_step if s <= through]:
            rows = self._rows_of_step.pop(step)
            if rows.is_cuda:  # the rows may come from another stream: free them after this one's clear
                rows.record_stream(torch.cuda.current_stream(self.device))
            self._update_bits(rows, step, set_bit=False)

    def clear(self) -> None:
        if self._rows_of_step:
            self.forget(through=max(self._rows_of_step))

    def next_use_of_slots(self, tags: torch.Tensor, current_step: int) -> torch.Tensor:
        """int64 [S]: the soonest recorded step in ``current_step + 2 .. current_step + 1 +
        WINDOW_BITS`` naming each slot's row (``tags``), else ``NEXT_USE_UNKNOWN``. Plain torch:
        the reference of the prefetch kernel's decode."""
        next_use = torch.full(tags.shape, NEXT_USE_UNKNOWN, dtype=torch.int64, device=self.device)
        if self.window_bits is None:
            return next_use
        words = torch.where(tags != EMPTY, self.window_bits[tags.clamp(min=0)], 0)
        next_step = current_step + 1
        for step in sorted(self._rows_of_step, reverse=True):  # the soonest step is written last
            if next_step < step <= next_step + WINDOW_BITS:
                named = ((words >> (step % WINDOW_BITS)) & 1).bool()
                next_use = torch.where(named, step, next_use)
        return next_use

    def _update_bits(self, rows: torch.Tensor, step: int, set_bit: bool) -> None:
        """Set (or clear) bit ``step % WINDOW_BITS`` of the words of ``rows`` in the cached tables."""
        from tiered_tbe.cache.window_bits import update_window_bits  # Triton: loaded by the first hint only

        update_window_bits(self.window_bits, rows, self.table_starts, self.table_ends, step, set_bit)


class LookaheadHints:
    """The lookahead hints of :class:`~tiered_tbe.cache.slot_cache.SlotCache` (a mixin): the cache
    records each upcoming batch's rows in an :class:`UpcomingBatches` (``self._upcoming``) and its
    prefetch decodes them. Needs of the cache: ``_upcoming``, ``_step``, ``tags``, ``_check_rows``,
    ``_order_metadata`` and ``_metadata_done``."""

    @property
    def window_bits(self) -> torch.Tensor | None:
        """int64 [R]: per row, the bits of the recorded upcoming steps naming it (None before any hint)."""
        return self._upcoming.window_bits

    @property
    def upcoming_steps(self) -> list[int]:
        """The steps whose batches :meth:`add_upcoming` recorded and no prefetch has reached, ascending."""
        return self._upcoming.steps

    def add_upcoming(self, global_rows: torch.Tensor, step: int) -> None:
        """Tell the lookahead policy the rows of the batch that the prefetch at cache step ``step`` will fetch.

        Args:
            global_rows: int64 [M], that batch's global rows (repeats allowed; rows outside every
                cached table, e.g. ``INT64_MAX`` padding, are ignored).
            step: the step of that batch's prefetch: the batch ``d`` places after the next prefetch
                (whose step is ``self.step + 1``) has step ``self.step + 1 + d``, for ``d`` in
                ``1 .. MAX_LOOKAHEAD``. A step already recorded raises (skip those in
                :attr:`upcoming_steps`).

        Record each batch once, when it enters the window: the prefetch at step ``t`` ranks a
        victim's rows by the soonest recorded step in ``t + 1 .. t + WINDOW_BITS`` naming them
        (policy.py, "Lookahead window"), and forgets its own step and any before it. One kernel
        launch over ``M`` rows; no sort, no host sync. The first call allocates
        :attr:`window_bits`. The cache keeps ``global_rows`` itself, not a copy, until the step is
        prefetched or :meth:`clear_upcoming` runs, and clears the step's bits with it then: do not
        write to it meanwhile (pass a clone if you must). Only the lookahead policy reads the hints.

        Raises ``TypeError`` / ``ValueError`` for rows not a 1-D int64 tensor on the cache's
        device, or a step outside ``self.step + 2 .. self.step + 1 + WINDOW_BITS`` or already
        recorded; nothing changes then.
        """
        rows = self._check_rows(global_rows)
        self._order_metadata()
        self._upcoming.add(rows, step, self._step)
        self._metadata_done()

    def clear_upcoming(self) -> None:
        """Forget every recorded hint (e.g. when the batches they name will not be prefetched)."""
        self._order_metadata()
        self._upcoming.clear()
        self._metadata_done()

    def next_use_of_slots(self) -> torch.Tensor:
        """int64 [S]: the ``next_use`` the prefetch at step ``self.step + 1`` will give each slot's
        row from the recorded hints: the soonest recorded step ``s`` in ``self.step + 2 ..
        self.step + 1 + WINDOW_BITS`` whose bit is set in the row's :attr:`window_bits`, else
        ``NEXT_USE_UNKNOWN`` (also for empty slots and before any hint).

        Plain torch, for tests and inspection: the reference of the prefetch kernel's decode.
        """
        return self._upcoming.next_use_of_slots(self.tags, self._step)
