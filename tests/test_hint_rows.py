"""kernels/hint_rows.py: a lookahead hint's distinct rows by the Triton kernels, against the plain-torch reference
and a Python set of the batch's rows."""

from __future__ import annotations

import pytest
import torch

from tiered_tbe.base.codes import INT32_MAX, INT64_MAX
from tiered_tbe.kernels.hint_rows import hint_rows, hint_rows_reference


def batch(table_rows: list[int], batch_size: int, max_bag: int, padding: int, generator: torch.Generator,
          index_dtype=torch.int64, wild: bool = False):
    """A TBE batch's indices (``padding`` more positions past the last bag) and feature starts; ``wild``:
    indices below 0 and past their tables too."""
    features = len(table_rows)
    lengths = torch.randint(0, max_bag + 1, (features * batch_size,), generator=generator)
    lengths[0] = 0  # an empty bag
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    parts = []
    for f, rows in enumerate(table_rows):
        count = int(lengths[f * batch_size:(f + 1) * batch_size].sum())
        low, high = (-3, rows + 5) if wild else (0, rows)
        parts.append(torch.randint(low, high, (count,), generator=generator))
    indices = torch.cat(parts + [torch.full((padding,), 7)]).to(index_dtype)
    return indices, offsets[::batch_size].contiguous().to(index_dtype)


def expected_rows(indices, feature_starts, table_rows, row_offset) -> list[int]:
    """The set of the batch's global rows, each index clamped into its table, in plain Python."""
    rows = set()
    for f, count in enumerate(table_rows):
        for i in indices[int(feature_starts[f]):int(feature_starts[f + 1])].tolist():
            rows.add(int(row_offset[f]) + min(max(i, 0), count - 1))
    return sorted(rows)


def run_both(indices, feature_starts, table_rows, row_offset, num_rows):
    sizes = torch.tensor(table_rows, dtype=torch.int64)
    offsets = torch.tensor(row_offset, dtype=torch.int64)
    return (hint_rows(indices, feature_starts, sizes, offsets, num_rows),
            hint_rows_reference(indices, feature_starts, sizes, offsets, num_rows))


MANY_TABLES = [3, 900, 1, 64, 2, 11, 30, 8, 1, 17] * 3 + [9, 4, 6]  # 33 features: six steps of the binary search


@pytest.mark.parametrize("table_rows", [[1], [97, 1, 40], [5] * 7, MANY_TABLES])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_hint_rows_equal_the_reference_and_a_set_of_the_batch_rows(table_rows, index_dtype):
    generator = torch.Generator().manual_seed(len(table_rows))
    row_offset = [sum(table_rows[:f]) for f in range(len(table_rows))]
    for step in range(3):
        batch_size = int(torch.randint(1, 6, (), generator=generator))
        indices, starts = batch(table_rows, batch_size, 9, padding=step * 5, generator=generator,
                                index_dtype=index_dtype, wild=step == 2)
        (rows, count), (want_rows, want_count) = run_both(indices, starts, table_rows, row_offset, sum(table_rows))
        expected = expected_rows(indices.long(), starts.long(), table_rows, row_offset)
        assert rows.dtype == torch.int64 and rows.shape == (indices.numel(),)
        assert int(count) == int(want_count) == len(expected), step
        assert torch.equal(rows, want_rows), step
        assert rows[: len(expected)].tolist() == expected and (rows[len(expected):] == INT64_MAX).all(), step


def test_hint_rows_of_a_row_repeated_thousands_of_times_and_of_nothing():
    indices = torch.full((5000,), 3)
    starts = torch.tensor([0, 5000, 5000])  # the second feature's bags are all empty
    (rows, count), _ = run_both(indices, starts, [10, 4], [0, 10], 14)
    assert int(count) == 1 and rows[0] == 3 and (rows[1:] == INT64_MAX).all()
    empty = torch.empty(0, dtype=torch.int64)
    (rows, count), (want_rows, want_count) = run_both(empty, torch.tensor([0, 0, 0]), [10, 4], [0, 10], 14)
    assert rows.numel() == 0 and int(count) == int(want_count) == 0
    padding_only = torch.full((7,), 2)
    (rows, count), (want_rows, want_count) = run_both(padding_only, torch.tensor([0, 0, 0]), [10, 4], [0, 10], 14)
    assert int(count) == int(want_count) == 0 and (rows == INT64_MAX).all() and torch.equal(rows, want_rows)


def test_hint_rows_past_int32_keep_int64_keys():
    """Global rows past 2^31 (a table of 3 billion rows before the second): the sort runs on int64 keys."""
    table_rows = [3_000_000_000, 50]
    row_offset = [0, 3_000_000_000]
    indices = torch.tensor([2_999_999_999, 5, 2_999_999_999, 49, 0, 49, 70])
    starts = torch.tensor([0, 3, 6])
    (rows, count), (want_rows, want_count) = run_both(indices, starts, table_rows, row_offset, sum(table_rows))
    assert INT32_MAX < sum(table_rows)
    assert int(count) == int(want_count) == 4 and torch.equal(rows, want_rows)
    assert rows.tolist() == [5, 2_999_999_999, 3_000_000_000, 3_000_000_049] + [INT64_MAX] * 3


@pytest.mark.gpu
def test_hint_rows_on_the_gpu_equal_the_reference_at_benchmark_size(device):
    """The Criteo benchmark's batch (26 features, B=65536, bags of 1) and a ragged one with 4M lookups on
    the GPU: CUB's sort, the kernels and their launch grids at sizes the CPU tests cannot reach."""
    generator = torch.Generator(device).manual_seed(11)
    for table_rows, lookups in (([1460, 583, 10131227, 2202608] * 6 + [305, 24], 26 * 65536),
                                ([9_000_000, 8_000_000, 5_000_000, 2_000_000, 1], 4_000_000)):
        sizes = torch.tensor(table_rows, dtype=torch.int64, device=device)
        row_offset = torch.cumsum(sizes, 0) - sizes
        starts = torch.linspace(0, lookups, len(table_rows) + 1, device=device).long()
        indices = torch.randint(-2, 12_000_000, (lookups + 4096,), device=device, generator=generator)
        got = hint_rows(indices, starts, sizes, row_offset, int(sizes.sum()))
        want = hint_rows_reference(indices, starts, sizes, row_offset, int(sizes.sum()))
        assert int(got[1]) == int(want[1]) > 0 and torch.equal(got[0], want[0])
