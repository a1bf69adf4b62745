"""What the SlotCache tests share: two cached tables with an uncached one between them, traces
that exercise hits, set conflicts and uncached rows, and :class:`TrainingCheck`, which drives a
cache as serial training does and checks that every row read is its newest copy.

In simulation mode the Numba kernels run in the CUDA simulator on CPU tensors: the caches are
tiny (a few sets of a few ways) and the batches short. On a GPU the same tests run on CUDA
tensors.
"""

import time

import numpy as np
import torch

from tiered_tbe import default_device
from tiered_tbe.cache import CachedTable, CacheSimulator, SlotCache
from tiered_tbe.cache.policy import set_of_row_cpu

# Two cached tables with a table that is not cached between them (global rows 200..249).
# Both cached tables have 24-byte rows (fp32: 4 columns + 2 state values; 6 columns, no state),
# so the simulator's single row_bytes matches the cache's per-table byte counts.
TABLE_A = (0, 200, 4, 2)  # global_row_start, num_rows, dim, state_width
TABLE_B = (250, 100, 6, 0)
UNCACHED = (200, 250)
ROW_BYTES = 24
DEVICE = default_device()


def rows_tensor(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def initial_rows(start, num_rows, dim):
    """Distinct, exactly representable values: row g, column c holds g + c / 8."""
    rows = torch.arange(start, start + num_rows, dtype=torch.float32)[:, None]
    return rows + torch.arange(dim, dtype=torch.float32)[None, :] / 8


def make_tables(device=DEVICE, dtype=torch.float32):
    tables = []
    for start, num_rows, dim, state_width in (TABLE_A, TABLE_B):
        weights = initial_rows(start, num_rows, dim).to(device=device, dtype=dtype)
        state = None
        if state_width:
            state = initial_rows(start, num_rows, state_width).to(device) * -1
        tables.append(CachedTable(start, num_rows, dim, weights, state))
    return tables


def rows_of_set(the_set, num_sets, count, low=0, high=200):
    """The first ``count`` rows in [low, high) that hash to ``the_set``."""
    found = [r for r in range(low, high) if set_of_row_cpu(r, num_sets) == the_set]
    assert len(found) >= count
    return found[:count]


def make_trace(num_batches=30, num_sets=4, seed=0):
    """Batches of global rows with repeats, hot rows, uncached rows, and set conflicts."""
    rng = np.random.default_rng(seed)
    hot = np.array([3, 17, 42, 99, 260, 301])
    conflicting = np.array(rows_of_set(1, num_sets, 9))  # more rows of one set than it has ways
    batches = []
    for b in range(num_batches):
        parts = [rng.choice(hot, size=rng.integers(2, 8)),  # repeats within and across batches
                 rng.integers(0, 200, size=rng.integers(2, 6)),
                 rng.integers(250, 350, size=rng.integers(1, 5)),
                 rng.integers(*UNCACHED, size=rng.integers(0, 3))]
        if b % 5 == 2:
            parts.append(conflicting[rng.permutation(conflicting.size)[: rng.integers(5, 10)]])
        if b % 7 == 3:
            parts.append(conflicting[:2])  # rows hit again later
        batch = np.concatenate(parts)
        batches.append(rng.permutation(batch).astype(np.int64))
    return batches


def prefetch(cache: SlotCache, rows: torch.Tensor):
    """``cache.prefetch``, then wait for the batch's rows (the staged mover moves them behind the call)."""
    batch = cache.prefetch(rows)
    cache.wait_filled(batch)
    return batch


def is_cached_row(rows):
    return (rows < UNCACHED[0]) | ((rows >= TABLE_B[0]) & (rows < TABLE_B[0] + TABLE_B[1]))


class TrainingCheck:
    """Drives a SlotCache as serial training does and checks every row's newest copy.

    Each batch adds 1 to every column (and state value) of every unique row it uses: in the
    row's slot, or in its backing store when its slot is -1. ``updates[g]`` counts them, so
    row g must read ``initial + updates[g]`` wherever the cache says it is.
    """

    def __init__(self, cache: SlotCache):
        self.cache = cache
        self.updates = np.zeros(400, dtype=np.int64)

    def expected(self, table: CachedTable, rows):
        updates = torch.as_tensor(self.updates[rows])[:, None].float()
        value = initial_rows(0, 400, table.dim)[rows] + updates
        state = None
        if table.state is not None:
            state = -initial_rows(0, 400, table.state_width)[rows] + updates
        return value, state

    def table_of(self, row):
        return next(t for t in self.cache.tables if t.global_row_start <= row < t.global_row_start + t.num_rows)

    def step(self, batch: np.ndarray) -> torch.Tensor:
        return self.train(self.prefetch(batch), batch)

    def prefetch(self, batch: np.ndarray):
        return self.cache.prefetch(torch.from_numpy(batch).to(self.cache.device))

    def train(self, prefetched, batch: np.ndarray) -> torch.Tensor:
        """Check and update the rows of a prefetched batch (batches train in prefetch order)."""
        cache = self.cache
        cache.wait_filled(prefetched)
        slot_of_index = prefetched.slot_of_index
        slots = slot_of_index.long().cpu()
        cached = torch.from_numpy(is_cached_row(batch))
        # The remap: uncached tables -1; otherwise the slot holds the row, or -1.
        assert (slots[~cached] == -1).all()
        tags = cache.tags.cpu()
        assert (tags[slots[slots >= 0]] == torch.from_numpy(batch)[slots >= 0]).all()
        # Every lookup reads its row's newest copy, from its slot or its backing store.
        for row in np.unique(batch[is_cached_row(batch)]):
            table = self.table_of(row)
            slot = int(slots[np.flatnonzero(batch == row)[0]])
            weights, state = self._copy(table, row, slot)
            want_weights, want_state = self.expected(table, [row])
            torch.testing.assert_close(weights, want_weights[0], rtol=0, atol=0)
            if state is not None:
                torch.testing.assert_close(state, want_state[0], rtol=0, atol=0)
            # Backward's update, where the kernels would apply it.
            if slot >= 0:
                cache.weights[slot, : table.dim] += 1
                cache.state[slot, : table.state_width] += 1
            else:
                local = row - table.global_row_start
                table.weights[local] += 1
                if table.state is not None:
                    table.state[local] += 1
            self.updates[row] += 1
        cache.mark_dirty(prefetched)
        cache.unlock(prefetched)
        return slot_of_index

    def _copy(self, table, row, slot):
        if slot >= 0:
            state = self.cache.state[slot, : table.state_width] if table.state is not None else None
            return self.cache.weights[slot, : table.dim].float().cpu(), None if state is None else state.cpu()
        local = row - table.global_row_start
        state = table.state[local] if table.state is not None else None
        return table.weights[local].float().cpu(), None if state is None else state.cpu()

    def check_backing_after_flush(self):
        self.cache.flush()
        assert int(self.cache.dirty.sum()) == 0
        for table in self.cache.tables:
            rows = list(range(table.global_row_start, table.global_row_start + table.num_rows))
            want_weights, want_state = self.expected(table, rows)
            torch.testing.assert_close(table.weights.float().cpu(), want_weights, rtol=0, atol=0)
            if table.state is not None:
                torch.testing.assert_close(table.state.cpu(), want_state, rtol=0, atol=0)


def assert_same_state(cache: SlotCache, simulator: CacheSimulator):
    for name in ("tags", "last_use", "use_count", "dirty"):
        np.testing.assert_array_equal(getattr(cache, name).cpu().numpy(), getattr(simulator, name), err_msg=name)
    if cache.row_uses.numel() > 1:  # a policy that counts rows: the cache's per-row counts, the simulator's
        # grown to past the largest row it saw (rows beyond it were never named: 0)
        counted = np.zeros(cache.row_uses.numel(), dtype=np.int16)
        counted[: simulator.row_uses.size] = simulator.row_uses
        np.testing.assert_array_equal(cache.row_uses.cpu().numpy(), counted, err_msg="row_uses")
        assert counted.any()


def slow_write_backs(cache: SlotCache, seconds: float = 0.02) -> None:
    """Make the staged mover's write-backs land late (a race that skipped a wait would show)."""
    if cache.mover.name == "staged":
        cache.mover.delay = lambda where: time.sleep(seconds) if where == "write_back" else None
